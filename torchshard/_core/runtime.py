"""The slot through which the pure core reaches a runtime backend.

The core never imports a backend: ``torchshard._backend`` installs its registry here when it
is imported (``install``), and ``Mesh.__enter__``/``__exit__``, ``Mesh.from_xla``/``xla_mesh``/
``from_device_mesh`` and ``current_topology`` ask through it. Until a registry is installed
(only the core imported, as in the layering test), meshes enter and leave without telling any
runtime, and a question only a runtime can answer raises ``RuntimeError``. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torchshard._core.mesh import Mesh
    from torchshard._core.topology import Topology


class Runtime(Protocol):
    """What the core asks of a backend (the full protocol is ``torchshard._backend.Backend``)."""

    name: str

    def topology(self) -> Topology:
        """The devices of the run, their owning processes, and this process's index."""
        ...

    def activate(self, mesh: Mesh) -> None:
        """Called when ``mesh`` becomes the current mesh of a thread (``with mesh:``)."""
        ...

    def deactivate(self, mesh: Mesh, outer: Mesh | None) -> None:
        """Called when ``mesh``'s context exits; ``outer`` is the mesh that is current again."""
        ...

    def mesh_from_native(self, native: Any) -> Mesh:
        """The ``Mesh`` of the runtime's own mesh object (``xs.Mesh``, ``DeviceMesh``)."""
        ...

    def native_mesh(self, mesh: Mesh) -> Any:
        """``mesh`` as the runtime's own mesh object."""
        ...


class _Slot:
    """The installed registry: ``resolve(name)`` (``None``: the process's default backend)
    and ``names()`` (the backends a mesh may name)."""

    def __init__(self) -> None:
        self.resolve: Callable[[str | None], Runtime] | None = None
        self.names: Callable[[], Sequence[str]] | None = None


_SLOT = _Slot()


def install(
    resolve: Callable[[str | None], Runtime], names: Callable[[], Sequence[str]]
) -> None:
    """Installs the backend registry (called once, by ``torchshard._backend``)."""
    _SLOT.resolve = resolve
    _SLOT.names = names


def installed() -> bool:
    """Whether a backend registry is installed."""
    return _SLOT.resolve is not None


def runtime(name: str | None = None) -> Runtime:
    """The backend called ``name`` (``None``: the process's default backend)."""
    resolve = _SLOT.resolve
    if resolve is not None:
        return resolve(name)
    raise RuntimeError(
        "no runtime backend is installed: torchshard's pure core was imported without "
        "torchshard._backend. Import torchshard (which installs the backend registry)."
    )


def backend_names() -> tuple[str, ...] | None:
    """The backend names a mesh may name, or ``None`` when no registry is installed (any
    non-empty name is then accepted, and checked when the mesh is used)."""
    names = _SLOT.names
    return None if names is None else tuple(names())
