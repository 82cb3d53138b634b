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


MASKED_ARRAY = (
    "expected a plain numpy array, but got a numpy masked array, whose mask would be lost "
    "(only its data would move). Pass x.filled(fill_value), and the mask as a leaf of its own "
    "(np.ma.getmaskarray(x)) if the step needs it."
)



# Named tensors (and `Tensor.has_names`) are in torch 2.9.0 and gone in 2.13.0, 2.14.1, 2.15.0.
HAS_NAMED_TENSORS = hasattr(torch.Tensor, "has_names")


def has_names(x: torch.Tensor) -> bool:
    """Whether ``x`` is a named tensor (never, on a torch without named tensors)."""
    return HAS_NAMED_TENSORS and x.has_names()


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
        if x.layout is not torch.strided:
            raise TypeError(
                f"{where}: expected a dense (strided) tensor, but got a tensor of layout "
                f"{x.layout}; global tensors are dense: pass x.to_dense()."
            )
        if has_names(x):
            raise TypeError(
                f"{where}: expected a tensor without dimension names, but got one named "
                f"{x.names}; named tensors are not supported: pass x.rename(None)."
            )
        return x.detach() if x.requires_grad else x
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{where}: {MASKED_ARRAY}")
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
    """The shape and dtype of an array-like spec leaf (``TensorSpec`` or ``.shape``/``.dtype``).

    Raises ``TypeError`` naming ``where`` unless the shape is a sequence of ints (fractional
    sizes are not truncated) and the dtype a dtype; ``ValueError`` for a negative size.
    """
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{where}: expected a TensorSpec or an object with .shape and .dtype, but got "
            f"{type(x).__name__}."
        )
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(
            f"{where}: expected .shape to be a sequence of ints, but got {shape!r} of type "
            f"{type(shape).__name__}."
        ) from None
    for i, n in enumerate(dims):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(
                f"{where}: every size of a shape must be an int, but dim {i} of {dims!r} is "
                f"{n!r} of type {type(n).__name__}; sizes count elements (nothing is rounded)."
            )
        if n < 0:
            raise ValueError(
                f"{where}: every size of a shape must be >= 0, but dim {i} of {dims!r} is {n}."
            )
    if not is_dtype(dtype):
        raise TypeError(
            f"{where}: expected a dtype (a torch.dtype, a numpy dtype or a numpy scalar type), "
            f"but got {dtype!r} of type {type(dtype).__name__}; write e.g. torch.float32 or "
            "np.dtype('float32')."
        )
    return tuple(int(n) for n in dims), dtype


def is_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a torch dtype, a numpy dtype or a numpy scalar type."""
    return isinstance(dtype, (torch.dtype, np.dtype)) or (
        isinstance(dtype, type) and issubclass(dtype, np.generic)
    )


def check_supported_dtype(dtype: Any, where: str) -> None:
    """Raises ``TypeError`` naming ``where`` unless ``host_to_global_array`` takes ``dtype``
    (a dtype, as ``shape_dtype`` checks)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _SUPPORTED:
            raise TypeError(
                f"{where}: dtype {dtype} is not supported; expected one of {_dtype_names()}."
            )
    elif np.dtype(dtype).newbyteorder("=") not in _NP_SUPPORTED:
        raise TypeError(
            f"{where}: numpy dtype {np.dtype(dtype)} is not supported; expected one of "
            f"{_dtype_names()} (bfloat16 as a torch.Tensor)."
        )
