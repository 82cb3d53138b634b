"""The mesh context: which mesh is current in this task or thread (pure; no runtime is told).

A stack of ``Mesh`` values per execution context, innermost last, held in a ``ContextVar``:
each thread starts with its own (empty) stack, and each asyncio task has its own, copied from
the code that created it, so two tasks that interleave ``with mesh:`` on one thread never see
each other's mesh. ``torchshard._mesh.context`` enters a mesh (``with mesh:``): it tells the
mesh's backend, then pushes the mesh here; helper threads working for the thread that owns the
context push it with ``thread_mesh``, which tells no backend. Reading the current mesh is all
the core and the layers above need.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from torchshard._core.errors import NoMeshError
from torchshard._core.mesh import Mesh
from torchshard._core.topology import Provider, installed

# An immutable tuple per context: a task that copies its creator's context shares nothing it
# could mutate with it.
_STACK: contextvars.ContextVar[tuple[Mesh, ...]] = contextvars.ContextVar(
    "torchshard_mesh_stack", default=()
)


def current_mesh() -> Mesh | None:
    """The innermost mesh entered with ``with mesh:`` in this task or thread, or ``None``."""
    stack = _STACK.get()
    return stack[-1] if stack else None


def current_mesh_of(backend: str) -> Mesh | None:
    """The innermost mesh of the backend called ``backend`` current in this task or thread
    (entered, or lent with ``thread_mesh``), or ``None``."""
    for mesh in reversed(_STACK.get()):
        if mesh.backend == backend:
            return mesh
    return None


def require_mesh(caller: str) -> Mesh:
    """The current mesh; raises ``NoMeshError`` naming ``caller`` when there is none."""
    mesh = current_mesh()
    if mesh is None:
        raise NoMeshError(
            f"{caller} must be called inside `with mesh:`, but there is no current mesh in this "
            "thread. Create one with torchshard.create_device_mesh(...) and enter it."
        )
    return mesh


def push(mesh: Mesh) -> None:
    """Makes ``mesh`` the current mesh of this task or thread (the outer one is restored by
    ``pop``)."""
    _STACK.set((*_STACK.get(), mesh))


def pop(mesh: Mesh) -> Mesh | None:
    """Leaves ``mesh``, which must be the current mesh of this task or thread; returns the mesh
    that is current again (``None``: none). ``RuntimeError`` when contexts exit out of order."""
    stack = _STACK.get()
    if not stack or stack[-1] is not mesh:
        raise RuntimeError(
            f"Mesh contexts exited out of order: leaving {mesh!r}, but the current mesh is "
            f"{stack[-1] if stack else None!r}."
        )
    _STACK.set(stack[:-1])
    return stack[-2] if len(stack) > 1 else None


@contextlib.contextmanager
def thread_mesh(mesh: Mesh, *, providers: tuple[Provider, ...] | None = None) -> Iterator[Mesh]:
    """Makes ``mesh`` current in this thread without telling its backend.

    For helper threads (a loader's prefetch thread) working for a thread that owns the mesh
    context. The backend's state is process-wide (torch_xla has one global mesh), so
    ``with mesh:`` in a helper thread would reset it to ``None`` when the helper exits, under
    the feet of the thread that entered the mesh. ``providers``: the topology providers of the
    thread it works for (``topology.providers()``, taken there: its ``virtual_hosts``),
    installed for the block; ``None`` keeps this thread's own.
    """
    with contextlib.ExitStack() as stack:
        if providers is not None:
            stack.enter_context(installed(providers))
        push(mesh)
        try:
            yield mesh
        finally:
            pop(mesh)
