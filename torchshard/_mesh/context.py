"""Entering a mesh, and the topology a call runs on.

``with mesh:`` (``torchshard.Mesh.__enter__``) is ``enter``: the mesh's backend is told first
(torch_xla sets its global mesh; DTensor builds the mesh's ``DeviceMesh``, a collective, on
the program's thread), then the mesh becomes this thread's current mesh in the core's context
(``torchshard._core.context``). ``exit`` restores the outer mesh, in the core and in the
backend. ``current_topology`` is the topology of a mesh, of a named backend or of the
process's default backend: an installed emulation's (``virtual_hosts``), else the runtime's.
"""

from __future__ import annotations

from torchshard._backend.registry import default_name, lookup
from torchshard._core.context import current_mesh, pop, push
from torchshard._core.mesh import Mesh, topology_of
from torchshard._core.topology import Topology, emulated


def enter(mesh: Mesh) -> None:
    """Makes ``mesh`` current: in its backend, then in this thread's context."""
    lookup(mesh).meshes.make_current(mesh)
    push(mesh)


def exit(mesh: Mesh) -> None:
    """Leaves ``mesh`` (this thread's current mesh): the outer mesh is current again, in this
    thread's context and in ``mesh``'s backend (which has no current mesh when the outer one
    is of another backend, or there is none)."""
    outer = pop(mesh)
    same = outer if outer is not None and outer.backend == mesh.backend else None
    lookup(mesh).meshes.make_current(same)


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
