"""Entering a mesh, and the topology a call runs on.

``with mesh:`` (``torchshard.Mesh.__enter__``) is ``enter``: the mesh's backend is told first
(torch_xla sets its global mesh; DTensor builds the mesh's ``DeviceMesh``, a collective, on
the program's thread), then the mesh becomes the current mesh of this task or thread in the
core's context (``torchshard._core.context``, a ``ContextVar``). ``exit`` restores the outer
mesh in the core's context, and judges the last call's deferred agreement check (DTensor).

What torchshard guarantees: its own calls use the mesh of the task or thread that makes them
(asyncio tasks that interleave ``with mesh:`` on one thread each see their own), and so do
the runtime calls they make (they pass the mesh). A runtime's own current mesh may be
process-wide (torch_xla's global mesh, ``Meshes.process_wide``): it is then the innermost mesh
of the entry made last among the entries still open in the process, and leaving one restores
it to the entry made last among those still open (not to ``None`` while another thread is
inside a mesh). torch_xla's calls that read it when given no mesh read it through
``xs.get_global_mesh()``, which torchshard makes per task or thread: each sees its own
innermost mesh (``_backend/xla/mesh.py`` says where it cannot follow).

``current_topology`` is the topology of a mesh, of a named backend or of the process's
default backend: an installed emulation's (``virtual_hosts``), else the runtime's.
"""

from __future__ import annotations

import contextvars
import threading

from torchshard._backend.registry import default_name, lookup
from torchshard._core.context import current_mesh, pop, push
from torchshard._core.mesh import Mesh, topology_of
from torchshard._core.topology import Topology, emulated


class _Entry:
    """One open ``with mesh:`` of the process."""

    __slots__ = ("mesh",)

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh


# Per backend: the process's open entries, oldest first (the runtime's current mesh is the
# last one's). This context's own entries, innermost last, are in _MINE.
_OPEN: dict[str, list[_Entry]] = {}
_LOCK = threading.Lock()
_MINE: contextvars.ContextVar[tuple[_Entry, ...]] = contextvars.ContextVar(
    "torchshard_mesh_entries", default=()
)


def enter(mesh: Mesh) -> None:
    """Makes ``mesh`` current: in its backend, then in this task's or thread's context."""
    meshes = lookup(mesh).meshes
    mine = _MINE.get()
    meshes.make_current(mesh)  # DTensor: may be collective, so not under the lock
    entry = _Entry(mesh)
    with _LOCK:
        entries = _OPEN.setdefault(mesh.backend, [])
        entries.append(entry)
        if meshes.process_wide and len(entries) > 1:
            meshes.make_current(mesh)  # another entry may have told the runtime since
    _MINE.set((*mine, entry))
    push(mesh)


def exit(mesh: Mesh) -> None:
    """Leaves ``mesh`` (the current mesh of this task or thread): the outer mesh is current
    again in this context; the backend's current mesh is the innermost mesh of the entry made
    last among those still open in the process (``None`` when there is none)."""
    pop(mesh)  # raises, changing nothing, when contexts exit out of order
    mine = _MINE.get()
    entry = mine[-1] if mine and mine[-1].mesh is mesh else None
    if entry is not None:
        _MINE.set(mine[:-1])
    meshes = lookup(mesh).meshes
    with _LOCK:
        entries = _OPEN.get(mesh.backend, [])
        if entry is not None and entry in entries:
            entries.remove(entry)
        if meshes.process_wide:
            meshes.make_current(entries[-1].mesh if entries else None)
    if not meshes.process_wide:  # a runtime mesh per thread (JAX's): this context's outer one
        outer = [e.mesh for e in _MINE.get() if e.mesh.backend == mesh.backend]
        meshes.make_current(outer[-1] if outer else None)
    checks = lookup(mesh).processes
    if checks is not None:  # the last direct call's check, if deferred, is judged here
        checks.settle(mesh, "on leaving the mesh")


def current_topology(mesh: Mesh | None = None, *, backend: str | None = None) -> Topology:
    """The topology of ``mesh`` (or of the backend called ``backend``; neither: the process's
    default backend): an installed emulation's for that backend, else the backend's own."""
    if mesh is not None:
        return topology_of(mesh)
    name = default_name() if backend is None else backend
    found = emulated(name)
    return found if found is not None else lookup(name).place.topology()


def process_index() -> int:
    """This process's index (the emulated one inside ``virtual_hosts``).

    Asked of the current mesh's backend; outside any mesh, of the process's default backend:
    torch_xla when it is imported, else DTensor once torch.distributed's default process group
    is initialised (the rank), else torch_xla.

    Example:
        >>> torchshard.process_index()   # one host
        0
    """
    return current_topology(current_mesh()).process_index


def process_count() -> int:
    """The number of processes (hosts) of the run (emulated inside ``virtual_hosts``); asked
    of the same backend as ``process_index()``.

    Example:
        >>> torchshard.process_count()   # one host
        1
    """
    return current_topology(current_mesh()).process_count
