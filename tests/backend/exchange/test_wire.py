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


def test_an_agree_value_packs_and_unpacks_to_the_same_frame():
    value = {
        "K": "agree",
        "g": [["call 3", "-42", [0, 3, 5, 9, 1]]],
        "s": [4, 1],
        "lo": [0, 0],
        "hi": [4, 1],
    }
    for kind in ("U", "D"):
        message = [kind, "main.loader2", 7, 1, value]
        frame = encode(message)
        assert frame[4] == 1  # packed, not JSON
        assert Reader().feed(frame) == [message]
    two = dict(value, g=[*value["g"], ["call 3", "7", [4, 4, 0]]])
    assert encode(["U", "c", 1, 0, two])[4:5] == b"["  # two groups: JSON
