"""The exchange tree's frames: a 4-byte big-endian length, then the body: one JSON array, or,
for the frame every exchange sends (an all-reduce's value up or its result down, when every
process so far passed the same call and digest), the same array packed with ``struct``
(decoded to the same list): a frame costs a few microseconds of Python, not a JSON round trip.

JSON, not pickle: a frame comes from the network and is only ever data. The first element of
every frame is its kind (one letter, ``node.py`` names them).
"""

from __future__ import annotations

import json
import struct
from typing import Any

_HEADER = struct.Struct("!I")
MAX_FRAME = 16 << 20  # bytes: a frame larger than this is a protocol error, not a message
_PACKED = 1  # the first byte of a packed body (a JSON body starts with "[")
# packed: marker, kind, round, call, digest, then three lengths (channel, what, ranges)
_HEAD = struct.Struct("!BcBIqHHHB")
_KINDS = (b"U", b"D")


class ProtocolError(RuntimeError):
    """A peer sent bytes that are not a frame of this protocol."""


def _packable(message: list[Any]) -> bytes | None:
    """The packed body of ``message``, when it is an agree value of one group (else ``None``)."""
    if len(message) != 5 or message[0] not in ("U", "D"):
        return None
    value = message[4]
    if value.get("K") != "agree" or len(value["g"]) != 1:
        return None
    what, code, ranks = value["g"][0]
    try:
        digest = int(code)
    except ValueError:
        return None
    if not -(1 << 63) <= digest < (1 << 63) or not 0 <= message[2] < (1 << 32):
        return None
    channel = message[1].encode()
    name = what.encode()
    stats = [*value["s"], *value["lo"], *value["hi"]]
    pairs = (len(ranks) - 1) // 2
    if len(channel) > 0xFFFF or len(name) > 0xFFFF or len(value["s"]) > 0xFF:
        return None
    head = _HEAD.pack(
        _PACKED,
        message[0].encode(),
        message[3],
        message[2],
        digest,
        len(channel),
        len(name),
        pairs,
        len(value["s"]),
    )
    return b"".join(
        (head, channel, name, struct.pack(f"!{len(ranks)}I{len(stats)}q", *ranks, *stats))
    )


def encode(message: list[Any]) -> bytes:
    """One frame holding ``message``."""
    body = _packable(message)
    if body is None:
        body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def _unpack(body: bytes) -> list[Any]:
    _, kind, rnd, call, digest, nc, nw, pairs, ns = _HEAD.unpack_from(body)
    at = _HEAD.size
    channel = body[at : at + nc].decode()
    at += nc
    what = body[at : at + nw].decode()
    at += nw
    nums = struct.unpack_from(f"!{2 * pairs + 1}I{3 * ns}q", body, at)
    ranks = list(nums[: 2 * pairs + 1])
    stats = nums[2 * pairs + 1 :]
    value = {
        "K": "agree",
        "g": [[what, str(digest), ranks]],
        "s": list(stats[:ns]),
        "lo": list(stats[ns : 2 * ns]),
        "hi": list(stats[2 * ns :]),
    }
    return [kind.decode(), channel, call, rnd, value]


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
            body = bytes(buf[start + 4 : start + 4 + n])
            start += 4 + n
            if body[:1] == bytes([_PACKED]):
                try:
                    out.append(_unpack(body))
                except (struct.error, UnicodeDecodeError) as e:
                    raise ProtocolError(f"a packed frame that does not unpack ({e}).") from None
                continue
            try:
                message = json.loads(body.decode())
            except ValueError as e:
                raise ProtocolError(f"a frame that is not JSON ({e}).") from None
            if not isinstance(message, list) or not message or not isinstance(message[0], str):
                raise ProtocolError(f"a frame that is not [kind, ...]: {message!r:.80}.")
            out.append(message)
        if start:
            del buf[:start]
        return out
