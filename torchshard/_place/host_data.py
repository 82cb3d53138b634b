"""Host data: the leaves a call may pass (numpy arrays, CPU tensors), their validation, and their
zero-copy conversion to CPU tensors.

``is_host_tensor`` is the one predicate for a leaf that is used as it is (a plain, dense CPU
tensor of a supported dtype that needs no grad and has no names): the plan cache keys on it,
and ``as_host_tensor`` returns such a leaf without looking further.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from torchshard._core import checks
from torchshard._core.errors import at
from torchshard._core.tree import Where, register_array_type
from torchshard._place._torch_private import functorch_wrapper, is_fake_tensor

if TYPE_CHECKING:
    from collections.abc import Container

    from torchshard._place.call import HostCall

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


# Named tensors (and `Tensor.has_names`) are in torch 2.9.0 and gone in 2.13.0, 2.14.1, 2.15.0
# (from their types too): the method is looked up once, None on a torch without them.
_HAS_NAMES: Callable[[torch.Tensor], bool] | None = getattr(torch.Tensor, "has_names", None)
HAS_NAMED_TENSORS = _HAS_NAMES is not None
_STRIDED = torch.strided


class _NamedTensor(Protocol):
    """A named tensor's ``names`` (torch 2.9; the attribute is gone from later torch)."""

    names: tuple[str | None, ...]


def has_names(x: torch.Tensor) -> bool:
    """Whether ``x`` is a named tensor (never, on a torch without named tensors)."""
    return _HAS_NAMES is not None and _HAS_NAMES(x)


def is_host_tensor(x: Any) -> bool:
    """Whether ``x`` is used as it is: a plain (not a subclass), dense CPU tensor of a
    supported dtype that needs no grad and has no names, not nested, not a lazy conjugate or
    negative view, and with its storage (not freed, as FSDP frees a parameter's; not a tensor
    that ``torch.func.vmap`` or ``grad`` wrapped, which has none)."""
    try:
        return (
            type(x) is torch.Tensor
            and x.is_cpu
            and not x.requires_grad
            and x.dtype in _SUPPORTED
            and x.layout is _STRIDED
            and not x.is_nested
            and not x.is_conj()
            and not x.is_neg()
            and not (_HAS_NAMES is not None and _HAS_NAMES(x))
            and (x.untyped_storage().nbytes() > 0 or x.numel() == 0)
        )
    except NotImplementedError:  # "Cannot access storage of BatchedTensorImpl" (or TensorWrapper)
        return False


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def as_host_tensor(x: Any, where: Where) -> torch.Tensor:
    """``x`` as a CPU tensor sharing its memory; raises ``TypeError`` naming ``where`` (a path,
    or a ``LeafPath``: computed only then)."""
    if is_host_tensor(x):
        return x
    if isinstance(x, torch.Tensor):
        x = unwrapped(x, where)  # kept from inside a torch.func transform
        if x.device.type != "cpu":
            raise TypeError(
                at(
                    where,
                    f"expected a host array (numpy array or CPU torch.Tensor), but got a "
                    f"tensor on device {x.device}. Global tensors are read back with "
                    "global_to_host_array.",
                )
            )
        if x.dtype not in _SUPPORTED:
            raise TypeError(
                at(where, f"dtype {x.dtype} is not supported; expected one of {_dtype_names()}.")
            )
        if x.layout is not _STRIDED:
            raise TypeError(
                at(
                    where,
                    f"expected a dense (strided) tensor, but got a tensor of layout "
                    f"{x.layout}; global tensors are dense: pass x.to_dense().",
                )
            )
        _check_tensor_kind(x, where)
        if has_names(x):
            raise TypeError(
                at(
                    where,
                    f"expected a tensor without dimension names, but got one named "
                    f"{cast(_NamedTensor, x).names}; named tensors are not supported: pass "
                    "x.rename(None).",
                )
            )
        return x.detach() if x.requires_grad else x
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(at(where, f"{MASKED_ARRAY}"))
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
        if arr.dtype.newbyteorder("=") not in _NP_SUPPORTED:
            raise TypeError(
                at(
                    where,
                    f"numpy dtype {arr.dtype} is not supported; expected one of "
                    f"{_dtype_names()} (bfloat16 as a torch.Tensor). Strings and objects must be "
                    "encoded as numbers on the host.",
                )
            )
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if not arr.flags.writeable or any(st < 0 for st in arr.strides):
            # torch.from_numpy warns on read-only memory and refuses negative strides.
            arr = arr.copy()
        return torch.from_numpy(arr)
    raise TypeError(
        at(
            where,
            f"expected a numpy array or a CPU torch.Tensor, but got {type(x).__name__}"
            f" ({x!r:.60}). Wrap Python numbers with np.asarray(...) or torch.tensor(...).",
        )
    )


def unwrapped(x: torch.Tensor, where: Where) -> torch.Tensor:
    """``x`` itself unless a ``torch.func`` transform wrapped it. A tensor kept from inside
    ``grad``, ``vjp`` or ``jvp`` reads as its values once the transform has ended: its values
    (``detach`` unwraps it). Raises ``TypeError`` naming ``where`` for a tensor that ``vmap``
    batched and that escaped the vmapped function (it has no memory of its own, its shape
    lacks the batch dimension, and torch cannot read it outside the transform), and for a
    wrapper whose transform is still running."""
    kind = functorch_wrapper(x)
    if kind is None:
        return x
    if kind == "grad":
        try:
            x = x.detach()
        except RuntimeError:  # "your tensor may have escaped from inside a function being vmapped"
            kind = "vmap"
        else:
            kind = functorch_wrapper(x)
            if kind is None:
                return x
    if kind == "vmap":
        found = (
            f"a tensor batched by torch.func.vmap and kept from inside the vmapped function "
            f"(there of shape {tuple(x.shape)}, its batch dimension taken off): it has no "
            "memory of its own, and outside the transform torch cannot read its values. Return "
            "it from the vmapped function (vmap stacks what the function returns into a plain "
            "tensor) and pass that, or pass the tensor vmap was given."
        )
    else:
        found = (
            "a tensor wrapped by a torch.func transform that is still running (grad, jvp, ...), "
            "which is not host data. Place the data before the transform and pass the global "
            "tensors in."
        )
    raise TypeError(at(where, f"expected a host tensor, but got {found}"))


def _check_tensor_kind(x: torch.Tensor, where: Where) -> None:
    """Raises ``TypeError`` naming ``where`` for a CPU tensor whose memory is not its values:
    a fake or nested tensor, a lazy conjugate or negative view, freed storage."""
    if is_fake_tensor(x):  # reports device cpu but has no memory (reading it: SIGSEGV)
        raise TypeError(
            at(
                where,
                "expected a tensor with data, but got a FakeTensor (made under FakeTensorMode), "
                "which has a shape and a dtype but no values. Place real tensors outside "
                "FakeTensorMode; for shapes only, use host_to_global_specs.",
            )
        )
    if x.is_nested:
        raise TypeError(
            at(
                where,
                "expected a dense tensor, but got a nested tensor, whose parts differ in shape. "
                "Pad it to one shape (x.to_padded_tensor(0)) or pass its parts as leaves of "
                "their own (x.unbind()).",
            )
        )
    if x.is_conj():
        raise TypeError(
            at(
                where,
                "expected a tensor whose memory holds its values, but got a lazy conjugate view "
                "(x.conj() of a complex tensor: the memory holds the unconjugated values). "
                "Pass x.resolve_conj().",
            )
        )
    if x.is_neg():
        raise TypeError(
            at(
                where,
                "expected a tensor whose memory holds its values, but got a lazy negative view "
                "(the memory holds the values negated). Pass x.resolve_neg().",
            )
        )
    if x.numel() and x.untyped_storage().nbytes() == 0:
        raise TypeError(
            at(
                where,
                f"expected a tensor with data, but got one of shape {tuple(x.shape)} whose "
                "storage was freed (resized to 0 bytes, as FSDP does to a sharded parameter). "
                "Pass the tensor while its storage holds the values (e.g. after "
                "unshard/summon_full_params), or a copy of it.",
            )
        )


def shape_dtype(x: Any, where: Where) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype of an array-like spec leaf (``TensorSpec`` or ``.shape``/``.dtype``).

    Raises ``TypeError`` naming ``where`` unless the shape is a sequence of ints (fractional
    sizes are not truncated) and the dtype a dtype; ``ValueError`` for a negative size.
    """
    if isinstance(x, torch.Tensor):
        x = unwrapped(x, where)  # a vmapped tensor's shape lacks the batch dimension
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            at(
                where,
                f"expected a TensorSpec or an object with .shape and .dtype, but got "
                f"{type(x).__name__}.",
            )
        )
    dims = checks.shape(shape, where)
    if not is_dtype(dtype):
        raise TypeError(
            at(
                where,
                f"expected a dtype (a torch.dtype, a numpy dtype or a numpy scalar type), "
                f"but got {dtype!r} of type {type(dtype).__name__}; write e.g. torch.float32 or "
                "np.dtype('float32').",
            )
        )
    return dims, dtype


def is_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a torch dtype, a numpy dtype or a numpy scalar type."""
    return isinstance(dtype, (torch.dtype, np.dtype)) or (
        isinstance(dtype, type) and issubclass(dtype, np.generic)
    )


def check_supported_dtype(dtype: Any, where: Where) -> None:
    """Raises ``TypeError`` naming ``where`` unless ``host_to_global_array`` takes ``dtype``
    (a dtype, as ``shape_dtype`` checks)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _SUPPORTED:
            raise TypeError(
                at(where, f"dtype {dtype} is not supported; expected one of {_dtype_names()}.")
            )
    elif np.dtype(dtype).newbyteorder("=") not in _NP_SUPPORTED:
        raise TypeError(
            at(
                where,
                f"numpy dtype {np.dtype(dtype)} is not supported; expected one of "
                f"{_dtype_names()} (bfloat16 as a torch.Tensor).",
            )
        )


def host_tensors(call: HostCall, done: Container[int] = ()) -> list[list[torch.Tensor]]:
    """Every host's leaves of ``call`` as CPU tensors (numpy zero-copy); ``TypeError`` naming
    the path. The leaves in ``done`` (already global) stay as they are."""
    return [
        [
            x if i in done or is_host_tensor(x) else as_host_tensor(x, paths.at(i))
            for i, x in enumerate(leaves)
        ]
        for leaves, paths in zip(call.leaves, call.paths, strict=True)
    ]
