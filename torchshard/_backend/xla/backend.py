"""The torch_xla SPMD backend (registered as ``"xla"`` when imported): global tensors from CPU
shards, local shards back, in-step annotations and dispatch.

torch_xla itself is reached through ``runtime.py`` (imported on first use), its meshes through
``mesh.py``. Each call into torch_xla's private ``_XLAC`` API sits in one small function, with
the version it was checked on (torch_xla 2.9.0); the benchmarks call those functions too.
torch_xla has no cheap collective outside a step and no per-thread device, so the record has
no ``processes`` or ``threads``; its ``limits`` refuse a sharded leaf of rank above
``MAX_SHARDED_RANK``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend.protocols import Backend, LocalShard, MakeGlobal
from torchshard._backend.registry import register
from torchshard._backend.xla import rows
from torchshard._backend.xla.mesh import XlaMeshes, op_sharding
from torchshard._backend.xla.runtime import (
    annotate_custom_sharding,
    bitcast,
    cpu_devices,
    device_id,
    global_tensor_from_cpu_shards,
    local_devices,
    topology,
    xla,
    xs,
)
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes, device_ranges
from torchshard._core.topology import Topology

# torch_xla 2.9's ShardingUtil (xla_sharding_util.cpp:124, "tile_assignment ranks > 5") logs
# an error for a tile assignment of rank 6 or more and builds one with every tile on device 0;
# placing such a leaf succeeded with that corrupt layout and reading it back segfaulted.
# mark_sharding refuses the same tensor. Replicated leaves have no tile assignment and work
# at any rank. tests/backend/xla/test_backend.py pins the runtime's behaviour.
MAX_SHARDED_RANK = 5

# A background transfer of fewer bytes (this process's shards of one leaf) keeps the direct
# call: it holds the GIL for < ~0.2 ms, no longer than Python's own time slices, and the
# GIL-free call costs ~40 us more per leaf (measured on 8 CPU devices; docs/design.md).
GIL_FREE_MIN_BYTES: float = 1 << 20  # a float: the loader bench sets math.inf (route off)


@functools.cache
def _device_name() -> str:
    return str(xla().device())  # the SPMD virtual device ("xla:0")


def _tensors_from_aten(tensors: Sequence[torch.Tensor], specs: Sequence[Any]) -> list[torch.Tensor]:
    """torch_xla 2.9: ``_xla_tensors_from_aten(tensors, devices, shardings)`` (what
    ``MpDeviceLoader`` calls) runs inside a ``NoGilSection``: ``ShardingUtil::ShardTensor``
    cuts one slice per local device and zero-pads it (``constant_pad_nd``, a copy even with no
    padding), then ``CreateShardedData`` copies and transfers each as
    ``_global_tensor_from_cpu_shards`` does. Python threads keep running meanwhile."""
    return xla()._XLAC._xla_tensors_from_aten(
        list(tensors), [_device_name()] * len(tensors), list(specs)
    )


def _xla_sharding_spec(
    probe: torch.Tensor, tile_assignment: list[Any], sharding_type: Any, minibatch: bool
) -> Any:
    """torch_xla 2.9: ``_XLAC.XlaShardingSpec(t, tile_assignment, group_assignment,
    replication_groups, sharding_type, minibatch)`` reads only ``t``'s shape and dtype. With
    ``minibatch`` ("stacked" here) the global shape is ``t``'s with dim 0 scaled by global /
    local device count, and torch_xla allows it only when the tile assignment's outer length is
    the global device count (dim 0 split over every device)."""
    return xla()._XLAC.XlaShardingSpec(
        probe, tile_assignment, [], [], int(sharding_type), minibatch
    )


@functools.lru_cache(maxsize=1024)
def _sharding_spec(mesh: Mesh, axes: DimAxes, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """The ``XlaShardingSpec`` of the tensor handed to ``_tensors_from_aten``: replicated when
    ``axes`` split nothing; else dim 0 split over every device, and the tensor (``shape``) is
    this process's shards stacked along dim 0 in ``local_devices`` order (torch_xla's
    "minibatch": local device ``i`` gets rows ``[i * s, (i + 1) * s)``). The tile order comes
    from torchshard's index maths, not from ``xs.ShardingSpec`` (which builds a rank-2 tile
    assignment for a rank-1 tensor on a mesh with an unused size-1 axis)."""
    probe = torch.empty((1,) * len(shape), dtype=dtype).expand(shape)
    kind = xs().ShardingType
    if not any(axes):
        return _xla_sharding_spec(probe, [], kind.REPLICATED, False)
    count = topology().device_count
    # Dim 0 is split over every device (``_split_over_every_device``): one row each, so the
    # device whose row is ``r`` is the tile at ``r`` (numpy: no object per device of the pod).
    ids, starts, _ = device_ranges(mesh, (axes[0],), (count,))
    order = np.zeros(count, dtype=np.int64)
    order[starts[:, 0]] = ids
    tile_assignment = order.reshape((count,) + (1,) * (len(shape) - 1)).tolist()
    return _xla_sharding_spec(probe, tile_assignment, kind.TILED, True)


def _split_over_every_device(mesh: Mesh, axes: DimAxes) -> bool:
    return (
        bool(axes)
        and math.prod(mesh.shape[a] for a in axes[0]) == topology().device_count
        and not any(axes[1:])
    )


def _stacked(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The shards one after another along dim 0: a view when they already lie so in memory
    (dim 0 cut in device order), else ``torch.cat`` (a copy, without the GIL)."""
    first = shards[0]
    size = (first.shape[0] * len(shards), *first.shape[1:])
    step = first.nbytes
    base = first.untyped_storage().data_ptr()
    if step and all(
        s.is_contiguous()
        and s.untyped_storage().data_ptr() == base
        and s.data_ptr() == first.data_ptr() + i * step
        for i, s in enumerate(shards)
    ):
        return first.as_strided(size, first.stride())
    return torch.cat(list(shards))


def _sharding_spec_text(x: torch.Tensor) -> str:
    """torch_xla 2.9: ``_get_xla_sharding_spec(t)`` is the tensor's sharding as text
    (``"{devices=[8,1]0,1,...}"``, ``"{replicated}"``), or ``""`` when it carries none (moved
    with ``.to()`` and never annotated, or lazy IR not yet run)."""
    return xla()._XLAC._get_xla_sharding_spec(x)


def _materialize(tensors: Sequence[torch.Tensor]) -> None:
    """Runs the pending graph of ``tensors`` (if any) and waits until their data is ready.

    torch_xla 2.9: ``_get_local_shards`` neither runs pending IR (a step output that was never
    synced has no sharding yet: "Tensor is not sharded") nor waits for an execution still in
    flight after ``torch_xla.sync()`` ("Trying to access XLA data ... while an async operation
    is in flight"). ``_xla_sync_multi(tensors, devices=[], wait=True)`` does both; on tensors
    that are already device data it returns at once.
    """
    xla()._XLAC._xla_sync_multi(list(tensors), [], wait=True)


def _unwrap(x: torch.Tensor) -> torch.Tensor:
    """The XLA tensor of ``x``: the ``global_tensor`` of the ``XLAShardedTensor`` that
    ``xs.mark_sharding`` returns (torch_xla 2.9: its own ops go through ``__torch_dispatch__``,
    and the ``_XLAC`` read-back calls refuse it: "Expected XLA tensor"), else ``x``."""
    if type(x) is torch.Tensor:
        return x
    return x.global_tensor if isinstance(x, xs().XLAShardedTensor) else x


def _real_view(x: torch.Tensor) -> torch.Tensor:
    """``view_as_real(x)`` for reading a complex128 tensor back: torch_xla 2.9 (measured on
    the CPU client) copies a *sharded* complex128 tensor to the host without its imaginary
    parts (``.cpu()``, ``_get_local_shards`` and ``XLAShardedTensor.local_shards`` alike),
    though the device data is right (``torch.imag`` on the device reads it) and complex64 is
    unaffected. The real view (float64, one more dimension of 2, the same split) copies
    correctly; it costs one small compiled graph. A sharded float16 tensor is read through its
    int16 bits (``bitcast``) likewise: its shards come back with NaN payloads rewritten
    (0x7C01 -> 0x7E00; ``.cpu()`` of an unsharded one is exact)."""
    return torch.view_as_real(x)


def _whole_on_every_device(x: torch.Tensor) -> list[LocalShard]:
    """The local shards of an XLA tensor without a sharding spec: every local device holds
    the whole value (SPMD replicates what was never annotated)."""
    data = x.cpu()
    whole = tuple((0, n) for n in x.shape)
    return [LocalShard(d, whole, data) for d in local_devices()]


def _parse_ranges(indices: Any, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    if indices is Ellipsis:
        return tuple((0, n) for n in shape)
    out = []
    for s, n in zip(indices, shape, strict=True):
        start, stop, _ = s.indices(n)
        out.append((start, stop))
    return tuple(out)


class XlaRuntime:
    """torch_xla SPMD (one process per host, every local device driven by it): its
    ``Placement``, ``ReadBack`` and ``InStep``."""

    name = "xla"
    keeps_unconstrained_dims = False  # an OpSharding has no unspecified dimensions

    def topology(self) -> Topology:
        return topology()

    def local_devices(self, mesh: Mesh | None) -> Sequence[int]:
        # Every device this process drives (a mesh covers all devices, so all of them are in
        # it), in the order _global_tensor_from_cpu_shards takes shards.
        return local_devices()

    def devices_in_host_memory(self) -> bool:
        return cpu_devices()

    def is_global(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type == "xla"

    def is_sharded(self, x: torch.Tensor) -> bool:
        # A lazy result gets its sharding when it runs; device data keeps the one it has.
        x = _unwrap(x)
        _materialize([x])
        return _sharding_spec_text(x) != ""

    def make_global(
        self,
        mesh: Mesh,
        axes: DimAxes,
        global_shape: tuple[int, ...],
        shards: Sequence[torch.Tensor],
        *,
        background: bool = False,
    ) -> torch.Tensor:
        # Foreground: _global_tensor_from_cpu_shards, the fastest call (one host copy) but it
        # holds the GIL throughout. Background (a loader thread next to a training step), for
        # leaves of GIL_FREE_MIN_BYTES or more: the GIL-free _xla_tensors_from_aten, one more
        # host copy, for the layouts it can express with each device still receiving only its
        # shard: dim 0 split over every device (the loader's FULL default, the dispatchers'
        # spec), and replication. Measurements in docs/design.md ("The background transfer and
        # the GIL").
        if (
            background
            and shards
            and sum(s.nbytes for s in shards) >= GIL_FREE_MIN_BYTES
            and (not any(axes) or _split_over_every_device(mesh, axes))
        ):
            # replicated: every device receives shards[0], the whole value
            t = _stacked(shards) if any(axes) else shards[0]
            spec = _sharding_spec(mesh, axes, tuple(t.shape), t.dtype)
            return _tensors_from_aten([t], [spec])[0]
        return global_tensor_from_cpu_shards(
            list(shards), op_sharding(mesh, axes), list(global_shape)
        )

    def global_maker(self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]) -> MakeGlobal:
        # The direct call with the OpSharding bound: a repeated call skips make_global's route
        # choice and the OpSharding lookup (frames are measurable beside an 8 MiB copy, whose
        # cache misses slow every Python frame after it).
        op, shape = op_sharding(mesh, axes), list(global_shape)
        return lambda shards: global_tensor_from_cpu_shards(shards, op, shape)

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[list[LocalShard]]:
        # torch_xla 2.9: `_get_local_shards` copies each local device's (padded) block to the
        # CPU without compiling anything; `_get_local_shard_replica_and_indices` gives the
        # global slices of each (Ellipsis for a replicated tensor). Both take a list.
        #
        # A tensor moved with `.to(xla device)` and never annotated carries no sharding spec:
        # `_get_local_shards` refuses it ("Tensor is not sharded"), but SPMD holds its whole
        # value on every device, so each local device reports the whole value (one `.cpu()`).
        if not tensors:
            return []
        xlac = xla()._XLAC
        tensors = [_unwrap(t) for t in tensors]
        _materialize(tensors)
        wide = {
            i
            for i, t in enumerate(tensors)
            if t.dtype == torch.complex128 and _sharding_spec_text(t) != ""
        }
        half = {
            i
            for i, t in enumerate(tensors)
            if t.dtype == torch.float16 and _sharding_spec_text(t) != ""
        }
        if wide or half:  # read through their real view or their bits (see _real_view)
            tensors = [
                _real_view(t) if i in wide else bitcast(t, torch.int16) if i in half else t
                for i, t in enumerate(tensors)
            ]
            _materialize([tensors[i] for i in wide | half])
        unsharded = {i: t for i, t in enumerate(tensors) if _sharding_spec_text(t) == ""}
        sharded = [t for i, t in enumerate(tensors) if i not in unsharded]
        datas = xlac._get_local_shards(sharded) if sharded else []
        indices = xlac._get_local_shard_replica_and_indices(sharded) if sharded else []
        read = iter(zip(sharded, datas, indices, strict=True))
        out = []
        for i in range(len(tensors)):
            if i in unsharded:
                out.append(_whole_on_every_device(unsharded[i]))
                continue
            t, shard_devs, rep_idx = next(read)
            shape = tuple(t.shape)
            shards = []
            for (data, dev), (_, idx) in zip(shard_devs, rep_idx, strict=True):
                ranges = _parse_ranges(idx, shape)
                block = tuple(slice(0, b - a) for a, b in ranges)
                if tuple(data.shape) != tuple(b - a for a, b in ranges):
                    data = data[block]
                shards.append(LocalShard(device_id(dev), ranges, data))
            out.append(shards)
        for i in wide:
            out[i] = [
                LocalShard(s.device, s.ranges[:-1], torch.view_as_complex(s.data.contiguous()))
                for s in out[i]
            ]
        for i in half:
            out[i] = [LocalShard(s.device, s.ranges, s.data.view(torch.float16)) for s in out[i]]
        return out

    def local_ranges(self, x: torch.Tensor) -> dict[int, tuple[tuple[int, int], ...]] | None:
        # torch_xla 2.9: `_get_local_shard_replica_and_indices` gives each local device's
        # global slices (in `local_devices` order) without copying data.
        x = _unwrap(x)
        _materialize([x])
        shape = tuple(x.shape)
        if _sharding_spec_text(x) == "":  # never annotated: whole on every device
            return dict.fromkeys(local_devices(), tuple((0, n) for n in shape))
        indices = xla()._XLAC._get_local_shard_replica_and_indices([x])[0]
        return {
            d: _parse_ranges(idx, shape)
            for d, (_, idx) in zip(local_devices(), indices, strict=True)
        }

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        x = _unwrap(x)
        if x.dtype == torch.complex128:
            return torch.view_as_complex(_real_view(x).cpu().contiguous())
        return x.cpu()

    def annotate(
        self, x: torch.Tensor, mesh: Mesh, axes: DimAxes, *, keep: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        if keep:
            raise ShardingError(
                "the xla backend cannot leave single dimensions unconstrained: an OpSharding "
                "has no unspecified dimensions."
            )
        # A clone is a new lazy tensor over the same IR value (device data stays device data);
        # the custom-sharding node goes on the clone, so `x` keeps its value and annotation and
        # any reshard runs on the devices when the step is compiled. `mark_sharding` would not
        # do: on device data that already carries another sharding it refuses ("Existing
        # annotation must be cleared first"), and clearing first reshards through the host.
        if isinstance(x, xs().XLAShardedTensor):  # what xs.mark_sharding returns
            x = x.global_tensor
        y = x.clone()
        annotate_custom_sharding(y, op_sharding(mesh, axes))
        return y

    def full_local(self, x: torch.Tensor) -> torch.Tensor:
        return x  # traced into the step: the compiler moves what the index maths needs

    def take_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return rows.take_rows(x, index)

    splits_unevenly = False  # a graph's output split unevenly comes back replicated

    def move_rows(
        self,
        x: torch.Tensor,
        targets: torch.Tensor,
        logical: int,
        mesh: Mesh,
        axes: tuple[str, ...],
    ) -> torch.Tensor | None:
        return rows.move_rows(x, targets, logical, mesh, axes)


class XlaLimits:
    """What torch_xla cannot express (``LayoutLimits``): a sharded leaf of rank above 5."""

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        if len(axes) > MAX_SHARDED_RANK and any(axes):
            raise ShardingError(
                f"torch_xla shards arrays of rank up to {MAX_SHARDED_RANK}, but this one has "
                f"rank {len(axes)} and is split over mesh axes "
                f"{[a for dim in axes for a in dim]} (torch_xla 2.9 would place every tile on "
                "device 0, and reading it back crashes the process). Reshape it to rank "
                f"{MAX_SHARDED_RANK} or less on the host (e.g. merge trailing dimensions with "
                "x.reshape(x.shape[0], -1)), or replicate it (P())."
            )


_XLA = XlaRuntime()
BACKEND = Backend("xla", place=_XLA, read=_XLA, step=_XLA, meshes=XlaMeshes(), limits=XlaLimits())
register(BACKEND)
