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
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torchshard._backend import AgreementCall, LocalShard, register_backend
from torchshard._backend._torch_private import is_strided_shard, local_shape_and_offset
from torchshard._core.agreement import agreement_check_enabled, digest, disagreement
from torchshard._core.errors import NoProcessGroupError, ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes, check_device_process
from torchshard._core.topology import Topology

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
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


class _Groups:
    """Per default process group: the DeviceMeshes built for meshes without one, and the
    gloo group of the agreement check (its own group, so that a loader thread's check never
    interleaves with a step's collectives on the default group)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.world: Any = None
        self.meshes: dict[Mesh, DeviceMesh] = {}
        self.agreement: Any = None

    def _current(self) -> None:
        world = dist.group.WORLD
        if self.world is not world:
            self.world, self.meshes, self.agreement = world, {}, None

    def device_mesh(self, mesh: Mesh) -> DeviceMesh:
        with self.lock:
            self._current()
            dm = self.meshes.get(mesh)
            if dm is None:
                ids = torch.as_tensor(np.asarray(mesh.devices))
                dm = DeviceMesh(_device_type(), ids, mesh_dim_names=mesh.axis_names)
                self.meshes[mesh] = dm
            return dm

    def agreement_group(self) -> Any:
        with self.lock:
            self._current()
            if self.agreement is None:
                self.agreement = dist.new_group(backend="gloo")
            return self.agreement


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
    _check_rank_order(Mesh(grid, names, backend="dtensor"))  # validates before any collective
    if np.array_equal(grid.reshape(-1), np.arange(grid.size)):
        dm = init_device_mesh(_device_type(), tuple(grid.shape), mesh_dim_names=names)
    else:
        dm = DeviceMesh(_device_type(), torch.as_tensor(grid), mesh_dim_names=names)
    return mesh_from_device_mesh(dm)


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
        if dist.get_world_size() > 1:  # made here (collective), even if the check is off now
            _GROUPS.agreement_group()

    def deactivate(self, mesh: Mesh, outer: Mesh | None) -> None:
        return None  # DTensors carry their DeviceMesh; there is no global mesh to restore

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
        if dm.device_type == "cpu":  # own the memory, as a device copy would
            local = local.clone(memory_format=torch.contiguous_format)
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
        out = []
        for x in tensors:
            x = _without_partial(x)
            if any(_is_strided(p) for p in x.placements):  # a rank's rows are not one block
                flat = [Shard(p.dim) if _is_strided(p) else p for p in x.placements]
                x = _redistribute(x, x.device_mesh, flat)
            shape, offset = _local_offset(x)
            ranges = tuple((o, o + n) for o, n in zip(offset, shape, strict=True))
            out.append([LocalShard(rank, ranges, _host_copy(x.to_local()))])
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
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
        return _redistribute(x, x.device_mesh, target)

    def full_local(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x
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
        return _take_rows(x, self.full_local(index))

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        placements(mesh, axes)

    def compares_processes(self, mesh: Mesh) -> bool:
        return agreement_check_enabled() and dist.get_world_size() > 1

    def agree(self, mesh: Mesh, call: AgreementCall, *, what: str) -> None:
        if not self.compares_processes(mesh):
            return
        every = self.exchange(mesh, call.describe())
        if every is not None:
            raise disagreement(what, every, call.path)

    def exchange(self, mesh: Mesh, items: Sequence[str]) -> list[list[str]] | None:
        if not self.compares_processes(mesh):
            return None
        world = dist.get_world_size()
        group = _GROUPS.agreement_group()
        mine = torch.tensor([digest(items)], dtype=torch.int64)
        hashes = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(hashes, mine, group=group)
        if all(bool(h == hashes[0]) for h in hashes):
            return None
        every: list[Any] = [None] * world
        dist.all_gather_object(every, list(items), group=group)
        return every


BACKEND = DTensorBackend()
register_backend(BACKEND.name, BACKEND)
