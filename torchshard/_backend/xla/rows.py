"""Dispatch's two primitives on torch_xla: rows taken by gather indices (``take_rows``) and
rows moved to their logical places by row targets (``move_rows``), both traced into the step
and both moving bits, not values.

Floats (and complex parts) travel as integers of their width, reinterpreted by one XLA
``BitcastConvert`` each way (``runtime.bitcast``), so that -0.0, NaN payloads (quiet and
signalling) and subnormals arrive as they left: the partitioned gather and the reduce-scatter
add each row to zeros, which in floating point turns -0.0 into 0.0, quiets signalling NaNs and,
on XLA's CPU devices, flushes subnormals and rewrites half-float NaN payloads. A tensor that
needs grad keeps the float route (integers have no gradient): its -0.0, NaN and subnormal bits
may change.

``move_rows`` is the route of ``InputDispatcher``'s row targets when the logical rows split
evenly: inside a manually sharded region each device adds the rows it holds into a zero
``[L, ...]`` buffer at their targets (integers: exact), and one reduce-scatter over the
devices that split dim 0 leaves each device its own logical rows. One collective, against
four on the route through gather indices (the key's all-gather, the index's permute and
all-gather, the output's all-reduce); ``python -m benchmarks dispatch`` in docs/design.md.

Each call into torch_xla's private ``_XLAC`` API sits in one small function, checked on
torch_xla 2.9.0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from torchshard._backend.xla.mesh import op_sharding
from torchshard._backend.xla.runtime import annotate_custom_sharding, bitcast, xla, xs
from torchshard._core.mesh import Mesh

# The integer dtype of each floating dtype's width (complex: of its parts').
_SAME_WIDTH_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.complex64: torch.int32,
    torch.complex128: torch.int64,
}

_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}

# What the reduce-scatter adds as it is (exactly: one contributor per row, zeros elsewhere).
_SUMMABLE = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x``'s bits as ``dtype``: traced on XLA tensors, a view on plain ones."""
    return bitcast(x, dtype) if x.device.type == "xla" else x.view(dtype)


def _keeps_float_route(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[l] = x[index[l]]`` along dim 0, its bits moved as they are (module docstring).
    XLA partitions the gather over a row-split operand itself (a masked local gather and an
    all-reduce of the output). Plain tensors take the same path."""
    index = index.to(x.device)
    ints = _SAME_WIDTH_INT.get(x.dtype)
    if ints is None or _keeps_float_route(x):
        return x.index_select(0, index)
    if x.is_complex():
        parts = torch.view_as_real(x)
        taken = _as(_as(parts, ints).index_select(0, index), parts.dtype)
        return torch.view_as_complex(taken)
    return _as(_as(x, ints).index_select(0, index), x.dtype)


def move_rows(
    x: torch.Tensor, targets: torch.Tensor, logical: int, mesh: Mesh, axes: tuple[str, ...]
) -> torch.Tensor | None:
    """``out[targets[p]] = x[p]`` for every row ``p`` whose target is ``>= 0``: the ``logical``
    rows, dim 0 split over the mesh axes ``axes`` (major to minor), the other dimensions
    whole; ``None`` where this route does not apply (a plain tensor or one that needs grad, a
    dtype it cannot add exactly, rows that do not split evenly over ``axes``): the caller
    gathers with ``take_rows`` then.

    ``x`` and ``targets`` ``[P]`` are constrained to that split first (a no-op for a batch
    placed with it). Each logical index must appear once in ``targets`` (the dispatchers'
    check verifies it): a row targeted twice would be the sum of both rows' bits, and targets
    out of ``[-1, logical)`` are not checked here.
    """
    if x.device.type != "xla" or targets.device.type != "xla" or _keeps_float_route(x):
        return None
    n = math.prod(mesh.shape[a] for a in axes)
    physical = x.shape[0]
    if n < 2 or logical % n or physical % n or targets.shape != (physical,):
        return None
    ints = _SAME_WIDTH_INT.get(x.dtype)
    if x.dtype == torch.bool:
        moving = x.to(torch.uint8)
    elif ints is not None:
        moving = _as(torch.view_as_real(x) if x.is_complex() else x, ints)
    elif x.dtype in _SUMMABLE:
        moving = x
    else:
        return None
    rest = ((),) * (moving.dim() - 1)
    rows = _local(moving, op_sharding(mesh, (axes, *rest)))
    slots = _local(targets.to(torch.int64), op_sharding(mesh, (axes,)))
    # padding rows (target -1) add zeros to row 0: a spare slot would cost a copy of the
    # buffer without it before the collective (~20% of the step at P=1024)
    real = slots >= 0
    zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
    rows = torch.where(real.view(-1, *[1] * (rows.dim() - 1)), rows, zero)
    buffer = torch.zeros((logical, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    placed = buffer.index_add(0, torch.where(real, slots, torch.zeros_like(slots)), rows)
    mine = _reduce_scatter(placed, n, _groups(mesh, axes))
    out = _full(mine, op_sharding(mesh, (axes, *rest)), (logical, *moving.shape[1:]))
    if x.dtype == torch.bool:
        return out != 0
    if ints is None:
        return out
    if x.is_complex():
        return torch.view_as_complex(_as(out, _PARTS[x.dtype]))
    return _as(out, x.dtype)


def _groups(mesh: Mesh, axes: tuple[str, ...]) -> list[list[int]]:
    """The reduce-scatter's groups: for each position on the other mesh axes, the devices
    along ``axes`` in the order the split numbers its pieces (major to minor), so that group
    member ``i`` receives piece ``i``."""
    names = mesh.axis_names
    others = [i for i, a in enumerate(names) if a not in axes]
    order = others + [names.index(a) for a in axes]
    n = math.prod(mesh.shape[a] for a in axes)
    grid = np.transpose(np.asarray(mesh.devices), order).reshape(-1, n)
    return [[int(d) for d in row] for row in grid]


def _local(x: torch.Tensor, sharding: Any) -> torch.Tensor:
    """Each device's piece of ``x`` split as ``sharding``, in a manually sharded region.

    torch_xla 2.9: ``_spmd_full_to_shard_shape`` of a tensor annotated with ``sharding`` (a
    custom-sharding node on a clone, as ``annotate`` makes; XLA reshards only if ``x`` is
    split otherwise)."""
    y = x.clone()
    annotate_custom_sharding(y, sharding)
    return xla()._XLAC._spmd_full_to_shard_shape(y)


def _reduce_scatter(x: torch.Tensor, n: int, groups: list[list[int]]) -> torch.Tensor:
    """torch_xla 2.9: ``_xla_spmd_reduce_scatter(reduce_type, input, scale, scatter_dim,
    shard_count, groups)``, a sum inside a manually sharded region: member ``i`` of each
    group gets piece ``i`` of dim 0 of the group's sum."""
    return xla()._XLAC._xla_spmd_reduce_scatter("sum", x, 1.0, 0, n, groups)


def _full(x: torch.Tensor, sharding: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor of ``shape`` whose pieces (split as ``sharding``) are the devices'
    ``x``, leaving the manually sharded region. torch_xla 2.9: ``_mark_manual_sharding`` then
    ``_spmd_shard_to_full_shape(x, sharding, shape, dtype)`` (``xs.disable_manual_sharding``
    without its global mesh)."""
    xlac = xla()._XLAC
    manual = xlac.OpSharding([], [], [], xs().ShardingType.MANUAL)
    xlac._mark_manual_sharding(x, manual)
    return xlac._spmd_shard_to_full_shape(x, sharding, torch.Size(shape), x.dtype)
