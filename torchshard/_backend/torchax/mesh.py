"""JAX's own meshes: a ``Mesh`` value as a ``jax.sharding.Mesh`` (every axis ``Auto``) and
back, and JAX's current mesh (``TorchaxMeshes``, the backend's ``Meshes``).

**Auto axes.** Since JAX 0.9 ``jax.make_mesh`` makes ``Explicit`` axes, on which torchax's
``Tensor.shard_`` (``with_sharding_constraint``) fails ("can only refer to Auto axes"); the
meshes made here have ``Auto`` axes, and a JAX mesh with other axis types is refused by
``from_native`` with the fix.

**The current mesh.** ``with mesh:`` makes the mesh JAX's current mesh of the thread with
``jax.set_mesh`` (``with jax_mesh:`` is deprecated since JAX 0.10.1), so that the program's own
JAX and torchax calls inside the block (``jax.lax.with_sharding_constraint(x, P(...))``) see it;
leaving it restores the thread's outer mesh (``None``: the JAX mesh the thread had before).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from torchshard._backend.torchax.runtime import device_index, devices, jax, topology
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes, check_device_process


def _auto(n: int) -> dict[str, Any]:
    axis_type = getattr(jax().sharding, "AxisType", None)
    return {} if axis_type is None else {"axis_types": (axis_type.Auto,) * n}


@functools.lru_cache(maxsize=256)
def to_jax_mesh(mesh: Mesh) -> Any:
    """``mesh`` as a ``jax.sharding.Mesh`` with ``Auto`` axes (its ``native`` when it has one)."""
    if mesh.native is not None:
        return mesh.native
    check_device_process(mesh, topology().device_process)
    every = devices()
    grid = np.empty(mesh.devices.shape, dtype=object)
    for idx, d in np.ndenumerate(mesh.devices):
        grid[idx] = every[int(d)]
    return jax().sharding.Mesh(grid, mesh.axis_names, **_auto(len(mesh.axis_names)))


def mesh_from_jax(native: Any) -> Mesh:
    """The torchshard ``Mesh`` of a ``jax.sharding.Mesh`` whose axes are all ``Auto``."""
    j = jax()
    if not isinstance(native, j.sharding.Mesh):
        raise TypeError(
            f"Mesh.from_jax: expected a jax.sharding.Mesh, but got {type(native).__name__}."
        )
    types = getattr(native, "axis_types", None)
    axis_type = getattr(j.sharding, "AxisType", None)
    if types is not None and axis_type is not None:
        other = [
            (n, str(t).rsplit(".", 1)[-1])
            for n, t in zip(native.axis_names, types, strict=True)
            if t != axis_type.Auto
        ]
        if other:
            names = tuple(native.axis_names)
            raise ShardingError(
                f"Mesh.from_jax: the JAX mesh's axes {other} are not Auto (jax.make_mesh makes "
                "Explicit axes since JAX 0.9), and torchax shards tensors with "
                "with_sharding_constraint, which can only refer to Auto axes. Build it with "
                f"jax.make_mesh({tuple(native.devices.shape)}, {names}, axis_types="
                f"(jax.sharding.AxisType.Auto,) * {len(names)}), or use "
                "torchshard.create_device_mesh(..., backend='torchax')."
            )
    index = device_index()
    ids = np.vectorize(lambda d: index[d], otypes=[np.int64])(native.devices)
    return Mesh(ids, tuple(native.axis_names), backend="torchax", native=native)


def named_sharding(mesh: Mesh, axes: DimAxes, keep: frozenset[int] = frozenset()) -> Any:
    """The ``NamedSharding`` of the per-dimension ``axes`` on ``mesh`` (``keep``: dimensions
    left ``UNCONSTRAINED``)."""
    return _named_sharding(mesh, axes, keep)


@functools.lru_cache(maxsize=4096)
def _named_sharding(mesh: Mesh, axes: DimAxes, keep: frozenset[int]) -> Any:
    sharding = jax().sharding
    P = sharding.PartitionSpec
    entries: list[Any] = []
    for d, dim in enumerate(axes):
        if d in keep:
            entries.append(P.UNCONSTRAINED)
        elif not dim:
            entries.append(None)
        else:
            entries.append(dim[0] if len(dim) == 1 else tuple(dim))
    while entries and entries[-1] is None:
        entries.pop()
    return sharding.NamedSharding(to_jax_mesh(mesh), P(*entries))


class _Previous(threading.local):
    def __init__(self) -> None:
        self.outer: list[Any] = []  # per thread: JAX's mesh before torchshard's first entry


_PREVIOUS = _Previous()


def _set_mesh(native: Any) -> None:
    j = jax()
    setter = getattr(j, "set_mesh", None) or getattr(j.sharding, "set_mesh", None)
    if setter is not None:
        setter(native)
        return
    use = getattr(j.sharding, "use_mesh", None)  # JAX before set_mesh
    if use is not None:
        use(native).__enter__()


def _get_mesh() -> Any:
    getter = getattr(jax().sharding, "get_mesh", None)
    return None if getter is None else getter()


class TorchaxMeshes:
    """JAX's meshes: ``jax.sharding.Mesh`` objects, and JAX's current mesh of each thread."""

    process_wide = False  # jax.set_mesh sets the calling thread's mesh

    def from_native(self, native: Any) -> Mesh:
        return mesh_from_jax(native)

    def native(self, mesh: Mesh) -> Any:
        return to_jax_mesh(mesh)

    def create(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        return Mesh(grid, axis_names, backend="torchax")

    def make_current(self, mesh: Mesh | None) -> None:
        state = _PREVIOUS
        if mesh is not None:
            if not state.outer:
                state.outer.append(_get_mesh())
            _set_mesh(to_jax_mesh(mesh))
        elif state.outer:  # no torchshard mesh of this backend left in this thread
            before = state.outer.pop()
            empty = before is None or getattr(before, "empty", False)
            _set_mesh(None if empty else before)
