"""Frames (torchshard._backend.exchange.wire): a length and one JSON array; split across reads
and joined in one; what is not a frame is a ProtocolError."""

from __future__ import annotations

import struct

import pytest

from torchshard._backend.exchange.wire import MAX_FRAME, ProtocolError, Reader, encode


def test_frames_survive_any_split():
    data = b"".join(encode(["U", "main", i, 0, {"x": "é" * i}]) for i in range(5))
    for step in (1, 3, 7, len(data)):
        r = Reader()
        got = []
        for i in range(0, len(data), step):
            got += r.feed(data[i : i + step])
        assert got == [["U", "main", i, 0, {"x": "é" * i}] for i in range(5)]


def test_what_is_not_a_frame_is_refused():
    with pytest.raises(ProtocolError, match="not JSON"):
        Reader().feed(struct.pack("!I", 3) + b"{{{")
    with pytest.raises(ProtocolError, match="not \\[kind"):
        Reader().feed(struct.pack("!I", 2) + b"{}")
    with pytest.raises(ProtocolError, match="the limit"):
        Reader().feed(struct.pack("!I", MAX_FRAME + 1))
