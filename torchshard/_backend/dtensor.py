"""The torch.distributed DTensor backend (registered as ``"dtensor"``): one process per device;
global tensors are DTensors.

Device ids are ranks: device ``r`` belongs to rank ``r`` (one device per process), so a
process's block of a leaf is exactly its device's shard. ``make_global`` wraps a copy of that
block with ``DTensor.from_local`` and an explicit global ``shape`` and contiguous ``stride``;
no collective runs. Placements come from the spec: ``Shard(d)`` on every mesh axis that splits
dim ``d``, ``Replicate()`` on the others. Reading back uses ``to_local()`` with DTensor's own
offsets; ``gather`` is ``full_tensor()`` and ``annotate`` is ``redistribute``. In-step
dispatch gets the key's whole value with ``full_tensor()`` and gathers rows with a masked local
copy summed over the ranks (``take_rows``). It contributes the cross-process agreement step
(``agree``): each process's block decides the global shape, so processes that pass different
shapes must all fail, not hang.

This module is imported only when a mesh names the ``"dtensor"`` backend, the default process
group makes it the default backend, or the dispatch code meets a DTensor. The private torch
functions it calls are each wrapped in one small function, with the version they were checked
on (torch 2.9.0).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torchshard._backend import AgreementCall, LocalShard, collective, register_backend, staging
from torchshard._backend import device as devices
from torchshard._backend._torch_private import is_strided_shard, local_shape_and_offset
from torchshard._backend.collective import guarded
from torchshard._core.agreement import (
    agreement_check_enabled,
    disagreement,
    value_check_enabled,
)
from torchshard._core.errors import NoProcessGroupError, ProcessDisagreementError, ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes, check_device_process
from torchshard._core.topology import Topology
from torchshard._core.tree import LazyPaths, flatten

# gloo's all_gather rejects int16 ("Invalid scalar type", torch 2.9.0); collectives that only
# move bytes (gather, redistribute without Partial) reinterpret it as a same-sized dtype.
_BYTE_VIEWS = {torch.int16: torch.float16}
# take_rows sums rows that only one rank holds: int16 is summed as int32 (gloo refuses int16),
# bool as its uint8 bytes (a sum, not gloo's logical or); both are exact.
_SUM_CASTS = {torch.int16: torch.int32}
_SUM_VIEWS = {torch.bool: torch.uint8}


def require_process_group() -> None:
    """Raises ``NoProcessGroupError`` unless torch.distributed's default group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise NoProcessGroupError(
            "a mesh of the dtensor backend needs torch.distributed, but its default process "
            "group is not initialised. Call torch.distributed.init_process_group('gloo') (or "
            "'nccl') on every process first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT), or use a mesh of the xla backend."
        )


@functools.lru_cache(maxsize=64)
def _topology(rank: int, world: int) -> Topology:
    return Topology(rank, world, tuple(range(world)))


@functools.lru_cache(maxsize=256)
def _check_covers_world(mesh: Mesh, world: int) -> None:
    check_device_process(mesh, tuple(range(world)))


@functools.lru_cache(maxsize=256)
def _check_rank_order(mesh: Mesh) -> None:
    """Along every mesh axis the ranks must ascend.

    torch 2.9.0's DeviceMesh runs an axis's collectives on a process group whose ranks are
    sorted (``new_group`` sorts them; a 1-D mesh over the world reuses the default group),
    while DTensor places shards by mesh position: on a mesh such as ``[1, 0]``,
    ``full_tensor`` and ``redistribute`` put the blocks in the wrong places (measured).
    """
    grid = mesh.devices
    for k, name in enumerate(mesh.axis_names):
        for row in np.moveaxis(grid, k, -1).reshape(-1, grid.shape[k]):
            if (np.diff(row) < 0).any():
                raise ShardingError(
                    f"{mesh!r}: along mesh axis {name!r} the ranks {row.tolist()} do not "
                    "ascend. torch 2.9's DeviceMesh runs an axis's collectives in ascending "
                    "rank order while DTensor places shards by mesh position, so full_tensor "
                    "and redistribute would misplace blocks. Order the ranks ascending along "
                    "every axis (a transposed grid such as [[0, 2], [1, 3]] is fine)."
                )


def _device_type() -> str:
    """The device type of a DeviceMesh torchshard builds: the process's accelerator when the
    default group serves it, else the CPU (``device.device_type_for``)."""
    return devices.device_type_for(str(dist.get_backend()), devices.accelerator_type())


_DEVICES: dict[int, tuple[DeviceMesh, devices.MeshDevice]] = {}  # id(DeviceMesh) -> its device


def mesh_device(dm: DeviceMesh) -> devices.MeshDevice:
    """This process's device of ``dm``: its type, and the index current when the mesh was first
    looked up on the program's thread (mesh entry; ``DeviceMesh`` sets it when built)."""
    hit = _DEVICES.get(id(dm))
    if hit is not None and hit[0] is dm:
        return hit[1]
    dev = devices.current_device(dm.device_type)
    _DEVICES[id(dm)] = (dm, dev)
    return dev


def _exchange(what: str, items: Sequence[str]) -> list[list[str]] | None:
    """Every process's ``items`` when they differ, ``None`` when they agree (the store-based
    exchange of ``collective``; bounded by the default group's timeout). Processes that are in
    different calls (``what`` differs: one skipped a call) all raise ``ProcessDisagreementError``.
    """
    return _in_step(what, collective.exchange(what, items))


def _in_step(what: str, every: list[list[str]] | None) -> list[list[str]] | None:
    """``every`` without the call names; raises when the processes are in different calls."""
    if every is None:
        return None
    whats = [e[0] for e in every]
    if len(set(whats)) > 1:
        seen = "; ".join(f"rank {r}: {w}" for r, w in enumerate(whats))
        raise ProcessDisagreementError(
            f"{what}: the processes are out of step, each in another torchshard call ({seen}). "
            "Every process must make the same torchshard calls in the same order (the same "
            "host_to_global_array calls, the same loader batches, the same read-backs)."
        )
    return [e[1:] for e in every]


def _build_rendezvous(mesh: Mesh) -> None:
    """Before a ``DeviceMesh`` is built (collective: every rank must build it): every process
    must be building this mesh; bounded by the default group's timeout, and the error names the
    ranks that did not come. A mesh entered on one rank only fails here instead of hanging."""
    _exchange(f"building the DeviceMesh of {mesh!r} (every process must enter it)", [])


def _bound(dm: DeviceMesh) -> DeviceMesh:
    """``dm`` with its groups' timeout set to the default group's (new_group's is 30 min)."""
    if dist.get_world_size() > 1:
        collective.bound_timeouts([dm.get_group(i) for i in range(dm.ndim)])
    return dm


class _Groups:
    """Per default process group: the DeviceMeshes built for meshes without one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.world: Any = None
        self.meshes: dict[Mesh, DeviceMesh] = {}

    def _current(self) -> None:
        world = dist.group.WORLD
        if self.world is not world:
            self.world, self.meshes = world, {}

    def device_mesh(self, mesh: Mesh) -> DeviceMesh:
        with self.lock:
            self._current()
            dm = self.meshes.get(mesh)
            if dm is None:
                _build_rendezvous(mesh)
                ids = torch.as_tensor(np.asarray(mesh.devices))
                dm = _bound(DeviceMesh(_device_type(), ids, mesh_dim_names=mesh.axis_names))
                self.meshes[mesh] = dm
            return dm


_GROUPS = _Groups()


_LAST: list[Any] = [None]  # (mesh, default group, DeviceMesh) of the last lookup


def device_mesh(mesh: Mesh) -> DeviceMesh:
    """The ``DeviceMesh`` of ``mesh``: the one it was made from, else one built (and cached)
    over its device ids. Building one is collective: every rank must enter the mesh."""
    world = dist.GroupMember.WORLD
    last = _LAST[0]
    if last is not None and last[0] is mesh and last[1] is world:  # once per leaf: keep it cheap
        return last[2]
    require_process_group()
    _check_covers_world(mesh, dist.get_world_size())
    _check_rank_order(mesh)
    native = mesh.native
    dm = native if isinstance(native, DeviceMesh) else _GROUPS.device_mesh(mesh)
    mesh_device(dm)  # the device index, read at mesh entry
    _LAST[0] = (mesh, world, dm)
    return dm


def mesh_from_device_mesh(device_mesh: Any) -> Mesh:
    """The ``Mesh`` of a ``DeviceMesh``: device ids are its ranks, axis names its dim names."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            "Mesh.from_device_mesh: expected a torch.distributed.device_mesh.DeviceMesh, but "
            f"got {type(device_mesh).__name__}."
        )
    names = device_mesh.mesh_dim_names
    if names is None:
        raise ShardingError(
            "Mesh.from_device_mesh: the DeviceMesh has no mesh_dim_names; torchshard specs name "
            "mesh axes, so build it with init_device_mesh(device_type, shape, "
            "mesh_dim_names=(...))."
        )
    ids = device_mesh.mesh.detach().cpu().numpy()
    mesh = Mesh(ids, tuple(names), backend="dtensor", native=device_mesh)
    _check_rank_order(mesh)
    return mesh


def create_mesh(grid: np.ndarray, axis_names: Sequence[str]) -> Mesh:
    """A dtensor ``Mesh`` over the rank grid ``grid``, with its ``DeviceMesh`` (collective)."""
    require_process_group()
    names = tuple(axis_names)
    mesh = Mesh(grid, names, backend="dtensor")
    _check_rank_order(mesh)  # validates before any collective
    _build_rendezvous(mesh)
    device_type = _device_type()
    default_layout = np.array_equal(grid.reshape(-1), np.arange(grid.size))
    topology_aware = devices.topology_aware(device_type) if default_layout else None
    if topology_aware is not None:
        dm = _topology_aware_mesh(topology_aware, device_type, tuple(grid.shape), names)
    elif default_layout:
        dm = init_device_mesh(device_type, tuple(grid.shape), mesh_dim_names=names)
    else:
        dm = DeviceMesh(device_type, torch.as_tensor(grid), mesh_dim_names=names)
    return mesh_from_device_mesh(_bound(dm))


def _topology_aware_mesh(
    build: Callable[..., Any], device_type: str, shape: tuple[int, ...], names: tuple[str, ...]
) -> DeviceMesh:
    """TorchTPU's layout of ``shape`` (``topology_aware_mesh(shape, mesh_dim_names=names)``:
    a DeviceMesh, or a grid of ranks), with the indices along each axis reordered so that the
    ranks ascend (same process groups; ``device.ascending_grid``), or a clear error."""
    made = build(shape, mesh_dim_names=names)
    ranks = made.mesh if isinstance(made, DeviceMesh) else made
    grid = np.asarray(torch.as_tensor(ranks).cpu().numpy(), dtype=np.int64)
    if grid.shape != shape:
        raise ShardingError(
            f"torch.tpu.distributed.topology_aware_mesh{shape} returned a layout of shape "
            f"{grid.shape}; expected {shape}."
        )
    ordered = devices.ascending_grid(grid, names, "torch.tpu.distributed.topology_aware_mesh")
    if isinstance(made, DeviceMesh) and np.array_equal(ordered, grid):
        return made
    return DeviceMesh(device_type, torch.as_tensor(ordered), mesh_dim_names=names)


@functools.lru_cache(maxsize=4096)
def placements(mesh: Mesh, axes: DimAxes) -> tuple[Placement, ...]:
    """One placement per mesh axis: ``Shard(d)`` when the axis splits dim ``d``, else
    ``Replicate()``. Refuses a tuple of axes that is not in mesh order (see below)."""
    dim_of: dict[str, int] = {}
    for d, dim in enumerate(axes):
        # DTensor splits a dim over several mesh axes in mesh order (earlier mesh axis major),
        # which is torchshard's order when the tuple lists them in mesh order. Axes of size 1
        # do not change the order of the shards.
        split = [a for a in dim if mesh.shape[a] > 1]
        ordered = sorted(split, key=mesh.axis_names.index)
        if split != ordered:
            raise ShardingError(
                f"dim {d} is split over the mesh axes {dim!r} (major to minor), but DTensor "
                f"splits a dimension over several mesh axes in mesh order ({tuple(ordered)!r} "
                f"on mesh {dict(mesh.shape)}); its only other order, the private _StridedShard, "
                "is lost by elementwise ops and redistribute in torch 2.9. Write the tuple in "
                f"mesh order, {tuple(ordered)!r}, or build the mesh with its axes in the order "
                f"{tuple(split)!r}."
            )
        for a in dim:
            dim_of[a] = d
    return tuple(Shard(dim_of[a]) if a in dim_of else Replicate() for a in mesh.axis_names)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _local_offset(x: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # DTensor's own local shape and global offset (a private function, see _torch_private),
    # which knows its sequential splitting of uneven and _StridedShard layouts.
    return local_shape_and_offset(x.shape, x.device_mesh, x.placements)


def _is_strided(p: Placement) -> bool:
    # By type: `_StridedShard` is a `Shard` (equal to `Shard(dim)`) up to torch 2.13 and a
    # separate placement from torch 2.14 on (see _torch_private).
    return is_strided_shard(p)


def _without_partial(x: DTensor) -> DTensor:
    """``x`` with its Partial placements reduced (a collective), others unchanged."""
    if not any(p.is_partial() for p in x.placements):
        return x
    target = [Replicate() if p.is_partial() else p for p in x.placements]
    return x.redistribute(x.device_mesh, target)


def _redistribute(x: DTensor, dm: DeviceMesh, target: Sequence[Placement]) -> DTensor:
    if any(_is_strided(p) for p in x.placements):
        # torch 2.9.0 redistributes _StridedShard to Shard wrongly; through Replicate is right.
        x = x.redistribute(dm, [Replicate()] * dm.ndim)
    view = _BYTE_VIEWS.get(x.dtype)
    if view is None or any(p.is_partial() for p in x.placements):
        return x.redistribute(dm, target)
    moved = _reinterpret(x, view).redistribute(dm, target)
    return _reinterpret(moved, x.dtype)


def _reinterpret(x: DTensor, dtype: torch.dtype) -> DTensor:
    local = x.to_local().view(dtype)
    return DTensor.from_local(
        local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


def _keeping(
    mesh: Mesh,
    axes: DimAxes,
    keep: frozenset[int],
    current: tuple[Placement, ...],
    target: tuple[Placement, ...],
) -> tuple[Placement, ...]:
    """``target`` where every mesh axis that the spec leaves free and that splits a kept
    (``UNCONSTRAINED``) dimension keeps that split. An axis the spec uses goes to the spec."""
    used = {a for dim in axes for a in dim}
    return tuple(
        c if name not in used and type(c) is Shard and c.dim in keep else t
        for name, c, t in zip(mesh.axis_names, current, target, strict=True)
    )


def _take_rows(x: DTensor, index: torch.Tensor) -> DTensor:
    """``out[l] = x[index[l]]`` along dim 0, sharded like ``x``; ``index`` is the same plain
    tensor on every rank.

    DTensor's own ``index_select`` all-gathers ``x`` (padding rows included) to every rank.
    Here each rank gathers the rows it holds into an ``[L, ...]`` tensor that is zero elsewhere
    and the sum over the ranks that split dim 0 (a ``Partial`` reduced by ``redistribute``:
    reduce-scatter) moves only logical rows, as XLA partitions the same gather. Each row has
    exactly one contributor, so the sum is exact: floats are filled with ``-0.0`` (``v + -0.0
    == v`` bit for bit, ``-0.0`` and NaN included), integers with 0. Differentiable.
    """
    dm = x.device_mesh
    x = _without_partial(x)
    if any(_is_strided(p) and p.dim == 0 for p in x.placements):  # rows not contiguous
        rows = [
            Replicate() if p.is_shard(0) or (_is_strided(p) and p.dim == 0) else p
            for p in x.placements
        ]
        x = _redistribute(x, dm, rows)
    split = [i for i, p in enumerate(x.placements) if p.is_shard(0)]
    local = x.to_local()
    index = index.to(device=local.device, dtype=torch.int64)
    shape = (index.shape[0], *x.shape[1:])
    if not split:  # every rank holds all rows: no communication
        return DTensor.from_local(
            local.index_select(0, index),
            dm,
            x.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )
    start, held = _local_offset(x)[1][0], local.shape[0]
    dtype = _SUM_CASTS.get(local.dtype, local.dtype)
    fill = torch.full((), -0.0 if dtype.is_floating_point or dtype.is_complex else 0, dtype=dtype)
    fill = fill.to(local.device)
    if held:  # no nonzero(): on CUDA it would wait for the device
        mine = (index >= start) & (index < start + held)
        picked = local.index_select(0, (index - start).clamp(0, held - 1)).to(dtype)
        summands = torch.where(mine.view(-1, *[1] * (local.dim() - 1)), picked, fill)
    else:  # an uneven split left this rank no rows
        summands = fill.expand(shape[0], *local.shape[1:]).clone()
    view = _SUM_VIEWS.get(dtype)
    if view is not None:
        summands = summands.view(view)
    partial = [Partial() if i in split else p for i, p in enumerate(x.placements)]
    out = DTensor.from_local(
        summands,
        dm,
        partial,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    ).redistribute(dm, x.placements)
    if view is not None:
        return _reinterpret(out, x.dtype)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _check_sizes(x: DTensor, what: str) -> None:
    """Before a gather: every process must hold a DTensor of the same global shape, dtype,
    placements and mesh, and its local block must be the one DTensor expects. Otherwise gloo's
    all-gather would abort one process and leave another with uninitialised memory (processes
    that passed different shapes with the agreement check off). Checked through one exchange,
    so every process raises the same error."""
    expected = tuple(_local_offset(x)[0])
    local = tuple(x.to_local().shape)
    dtype = str(x.dtype).removeprefix("torch.")
    layout = f"placements {list(x.placements)} on ranks {x.device_mesh.mesh.tolist()}"
    item = f"a DTensor of global shape {tuple(x.shape)}, {dtype}, {layout}"
    if local != expected:
        item += f", whose local block is {local} where DTensor expects {expected}"
    every = _exchange(f"{what}: checking sizes before the gather", [item])
    if every is None:
        return
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(every):
        groups.setdefault(e[0], []).append(r)
    seen = "; ".join(f"{d} on rank(s) {rs}" for d, rs in groups.items())
    raise ProcessDisagreementError(
        f"{what}: every process must gather the same tensor, but found {seen}. The "
        "processes passed different shapes or dtypes when it was made (with the agreement "
        "check off, see set_agreement_check, or DTensor.from_local with a wrong shape); "
        "nothing was gathered."
    )


def _checksum(t: torch.Tensor) -> str:
    """A 16-hex-digit blake2b of ``t``'s bytes (any dtype; bit patterns, so -0.0 != 0.0)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def check_values(tree: Any, argname: str, what: str) -> None:
    """Processes whose blocks of a DTensor in ``tree`` cover the same global ranges must hold
    the same values (``set_value_check``): one exchange of a checksum per leaf and process."""
    leaves, treespec = flatten(tree)
    mine = []
    for x in leaves:
        if not isinstance(x, DTensor):
            mine.append("-")
            continue
        shape, offset = _local_offset(x)
        ranges = tuple((o, o + n) for o, n in zip(offset, shape, strict=True))
        mine.append(f"{ranges} {_checksum(x.to_local())}")
    every = collective.gather_all(f"{what}: the value check", mine)
    if every is None:
        return
    where = LazyPaths(treespec, argname)
    for i in range(len(leaves)):
        by_ranges: dict[str, dict[str, list[int]]] = {}
        for r, items in enumerate(every):
            ranges, _, checksum = items[i].rpartition(" ")
            by_ranges.setdefault(ranges, {}).setdefault(checksum, []).append(r)
        for ranges, sums in by_ranges.items():
            if len(sums) > 1:
                seen = "; ".join(f"checksum {c} on rank(s) {rs}" for c, rs in sums.items())
                raise ProcessDisagreementError(
                    f"{where[i]}: {what}: the ranks {sorted(r for rs in sums.values() for r in rs)}"
                    f" hold the same block (global ranges {ranges}, one (start, stop) per "
                    f"dimension) and must pass the same values, but found {seen}. A replicated "
                    "leaf (P()) or a mesh axis the spec leaves free gives several processes the "
                    "same block: give them equal values, or shard the leaf over that axis."
                )


def _nothing() -> None:
    return None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class DTensorBackend:
    """torch.distributed DTensor (one process per device, device id = rank)."""

    name = "dtensor"
    keeps_unconstrained_dims = True

    def topology(self) -> Topology:
        require_process_group()
        return _topology(dist.get_rank(), dist.get_world_size())

    def local_devices(self, mesh: Mesh) -> Sequence[int]:
        require_process_group()
        return (dist.get_rank(),)

    def mesh_from_native(self, native: Any) -> Mesh:
        return mesh_from_device_mesh(native)

    def native_mesh(self, mesh: Mesh) -> Any:
        return device_mesh(mesh)

    def create_mesh(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        return create_mesh(grid, axis_names)

    def activate(self, mesh: Mesh) -> None:
        self.prepare(mesh)

    def prepare(self, mesh: Mesh) -> None:
        device_mesh(mesh)

    def deactivate(self, mesh: Mesh, outer: Mesh | None) -> None:
        return None  # DTensors carry their DeviceMesh; there is no global mesh to restore

    def bind_thread(self, mesh: Mesh) -> None:
        devices.bind_thread(mesh_device(device_mesh(mesh)))

    def fence(self) -> Callable[[], None] | None:
        readies = staging.seal_all()
        if not readies:
            return None
        if len(readies) == 1:
            return readies[0]

        def ready() -> None:
            for r in readies:
                r()

        return ready

    def is_global(self, x: Any) -> bool:
        return isinstance(x, DTensor)

    def is_sharded(self, x: torch.Tensor) -> bool:
        return True  # a DTensor always has placements

    def make_global(
        self,
        mesh: Mesh,
        axes: DimAxes,
        global_shape: tuple[int, ...],
        shards: Sequence[torch.Tensor],
        *,
        background: bool = False,
    ) -> torch.Tensor:
        # `background` changes nothing here: the clone and from_local run without the GIL.
        if len(shards) != 1:
            raise RuntimeError(
                f"the dtensor backend takes one shard per process, but got {len(shards)}."
            )
        dm = device_mesh(mesh)
        local = shards[0]
        dev = mesh_device(dm)
        if dev.is_cpu:  # own the memory, as a device copy would
            local = local.clone(memory_format=torch.contiguous_format)
        else:  # pinned staging, a non_blocking copy on the copy stream (staging.py)
            ring = staging.ring(dev)
            local = ring.stage(local)
            if not background:  # this thread uses it next: its stream waits for this copy
                ready = ring.seal()
                if ready is not None:
                    ready()
        return DTensor.from_local(
            local,
            dm,
            placements(mesh, axes),
            run_check=False,
            shape=torch.Size(global_shape),
            stride=_contiguous_stride(global_shape),
        )

    def global_maker(
        self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]
    ) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        # make_global itself: it looks the DeviceMesh up on every call, since a new default
        # process group (same ranks) needs a new one.
        return functools.partial(self.make_global, mesh, axes, global_shape)

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[list[LocalShard]]:
        if not tensors:
            return []
        rank = dist.get_rank()
        locals_, ranges = [], []
        for x in tensors:
            if any(p.is_partial() for p in x.placements):
                with guarded("global_to_host_array: reducing a Partial placement"):
                    x = _without_partial(x)
            if any(_is_strided(p) for p in x.placements):  # a rank's rows are not one block
                flat = [Shard(p.dim) if _is_strided(p) else p for p in x.placements]
                with guarded("global_to_host_array: moving a strided split to a plain one"):
                    x = _redistribute(x, x.device_mesh, flat)
            shape, offset = _local_offset(x)
            ranges.append(tuple((o, o + n) for o, n in zip(offset, shape, strict=True)))
            locals_.append(x.to_local())
        # device -> pinned host memory for every leaf, then one synchronisation
        hosts = staging.read_back(locals_)
        return [[LocalShard(rank, r, h)] for r, h in zip(ranges, hosts, strict=True)]

    def local_ranges(self, x: torch.Tensor) -> dict[int, tuple[tuple[int, int], ...]] | None:
        if any(p.is_partial() for p in x.placements):
            return None  # partial sums: no layout of a value
        shape, offset = _local_offset(x)
        return {dist.get_rank(): tuple((o, o + n) for o, n in zip(offset, shape, strict=True))}

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        what = "replicate_to_local_data"
        if not all(p.is_replicate() for p in x.placements):
            _check_sizes(x, what)  # before the collective, whatever the agreement switch says
        with guarded(f"{what}: gathering a tensor of shape {tuple(x.shape)}"):
            x = _without_partial(x)
            if all(p.is_replicate() for p in x.placements):
                return _host_copy(x.to_local())
            view = _BYTE_VIEWS.get(x.dtype)
            if view is not None:
                return _reinterpret(x, view).full_tensor().view(x.dtype).cpu()
            return x.full_tensor().detach().cpu()

    def annotate(
        self, x: torch.Tensor, mesh: Mesh, axes: DimAxes, *, keep: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        if not isinstance(x, DTensor):
            raise TypeError(
                f"the dtensor backend constrains DTensors, but got {type(x).__name__}; make "
                "global tensors with host_to_global_array (or DTensor.from_local) on "
                f"{mesh!r}."
            )
        target = placements(mesh, axes)
        ranks = x.device_mesh.mesh.cpu().numpy()
        if not np.array_equal(ranks, mesh.devices):
            raise ShardingError(
                f"the DTensor lives on a DeviceMesh of ranks {ranks.tolist()} (axes "
                f"{x.device_mesh.mesh_dim_names}), not on the current mesh {mesh!r} (ranks "
                f"{mesh.devices.tolist()}); constrain it inside `with "
                "Mesh.from_device_mesh(x.device_mesh):`, or make it on the current mesh."
            )
        current = tuple(x.placements)
        if keep:
            target = _keeping(mesh, axes, keep, current, target)
        if all(type(a) is type(b) and a == b for a, b in zip(current, target, strict=True)):
            return x
        with guarded(f"maybe_shard: redistributing a tensor of shape {tuple(x.shape)}"):
            return _redistribute(x, x.device_mesh, target)

    def full_local(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x
        with guarded(f"dispatch: gathering a key of shape {tuple(x.shape)}"):
            x = _without_partial(x)
            if all(p.is_replicate() for p in x.placements):
                return x.to_local()
            view = _BYTE_VIEWS.get(x.dtype)
            if view is not None:
                return _reinterpret(x, view).full_tensor().view(x.dtype)
            return x.full_tensor()

    def take_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x.index_select(0, index.to(x.device))
        index = self.full_local(index)
        with guarded(f"dispatch: gathering rows of a tensor of shape {tuple(x.shape)}"):
            return _take_rows(x, index)

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        placements(mesh, axes)

    def compares_processes(self, mesh: Mesh) -> bool:
        return agreement_check_enabled() and dist.get_world_size() > 1

    def agree(self, mesh: Mesh, call: AgreementCall, *, what: str) -> None:
        self.agree_begin(mesh, call, what=what)()

    def agree_begin(self, mesh: Mesh, call: AgreementCall, *, what: str) -> Callable[[], None]:
        if not self.compares_processes(mesh):
            return _nothing
        end = collective.begin(what, call.describe())

        def agree_end() -> None:
            every = _in_step(what, end())
            if every is not None:
                raise disagreement(what, every, call.path)

        return agree_end

    def check_values(self, mesh: Mesh, tree: Any, *, argname: str, what: str) -> None:
        if value_check_enabled() and dist.get_world_size() > 1:
            check_values(tree, argname, what)

    def exchange(
        self, mesh: Mesh, items: Sequence[str], *, what: str = "torchshard"
    ) -> list[list[str]] | None:
        if not self.compares_processes(mesh):
            return None
        return _exchange(what, items)


BACKEND = DTensorBackend()
register_backend(BACKEND.name, BACKEND)
