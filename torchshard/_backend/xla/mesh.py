"""torch_xla's own meshes: a ``Mesh`` value as an ``xs.Mesh`` and back, and torch_xla's global
mesh (``XlaMeshes``, the backend's ``Meshes``)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from torchshard._backend.xla.runtime import topology, xs
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes, check_device_process


@functools.lru_cache(maxsize=256)
def to_xla_mesh(mesh: Mesh) -> Any:
    """``mesh`` as a ``torch_xla.distributed.spmd.Mesh``."""
    check_device_process(mesh, topology().device_process)
    return xs().Mesh(np.asarray(mesh.device_ids), tuple(mesh.devices.shape), mesh.axis_names)


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


class XlaMeshes:
    """torch_xla's meshes: ``xs.Mesh`` objects and the process's global mesh."""

    process_wide = True  # xs.set_global_mesh: one mesh for every thread

    def from_native(self, native: Any) -> Mesh:
        return mesh_from_xla(native)

    def native(self, mesh: Mesh) -> Any:
        return to_xla_mesh(mesh)

    def create(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        return Mesh(grid, axis_names, backend="xla")

    def make_current(self, mesh: Mesh | None) -> None:
        xs().set_global_mesh(None if mesh is None else to_xla_mesh(mesh))
