"""DTensor's meshes: a ``Mesh`` value and its ``DeviceMesh`` (the one it was made from, or one
built and kept per default process group), the topology of the default group, and the mesh's
device on this process (``DTensorMeshes``, the backend's ``Meshes``)."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchshard._backend.dtensor import collective
from torchshard._backend.dtensor import device as devices
from torchshard._backend.dtensor.checks import exchange_in_step
from torchshard._core.errors import NoProcessGroupError, ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import check_device_process
from torchshard._core.topology import Topology


def require_process_group() -> None:
    """Raises ``NoProcessGroupError`` unless torch.distributed's default group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        from torchshard._backend.xla.env import xla_installed

        other = (
            ', or use a mesh of the xla backend (backend="xla")'
            if xla_installed()
            else "; one process per device, e.g. torchrun --nproc-per-node 2 train.py"
        )
        raise NoProcessGroupError(
            "a mesh of the dtensor backend needs torch.distributed, but its default process "
            "group is not initialised. Call torch.distributed.init_process_group('gloo') (or "
            "'nccl') on every process first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and "
            f"MASTER_PORT){other}."
        )


@functools.lru_cache(maxsize=64)
def _topology(rank: int, world: int) -> Topology:
    return Topology(rank, world, tuple(range(world)))


def topology() -> Topology:
    """The default process group's topology: device ``r`` belongs to rank ``r``."""
    require_process_group()
    return _topology(dist.get_rank(), dist.get_world_size())


@functools.lru_cache(maxsize=256)
def _check_covers_world(mesh: Mesh, world: int) -> None:
    check_device_process(mesh, tuple(range(world)))


@functools.lru_cache(maxsize=256)
def check_rank_order(mesh: Mesh) -> None:
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


def _build_rendezvous(mesh: Mesh) -> None:
    """Before a ``DeviceMesh`` is built (collective: every rank must build it): every process
    must be building this mesh; bounded by the default group's timeout, and the error names the
    ranks that did not come. A mesh entered on one rank only fails here instead of hanging."""
    exchange_in_step(f"building the DeviceMesh of {mesh!r} (every process must enter it)", [])


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
        if self.world is None or self.world() is not world:  # held weakly (see _Session)
            self.world, self.meshes = (None if world is None else weakref.ref(world)), {}

    def device_mesh(self, mesh: Mesh) -> DeviceMesh:
        with self.lock:
            self._current()
            dm = self.meshes.get(mesh)
            if dm is None:
                _build_rendezvous(mesh)
                # a copy: torch.as_tensor of the read-only devices warns ("not writable")
                ids = torch.tensor(mesh.devices.tolist(), dtype=torch.int64)
                dm = _bound(DeviceMesh(_device_type(), ids, mesh_dim_names=mesh.axis_names))
                self.meshes[mesh] = dm
            return dm


_GROUPS = _Groups()

_LAST: list[Any] = [None]  # (mesh, default group's weakref, DeviceMesh) of the last lookup


def device_mesh(mesh: Mesh) -> DeviceMesh:
    """The ``DeviceMesh`` of ``mesh``: the one it was made from, else one built (and cached)
    over its device ids. Building one is collective: every rank must enter the mesh."""
    world = dist.GroupMember.WORLD
    last = _LAST[0]
    if last is not None and last[0] is mesh and last[1]() is world:  # once per leaf: cheap
        return last[2]
    require_process_group()
    _check_covers_world(mesh, dist.get_world_size())
    check_rank_order(mesh)
    native = mesh.native
    if isinstance(native, DeviceMesh):
        _check_made_in(native, world, mesh)
        dm = native
    else:
        dm = _GROUPS.device_mesh(mesh)
    mesh_device(dm)  # the device index, read at mesh entry
    _LAST[0] = (mesh, weakref.ref(world), dm)  # the group weakly (see collective._Session)
    return dm


_WORLD_ATTR = "_torchshard_default_group"  # on a DeviceMesh: the default group it was made in


def _check_made_in(dm: DeviceMesh, world: Any, mesh: Mesh) -> None:
    """Refuses a DeviceMesh made before the default group was destroyed and made again: its
    sub-groups are gone (torch 2.9: "Could not resolve the process group registered under the
    name 3"), or, worse, their names now belong to other groups of the new one."""
    made = getattr(dm, _WORLD_ATTR, None)
    if made is not None and made() is not world:
        raise NoProcessGroupError(
            f"{mesh!r} was made before torch.distributed's default process group was destroyed "
            "(destroy_process_group) and initialised again: its DeviceMesh's process groups "
            "belong to the old one. Make the mesh again after init_process_group "
            "(torchshard.create_device_mesh(...) or Mesh.from_device_mesh(init_device_mesh(...)))."
        )


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
    world = dist.GroupMember.WORLD if dist.is_available() else None
    if world is not None and getattr(device_mesh, _WORLD_ATTR, None) is None:
        setattr(device_mesh, _WORLD_ATTR, weakref.ref(world))  # weakly (see collective._Session)
    mesh = Mesh(ids, tuple(names), backend="dtensor", native=device_mesh)
    check_rank_order(mesh)
    return mesh


def create_mesh(grid: np.ndarray, axis_names: Sequence[str]) -> Mesh:
    """A dtensor ``Mesh`` over the rank grid ``grid``, with its ``DeviceMesh`` (collective)."""
    require_process_group()
    names = tuple(axis_names)
    mesh = Mesh(grid, names, backend="dtensor")
    check_rank_order(mesh)  # validates before any collective
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


class DTensorMeshes:
    """DTensor's meshes: ``DeviceMesh`` objects, built on the program's thread."""

    process_wide = False  # DTensors carry their DeviceMesh: no current mesh to set

    def from_native(self, native: Any) -> Mesh:
        return mesh_from_device_mesh(native)

    def native(self, mesh: Mesh) -> Any:
        return device_mesh(mesh)

    def create(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        return create_mesh(grid, axis_names)

    def make_current(self, mesh: Mesh | None) -> None:
        # DTensors carry their DeviceMesh: there is no global mesh to set or restore, but the
        # DeviceMesh of a mesh entered on the program's thread is built there (collective).
        if mesh is not None:
            device_mesh(mesh)
