"""The exchange tree's frames: a 4-byte big-endian length, then one JSON array.

JSON, not pickle: a frame comes from the network and is only ever data. The first element of
every frame is its kind (one letter, ``node.py`` names them).
"""

from __future__ import annotations

import json
import struct
from typing import Any

_HEADER = struct.Struct("!I")
MAX_FRAME = 16 << 20  # bytes: a frame larger than this is a protocol error, not a message


class ProtocolError(RuntimeError):
    """A peer sent bytes that are not a frame of this protocol."""


def encode(message: list[Any]) -> bytes:
    """One frame holding ``message``."""
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


class Reader:
    """Splits a connection's bytes into frames (a frame may arrive in several reads, several
    frames in one)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[list[Any]]:
        """The frames completed by ``data``, in order."""
        buf = self._buf
        buf += data
        out: list[list[Any]] = []
        start = 0
        while len(buf) - start >= 4:
            (n,) = _HEADER.unpack_from(buf, start)
            if n > MAX_FRAME:
                raise ProtocolError(f"a frame of {n} bytes (the limit is {MAX_FRAME}).")
            if len(buf) - start - 4 < n:
                break
            try:
                message = json.loads(bytes(buf[start + 4 : start + 4 + n]))
            except ValueError as e:
                raise ProtocolError(f"a frame that is not JSON ({e}).") from None
            if not isinstance(message, list) or not message or not isinstance(message[0], str):
                raise ProtocolError(f"a frame that is not [kind, ...]: {message!r:.80}.")
            out.append(message)
            start += 4 + n
        if start:
            del buf[:start]
        return out
