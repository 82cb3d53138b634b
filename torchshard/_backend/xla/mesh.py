"""torch_xla's own meshes: a ``Mesh`` value as an ``xs.Mesh`` and back, and torch_xla's global
mesh (``XlaMeshes``, the backend's ``Meshes``), which each thread reads as its own.

torch_xla keeps one global mesh per process (``xs.set_global_mesh``, a module global), which
its own calls read when given no mesh: ``xs.get_global_mesh()``, ``enable_manual_sharding`` and
``disable_manual_sharding``, FSDPv2 (``SpmdFullyShardedDataParallel``), the Pallas kernels'
``flash_attention``. torchshard's own calls never read it (they pass the mesh), but a program's
torch_xla calls do, and threads (or asyncio tasks) inside different meshes would all read the
mesh of the entry made last. So at the first ``with mesh:`` on torch_xla, torchshard replaces
``get_global_mesh`` in ``torch_xla.distributed.spmd`` and in its ``xla_sharding`` module (where
those calls look it up, by name, when they run) by ``thread_global_mesh``: the calling task's
or thread's innermost torchshard mesh on torch_xla (entered, or lent to a helper thread with
``thread_mesh``), else torch_xla's own value. torch_xla's own value is still set, to the mesh of
the entry made last among those still open (``_mesh/context.py``), for the code that cannot
follow: a thread inside no torchshard mesh, a ``get_global_mesh`` bound by name before the first
``with mesh:`` (``from torch_xla.distributed.spmd import get_global_mesh``), and reads of
``xla_sharding._GLOBAL_MESH`` itself. A mesh the program sets with ``xs.set_global_mesh`` is
every thread's (it is not torchshard's) until torchshard's next entry or exit.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from torchshard._backend.xla.runtime import replace_get_global_mesh, topology, xs
from torchshard._core.context import current_mesh_of
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


class _GlobalMesh:
    """What torchshard last set as torch_xla's global mesh, and torch_xla's own reader."""

    lock = threading.Lock()
    set_by_us: Any = None  # the xs.Mesh (or None) torchshard set last
    original: Callable[[], Any] | None = None  # torch_xla's get_global_mesh


def thread_global_mesh() -> Any:
    """torch_xla's ``get_global_mesh``, per task or thread: the innermost torchshard mesh on
    torch_xla of the calling task or thread, as an ``xs.Mesh``; else (no such mesh, or a global
    mesh the program set itself with ``xs.set_global_mesh``) torch_xla's own value."""
    original = _GlobalMesh.original
    with _GlobalMesh.lock:  # torchshard sets both under it: never one without the other
        found = original() if original is not None else None
        ours = found is _GlobalMesh.set_by_us
    if not ours:  # set by the program itself (xs.set_global_mesh): every thread's
        return found
    mine = current_mesh_of("xla")
    return found if mine is None else to_xla_mesh(mine)


def _follow_threads() -> None:
    """Installs ``thread_global_mesh`` as torch_xla's ``get_global_mesh`` (once)."""
    if _GlobalMesh.original is None:
        _GlobalMesh.original = replace_get_global_mesh(thread_global_mesh)


@functools.lru_cache(maxsize=4096)
def op_sharding(mesh: Mesh, axes: DimAxes) -> Any:
    """The ``OpSharding`` of the per-dimension ``axes`` on ``mesh`` (cached)."""
    spec = tuple(None if not a else (a[0] if len(a) == 1 else a) for a in axes)
    return to_xla_mesh(mesh).get_op_sharding(spec)


class XlaMeshes:
    """torch_xla's meshes: ``xs.Mesh`` objects and the process's global mesh, which each
    thread reads as its own (``thread_global_mesh``)."""

    process_wide = True  # xs.set_global_mesh: one mesh for every thread

    def from_native(self, native: Any) -> Mesh:
        return mesh_from_xla(native)

    def native(self, mesh: Mesh) -> Any:
        return to_xla_mesh(mesh)

    def create(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        return Mesh(grid, axis_names, backend="xla")

    def make_current(self, mesh: Mesh | None) -> None:
        native = None if mesh is None else to_xla_mesh(mesh)
        with _GlobalMesh.lock:
            _follow_threads()
            _GlobalMesh.set_by_us = native
            xs().set_global_mesh(native)
