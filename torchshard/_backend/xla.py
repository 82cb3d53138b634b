"""The torch_xla SPMD backend (registered as ``"xla"``).

With ``xla_env.py`` (the CPU emulation, which must run before torch_xla starts), the only
module that imports torch_xla; torch_xla itself is imported on first use, not with this module.
Each call into torch_xla's private ``_XLAC`` API sits in one small function here, with the
version it was checked on (torch_xla 2.9.0); the benchmarks call those functions too.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend import AgreementCall, LocalShard, register_backend
from torchshard._backend.xla_env import import_error, require_xla
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes, NamedSharding, check_device_process
from torchshard._core.spec import PartitionSpec
from torchshard._core.topology import Topology

_INIT_LOCK = threading.Lock()
# A background transfer of fewer bytes (this process's shards of one leaf) keeps the direct
# call: it holds the GIL for < ~0.2 ms, no longer than Python's own time slices, and the
# GIL-free call costs ~40 us more per leaf (measured on 8 CPU devices; docs/design.md).
GIL_FREE_MIN_BYTES = 1 << 20
_DEVICE_RE = re.compile(r"^[A-Za-z_]+:(\d+)$")


@functools.cache
def _xla() -> Any:
    """Imports torch_xla and switches it to SPMD mode (idempotent)."""
    require_xla("the xla backend (torch_xla SPMD)")
    try:
        import torch_xla
        import torch_xla.runtime as xr
    except ImportError as e:
        raise import_error("the xla backend (torch_xla SPMD)", e) from e

    with _INIT_LOCK:
        if not xr.is_spmd():
            xr.use_spmd()
    return torch_xla


def _xs() -> Any:
    _xla()
    import torch_xla.distributed.spmd as xs

    return xs


def _xr() -> Any:
    _xla()
    import torch_xla.runtime as xr

    return xr


def _device_id(name: str) -> int:
    m = _DEVICE_RE.match(name)
    if m is None:
        raise RuntimeError(f"unexpected torch_xla device name {name!r}")
    return int(m.group(1))


@functools.cache
def _local_devices() -> tuple[int, ...]:
    # torch_xla 2.9: `_xla_get_runtime_devices()` lists this process's devices ("CPU:3",
    # "TPU:5"), in the order `_global_tensor_from_cpu_shards` takes their shards; the number is
    # the global ordinal that mesh device ids refer to.
    return tuple(_device_id(n) for n in _xla()._XLAC._xla_get_runtime_devices())


_TOPOLOGY_LOCK = threading.Lock()
_TOPOLOGY: list[Topology] = []  # computed once per process


def _topology() -> Topology:
    """The run's topology, computed once per process (under a lock: with several processes
    it runs a collective, which must not run twice)."""
    if not _TOPOLOGY:
        with _TOPOLOGY_LOCK:
            if not _TOPOLOGY:
                _TOPOLOGY.append(_compute_topology())
    return _TOPOLOGY[0]


def _compute_topology() -> Topology:
    """One process: it owns every device. Several processes (multi-host TPU): torch_xla does
    not report which process owns a device (PJRT's device attributes carry no process index,
    and global ordinals need not be contiguous per host), so it is learnt with one collective
    (``_gather_device_owners``). That collective runs on the first call that needs the
    topology (entering a mesh, ``process_index()``, ...), which in an SPMD program every
    process makes. Not testable on one CPU host; kept deliberately small."""
    xr = _xr()
    count = xr.global_runtime_device_count()
    nproc = xr.process_count()
    index = xr.process_index()
    if nproc == 1:
        return Topology(index, 1, (0,) * count)
    return Topology(index, nproc, _gather_device_owners(count))


def _gather_device_owners(count: int) -> tuple[int, ...]:
    """Every device's owning process, learnt with one tiny global tensor.

    Each process gives each of its local devices the row ``[process_index]`` of a
    ``[devices, 1]`` tensor split over all devices (row ``d`` lives on device ``d``), and reads
    the assembled value back (one all-gather, once per process).
    """
    xs = _xs()
    xr = _xr()
    local = _local_devices()
    shard = torch.tensor([[xr.process_index()]], dtype=torch.int64)
    op = xs.Mesh(np.arange(count), (count, 1)).get_op_sharding((0, 1))
    owners = global_tensor_from_cpu_shards([shard] * len(local), op, [count, 1])
    return tuple(int(v) for v in owners.cpu().reshape(-1).tolist())


@functools.lru_cache(maxsize=256)
def to_xla_mesh(mesh: Mesh) -> Any:
    """``mesh`` as a ``torch_xla.distributed.spmd.Mesh``."""
    check_device_process(mesh, _topology().device_process)
    return _xs().Mesh(np.asarray(mesh.device_ids), tuple(mesh.devices.shape), mesh.axis_names)


def mesh_from_xla(xla_mesh: Any) -> Mesh:
    """The torchshard ``Mesh`` of a torch_xla mesh."""
    names = getattr(xla_mesh, "axis_names", None)
    if names is None:
        raise ShardingError(
            "Mesh.from_xla: the torch_xla mesh has no axis_names; torchshard specs name mesh "
            "axes, so build it with xs.Mesh(device_ids, mesh_shape, axis_names=(...))."
        )
    ids = np.asarray(xla_mesh.device_ids).reshape(tuple(xla_mesh.mesh_shape))
    return Mesh(ids, tuple(names))


@functools.lru_cache(maxsize=4096)
def op_sharding(mesh: Mesh, axes: DimAxes) -> Any:
    """The ``OpSharding`` of the per-dimension ``axes`` on ``mesh`` (cached)."""
    spec = tuple(None if not a else (a[0] if len(a) == 1 else a) for a in axes)
    return to_xla_mesh(mesh).get_op_sharding(spec)


def cpu_shards_binding() -> Callable[..., torch.Tensor]:
    """torch_xla 2.9's raw binding ``_XLAC._global_tensor_from_cpu_shards(shards, op_sharding,
    global_shape)`` itself (lists only), for a baseline that calls it by hand (the benchmarks)."""
    return _xla()._XLAC._global_tensor_from_cpu_shards


def global_tensor_from_cpu_shards(
    shards: Sequence[torch.Tensor], op_sharding: Any, global_shape: list[int]
) -> torch.Tensor:
    """torch_xla 2.9: one CPU tensor per local device (a list or tuple; views are fine;
    ``local_devices`` order), the OpSharding and the global shape (a list); each device
    receives exactly its shard. The binding holds the GIL for the whole call: one host copy per
    shard (``AtenSource``: ``tensor.to(..., copy=True)``) and the PJRT transfer
    (``init_python_bindings.cpp``)."""
    return _xla()._XLAC._global_tensor_from_cpu_shards(shards, op_sharding, global_shape)


@functools.cache
def _device_name() -> str:
    return str(_xla().device())  # the SPMD virtual device ("xla:0")


def _tensors_from_aten(tensors: Sequence[torch.Tensor], specs: Sequence[Any]) -> list[torch.Tensor]:
    """torch_xla 2.9: ``_xla_tensors_from_aten(tensors, devices, shardings)`` (what
    ``MpDeviceLoader`` calls) runs inside a ``NoGilSection``: ``ShardingUtil::ShardTensor``
    cuts one slice per local device and zero-pads it (``constant_pad_nd``, a copy even with no
    padding), then ``CreateShardedData`` copies and transfers each as
    ``_global_tensor_from_cpu_shards`` does. Python threads keep running meanwhile."""
    return _xla()._XLAC._xla_tensors_from_aten(
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
    return _xla()._XLAC.XlaShardingSpec(
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
    kind = _xs().ShardingType
    if not any(axes):
        return _xla_sharding_spec(probe, [], kind.REPLICATED, False)
    count = _topology().device_count
    tiles = NamedSharding(mesh, PartitionSpec(axes[0])).devices_indices_map((count,))
    order = [0] * count
    for device, (rows,) in tiles.items():
        order[rows.start] = device
    tile_assignment = np.asarray(order).reshape((count,) + (1,) * (len(shape) - 1)).tolist()
    return _xla_sharding_spec(probe, tile_assignment, kind.TILED, True)


def _split_over_every_device(mesh: Mesh, axes: DimAxes) -> bool:
    return (
        bool(axes)
        and math.prod(mesh.shape[a] for a in axes[0]) == _topology().device_count
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
    return _xla()._XLAC._get_xla_sharding_spec(x)


def _materialize(tensors: Sequence[torch.Tensor]) -> None:
    """Runs the pending graph of ``tensors`` (if any) and waits until their data is ready.

    torch_xla 2.9: ``_get_local_shards`` neither runs pending IR (a step output that was never
    synced has no sharding yet: "Tensor is not sharded") nor waits for an execution still in
    flight after ``torch_xla.sync()`` ("Trying to access XLA data ... while an async operation
    is in flight"). ``_xla_sync_multi(tensors, devices=[], wait=True)`` does both; on tensors
    that are already device data it returns at once.
    """
    _xla()._XLAC._xla_sync_multi(list(tensors), [], wait=True)


def _annotate_custom_sharding(x: torch.Tensor, op_sharding: Any) -> None:
    """Wraps ``x``'s IR value in a custom-sharding node (in place on ``x``).

    torch_xla 2.9: ``_xla_annotate_custom_sharding(tensor, op_sharding)`` sets the tensor's IR
    to ``custom_sharding(current IR)`` and its sharding spec, for device data and lazy IR alike,
    without the existing-annotation check of ``_xla_mark_sharding``. (``_xla_clear_sharding`` on
    device data only drops the spec: the data stays sharded, ``_get_local_shards`` then fails
    with "Tensor is not sharded", and a later ``_xla_mark_sharding`` downloads the whole value
    and uploads it again.)
    """
    _xla()._XLAC._xla_annotate_custom_sharding(x, op_sharding)


def _unwrap(x: torch.Tensor) -> torch.Tensor:
    """The XLA tensor of ``x``: the ``global_tensor`` of the ``XLAShardedTensor`` that
    ``xs.mark_sharding`` returns (torch_xla 2.9: its own ops go through ``__torch_dispatch__``,
    and the ``_XLAC`` read-back calls refuse it: "Expected XLA tensor"), else ``x``."""
    if type(x) is torch.Tensor:
        return x
    return x.global_tensor if isinstance(x, _xs().XLAShardedTensor) else x


def _real_view(x: torch.Tensor) -> torch.Tensor:
    """``view_as_real(x)`` for reading a complex128 tensor back: torch_xla 2.9 (measured on
    the CPU client) copies a *sharded* complex128 tensor to the host without its imaginary
    parts (``.cpu()``, ``_get_local_shards`` and ``XLAShardedTensor.local_shards`` alike),
    though the device data is right (``torch.imag`` on the device reads it) and complex64 is
    unaffected. The real view (float64, one more dimension of 2, the same split) copies
    correctly; it costs one small compiled graph."""
    return torch.view_as_real(x)


def _whole_on_every_device(x: torch.Tensor) -> list[LocalShard]:
    """The local shards of an XLA tensor without a sharding spec: every local device holds
    the whole value (SPMD replicates what was never annotated)."""
    data = x.cpu()
    whole = tuple((0, n) for n in x.shape)
    return [LocalShard(d, whole, data) for d in _local_devices()]


def _parse_ranges(indices: Any, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    if indices is Ellipsis:
        return tuple((0, n) for n in shape)
    out = []
    for s, n in zip(indices, shape, strict=True):
        start, stop, _ = s.indices(n)
        out.append((start, stop))
    return tuple(out)


class XlaBackend:
    """torch_xla SPMD (one process per host, every local device driven by it)."""

    name = "xla"
    keeps_unconstrained_dims = False  # an OpSharding has no unspecified dimensions

    def topology(self) -> Topology:
        return _TOPOLOGY[0] if _TOPOLOGY else _topology()

    def mesh_from_native(self, native: Any) -> Mesh:
        return mesh_from_xla(native)

    def native_mesh(self, mesh: Mesh) -> Any:
        return to_xla_mesh(mesh)

    def create_mesh(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        return Mesh(grid, axis_names, backend=self.name)

    def local_devices(self, mesh: Mesh) -> Sequence[int]:
        # Every device this process drives (a mesh covers all devices, so all of them are in
        # it), in the order _global_tensor_from_cpu_shards takes shards.
        return _local_devices()

    def activate(self, mesh: Mesh) -> None:
        _xs().set_global_mesh(to_xla_mesh(mesh))

    def prepare(self, mesh: Mesh) -> None:
        return None  # no set-up collective: the global mesh is host-side state

    def deactivate(self, mesh: Mesh, outer: Mesh | None) -> None:
        if outer is not None and outer.backend == self.name:
            _xs().set_global_mesh(to_xla_mesh(outer))
        else:
            _xs().set_global_mesh(None)

    def bind_thread(self, mesh: Mesh) -> None:
        return None  # torch_xla places through its runtime, not a thread's current device

    def fence(self) -> Callable[[], None] | None:
        return None  # torch_xla orders transfers before the computations that read them

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

    def global_maker(
        self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]
    ) -> Callable[[list[torch.Tensor]], torch.Tensor]:
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
        xlac = _xla()._XLAC
        tensors = [_unwrap(t) for t in tensors]
        _materialize(tensors)
        wide = {
            i
            for i, t in enumerate(tensors)
            if t.dtype == torch.complex128 and _sharding_spec_text(t) != ""
        }
        if wide:  # read through their real view (see _real_view)
            tensors = [_real_view(t) if i in wide else t for i, t in enumerate(tensors)]
            _materialize([tensors[i] for i in wide])
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
                shards.append(LocalShard(_device_id(dev), ranges, data))
            out.append(shards)
        for i in wide:
            out[i] = [
                LocalShard(s.device, s.ranges[:-1], torch.view_as_complex(s.data.contiguous()))
                for s in out[i]
            ]
        return out

    def local_ranges(self, x: torch.Tensor) -> dict[int, tuple[tuple[int, int], ...]] | None:
        # torch_xla 2.9: `_get_local_shard_replica_and_indices` gives each local device's
        # global slices (in `local_devices` order) without copying data.
        x = _unwrap(x)
        _materialize([x])
        shape = tuple(x.shape)
        if _sharding_spec_text(x) == "":  # never annotated: whole on every device
            return dict.fromkeys(_local_devices(), tuple((0, n) for n in shape))
        indices = _xla()._XLAC._get_local_shard_replica_and_indices([x])[0]
        return {
            d: _parse_ranges(idx, shape)
            for d, (_, idx) in zip(_local_devices(), indices, strict=True)
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
        if isinstance(x, _xs().XLAShardedTensor):  # what xs.mark_sharding returns
            x = x.global_tensor
        y = x.clone()
        _annotate_custom_sharding(y, op_sharding(mesh, axes))
        return y

    def full_local(self, x: torch.Tensor) -> torch.Tensor:
        return x  # traced into the step: the compiler moves what the index maths needs

    def take_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # XLA partitions this gather over a row-split operand itself (a masked local gather
        # and an all-reduce of the output; docs/design.md). Plain tensors take the same path.
        return x.index_select(0, index.to(x.device))

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        return None  # an OpSharding expresses every spec torchshard accepts

    def compares_processes(self, mesh: Mesh) -> bool:
        # Not checked: torch_xla has no cheap collective outside a step (see docs/design.md).
        return False

    def agree(self, mesh: Mesh, call: AgreementCall, *, what: str) -> None:
        return None

    def agree_begin(self, mesh: Mesh, call: AgreementCall, *, what: str) -> Callable[[], None]:
        return lambda: None

    def check_values(self, mesh: Mesh, tree: Any, *, argname: str, what: str) -> None:
        return None  # one controller: virtual_hosts checks replicas itself

    def exchange(
        self, mesh: Mesh, items: Sequence[str], *, what: str = "torchshard"
    ) -> list[list[str]] | None:
        return None


BACKEND = XlaBackend()
register_backend(BACKEND.name, BACKEND)
