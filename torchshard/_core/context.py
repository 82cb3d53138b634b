"""The mesh context: which mesh is current in this thread (pure; no runtime is told here).

A stack of ``Mesh`` values per thread, innermost last. ``torchshard._mesh.context`` enters a
mesh (``with mesh:``): it tells the mesh's backend, then pushes the mesh here; helper threads
working for the thread that owns the context push it with ``thread_mesh``, which tells no
backend. Reading the current mesh is all the core and the layers above need.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torchshard._core.errors import NoMeshError
from torchshard._core.mesh import Mesh


class _MeshStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[Mesh] = []


_STATE = _MeshStack()


def current_mesh() -> Mesh | None:
    """The innermost mesh entered with ``with mesh:`` in this thread, or ``None``."""
    stack = _STATE.stack
    return stack[-1] if stack else None


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
    """Makes ``mesh`` this thread's current mesh (the outer one is restored by ``pop``)."""
    _STATE.stack.append(mesh)


def pop(mesh: Mesh) -> Mesh | None:
    """Leaves ``mesh``, which must be this thread's current mesh; returns the mesh that is
    current again (``None``: none). ``RuntimeError`` when contexts exit out of order."""
    stack = _STATE.stack
    if not stack or stack[-1] is not mesh:
        raise RuntimeError(
            f"Mesh contexts exited out of order: leaving {mesh!r}, but the current mesh is "
            f"{stack[-1] if stack else None!r}."
        )
    stack.pop()
    return stack[-1] if stack else None


@contextlib.contextmanager
def thread_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Makes ``mesh`` current in this thread without telling its backend.

    For helper threads (a loader's prefetch thread) working for a thread that owns the mesh
    context. The backend's state is process-wide (torch_xla has one global mesh), so
    ``with mesh:`` in a helper thread would reset it to ``None`` when the helper exits, under
    the feet of the thread that entered the mesh.
    """
    push(mesh)
    try:
        yield mesh
    finally:
        pop(mesh)
