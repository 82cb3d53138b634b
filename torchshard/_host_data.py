"""Validation and conversion of host-side leaves (numpy arrays, CPU tensors) to CPU tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchshard._core.tree import register_array_type

# Tensors are leaves: a batch dict of them flattens from its keys (``_core/tree.flatten``).
register_array_type(torch.Tensor)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_NP_SUPPORTED = frozenset(
    np.dtype(t)
    for t in (
        np.bool_,
        np.uint8,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
)


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def as_host_tensor(x: Any, where: str) -> torch.Tensor:
    """``x`` as a CPU tensor sharing its memory; raises ``TypeError`` naming ``where``."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(
                f"{where}: expected a host array (numpy array or CPU torch.Tensor), but got a "
                f"tensor on device {x.device}. Global tensors are read back with "
                "global_to_host_array."
            )
        if x.dtype not in _SUPPORTED:
            raise TypeError(
                f"{where}: dtype {x.dtype} is not supported; expected one of {_dtype_names()}."
            )
        return x.detach() if x.requires_grad else x
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
        if arr.dtype.newbyteorder("=") not in _NP_SUPPORTED:
            raise TypeError(
                f"{where}: numpy dtype {arr.dtype} is not supported; expected one of "
                f"{_dtype_names()} (bfloat16 as a torch.Tensor). Strings and objects must be "
                "encoded as numbers on the host."
            )
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if not arr.flags.writeable or any(st < 0 for st in arr.strides):
            # torch.from_numpy warns on read-only memory and refuses negative strides.
            arr = arr.copy()
        return torch.from_numpy(arr)
    raise TypeError(
        f"{where}: expected a numpy array or a CPU torch.Tensor, but got {type(x).__name__}"
        f" ({x!r:.60}). Wrap Python numbers with np.asarray(...) or torch.tensor(...)."
    )


def shape_dtype(x: Any, where: str) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype of an array-like spec leaf (``TensorSpec`` or ``.shape``/``.dtype``)."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{where}: expected a TensorSpec or an object with .shape and .dtype, but got "
            f"{type(x).__name__}."
        )
    return tuple(int(n) for n in shape), dtype
