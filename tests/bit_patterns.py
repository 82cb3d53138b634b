"""Floating-point values whose bits a float sum would change, for the bit-exactness tests of
dispatch (torch_xla in the test process, DTensor in the gloo workers, which import this module
by name from ``tests/``).

``odd_values(dtype, n)`` cycles through, for each float dtype: -0.0, quiet NaNs with payloads
(both signs), signalling NaNs (both signs), subnormals (the smallest, the largest, a negative
one) and 1.0; complex dtypes take their real parts from the list and their imaginary parts
from it shifted by three. ``bits(t)`` is a tensor's bits as integers of its width, so that
``torch.equal`` compares bit for bit. Nothing here uses torchshard.
"""

from __future__ import annotations

import torch

FLOATS = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]

_INTS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}

_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}

# Unsigned bit patterns: -0.0, +qNaN(payload), -qNaN(payload), +sNaN, -sNaN, the smallest
# and the largest subnormal, a negative subnormal, 1.0.
_PATTERNS = {
    torch.float16: [0x8000, 0x7E5A, 0xFE01, 0x7C01, 0xFC05, 0x0001, 0x03FF, 0x8123, 0x3C00],
    torch.bfloat16: [0x8000, 0x7FC5, 0xFFC1, 0x7F81, 0xFF85, 0x0001, 0x007F, 0x8042, 0x3F80],
    torch.float32: [
        0x80000000,
        0x7FC00001,
        0xFFC00123,
        0x7F800ABC,
        0xFF812345,
        0x00000001,
        0x007FFFFF,
        0x80000005,
        0x3F800000,
    ],
    torch.float64: [
        0x8000000000000000,
        0x7FF8000000000001,
        0xFFF8000000000123,
        0x7FF0000000ABCDEF,
        0xFFF0000000000042,
        0x0000000000000001,
        0x000FFFFFFFFFFFFF,
        0x8000000000000007,
        0x3FF0000000000000,
    ],
}


def _signed(value: int, width: int) -> int:
    return value - (1 << width) if value >= 1 << (width - 1) else value


def odd_values(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` values of the float or complex ``dtype`` cycling through the patterns above."""
    if dtype in _PARTS:
        part = _PARTS[dtype]
        real = odd_values(part, n + 3)
        return torch.complex(real[:n], real[3:])
    ints = _INTS[dtype]
    width = torch.iinfo(ints).bits
    raw = [_signed(v, width) for v in _PATTERNS[dtype]]
    cycle = (raw * (n // len(raw) + 1))[:n]
    return torch.tensor(cycle, dtype=ints).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width (complex: of its parts, a last dim of 2)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_INTS[t.dtype])


def differing(got: torch.Tensor, want: torch.Tensor) -> str:
    """The first few bit patterns that differ, in hex, for an assertion message."""
    g, w = bits(got).reshape(-1), bits(want).reshape(-1)
    if g.shape != w.shape:
        return f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    mask = g != w
    width = g.element_size() * 8
    pairs = [
        (f"{int(a) & ((1 << width) - 1):#x}", f"{int(b) & ((1 << width) - 1):#x}")
        for a, b in zip(w[mask][:4].tolist(), g[mask][:4].tolist(), strict=True)
    ]
    return f"{int(mask.sum())} of {g.numel()} differ (expected -> got): {pairs}"
