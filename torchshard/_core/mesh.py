"""``Mesh``: an immutable, named grid of device ids, and the thread-local mesh context.

``with mesh:`` makes a mesh the current mesh of the calling thread (nested contexts restore the
outer one) and tells the mesh's backend (torch_xla: its global mesh) through the runtime slot
(``torchshard._core.runtime``), which the backend registry fills. Pure numpy: no backend is
imported here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any

import numpy as np

from torchshard._core import runtime
from torchshard._core.errors import NoMeshError


class _MeshStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[Mesh] = []


_STATE = _MeshStack()


class Mesh:
    """A named N-D grid of device ids; the shape of the grid is the mesh shape.

    Args:
        devices: integer array-like of device ids; its shape is the mesh shape. Every id
            appears once. The mesh must cover every device of the runtime (checked when the
            mesh is entered or used).
        axis_names: one distinct name per dimension of ``devices``.
        backend: ``"xla"`` (torch_xla SPMD, the default) or ``"dtensor"``.

    On the ``"dtensor"`` backend, entering a mesh built by hand (``with mesh:``) builds its
    ``DeviceMesh`` the first time, which is collective: every process must enter it. A process
    that enters it alone fails with ``CollectiveError`` after the default process group's
    timeout (``init_process_group(timeout=...)``), naming the ranks that did not come.

    Example:
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> dict(mesh.shape), mesh.size
        ({'data': 4, 'model': 2}, 8)
        >>> with mesh:
        ...     assert torchshard.current_mesh() is mesh
        >>> torchshard.current_mesh() is None
        True

    The device grid of that mesh (rows: ``data``, columns: ``model``)::

        0 1
        2 3
        4 5
        6 7
    """

    __slots__ = ("__weakref__", "_axis_names", "_backend", "_devices", "_hash", "_native", "_shape")

    def __init__(
        self,
        devices: Any,
        axis_names: Sequence[str] | str,
        *,
        backend: str = "xla",
        native: Any = None,
    ) -> None:
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        axis_names = tuple(axis_names)
        arr = np.asarray(devices)
        if arr.dtype == object or not (
            np.issubdtype(arr.dtype, np.integer) or (arr.size == 0 and arr.dtype == np.float64)
        ):
            raise TypeError(
                f"Mesh requires `devices` to be an integer array of device ids, but got dtype "
                f"{arr.dtype} ({devices!r})."
            )
        if arr.ndim != len(axis_names):
            raise ValueError(
                "Mesh requires the ndim of `devices` to equal the length of `axis_names`, but "
                f"got devices.ndim == {arr.ndim} (shape {arr.shape}) and "
                f"len(axis_names) == {len(axis_names)} ({axis_names!r})."
            )
        if arr.size == 0:
            raise ValueError(f"Mesh requires at least one device, but got shape {arr.shape}.")
        for name in axis_names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"Mesh axis names must be non-empty str, but got {name!r}.")
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"Mesh axis names must be distinct, but got {axis_names!r}.")
        flat = arr.reshape(-1).astype(np.int64)
        if (flat < 0).any():
            raise ValueError(f"Mesh device ids must be >= 0, but got {flat.tolist()}.")
        uniq, counts = np.unique(flat, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"Mesh device ids must be distinct, but {uniq[counts > 1].tolist()} appear more "
                "than once."
            )
        _check_backend_name(backend)
        devs = arr.astype(np.int64)
        devs.setflags(write=False)
        self._devices = devs
        self._axis_names = axis_names
        self._shape = MappingProxyType(dict(zip(axis_names, devs.shape, strict=True)))
        self._backend = backend
        self._native = native
        self._hash = hash((self._axis_names, devs.shape, devs.tobytes(), backend))

    # -- value semantics -------------------------------------------------------------------
    @property
    def devices(self) -> np.ndarray:
        """The (read-only) int64 array of device ids, of shape ``tuple(shape.values())``."""
        return self._devices

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, major to minor."""
        return self._axis_names

    @property
    def shape(self) -> Mapping[str, int]:
        """Ordered mapping axis name -> size."""
        return self._shape

    @property
    def size(self) -> int:
        """The number of devices."""
        return int(self._devices.size)

    @property
    def device_ids(self) -> tuple[int, ...]:
        """The device ids, flattened row-major."""
        return tuple(int(d) for d in self._devices.reshape(-1))

    @property
    def backend(self) -> str:
        """The name of the backend that places arrays on this mesh (``"xla"``/``"dtensor"``)."""
        return self._backend

    @property
    def native(self) -> Any:
        """The backend's own mesh object this mesh was made from, if any."""
        return self._native

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self._axis_names == other._axis_names
            and self._backend == other._backend
            and np.array_equal(self._devices, other._devices)
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        shape = ", ".join(f"{k!r}: {v}" for k, v in self._shape.items())
        ids = self.device_ids
        ordered = "" if ids == tuple(range(len(ids))) else f", devices={list(ids)}"
        return f"Mesh({{{shape}}}{ordered})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._devices.tolist(), self._axis_names, self._backend))

    # -- context -----------------------------------------------------------------------
    def __enter__(self) -> Mesh:
        if runtime.installed():
            runtime.runtime(self._backend).activate(self)
        _STATE.stack.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _STATE.stack
        if not stack or stack[-1] is not self:
            raise RuntimeError(
                f"Mesh contexts exited out of order: leaving {self!r}, but the current mesh is "
                f"{stack[-1] if stack else None!r}."
            )
        stack.pop()
        outer = stack[-1] if stack else None
        if runtime.installed():
            runtime.runtime(self._backend).deactivate(self, outer)

    # -- the runtimes' own meshes (through the runtime slot) -------------------------------
    @classmethod
    def from_xla(cls, xla_mesh: Any) -> Mesh:
        """The ``Mesh`` of a ``torch_xla.distributed.spmd.Mesh`` (which must have axis names)."""
        return runtime.runtime("xla").mesh_from_native(xla_mesh)

    @property
    def xla_mesh(self) -> Any:
        """This mesh as a ``torch_xla.distributed.spmd.Mesh`` (cached)."""
        return runtime.runtime("xla").native_mesh(self)

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> Mesh:
        """The ``Mesh`` of a ``torch.distributed.DeviceMesh``: arrays placed on it are DTensors.

        Device ids are the DeviceMesh's ranks (one device per process), axis names its
        ``mesh_dim_names`` (required), and ``mesh.native`` is the DeviceMesh itself. Along every
        axis the ranks must ascend (torch 2.9's DeviceMesh collectives assume it).

        Example (on each of 4 processes, after ``init_process_group("gloo")``; ``dist`` is
        ``torch.distributed``)::

            dm = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
            mesh = torchshard.Mesh.from_device_mesh(dm)
            assert mesh.backend == "dtensor" and mesh.native is dm
            assert dict(mesh.shape) == {"data": 2, "model": 2}
        """
        return runtime.runtime("dtensor").mesh_from_native(device_mesh)


def _check_backend_name(backend: Any) -> None:
    names = runtime.backend_names()
    if names is None:  # no registry installed (the core alone): any name, checked on use
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"Mesh backend must be a backend name, but got {backend!r}.")
        return
    if backend not in names:
        quoted = [repr(n) for n in names]
        listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        raise ValueError(f"Mesh backend must be {listed}, but got {backend!r}.")


def _rebuild(devices: list[Any], axis_names: tuple[str, ...], backend: str) -> Mesh:
    return Mesh(np.asarray(devices, dtype=np.int64), axis_names, backend=backend)


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


@contextlib.contextmanager
def thread_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Makes ``mesh`` current in this thread without activating it in its backend.

    For helper threads (a loader's prefetch thread) working for a thread that owns the mesh
    context. The backend's state is process-wide (torch_xla has one global mesh), so
    ``with mesh:`` in a helper thread would reset it to ``None`` when the helper exits, under
    the feet of the thread that entered the mesh.
    """
    stack = _STATE.stack
    stack.append(mesh)
    try:
        yield mesh
    finally:
        if not stack or stack[-1] is not mesh:
            raise RuntimeError(
                f"Mesh contexts exited out of order: leaving {mesh!r}, but the current mesh is "
                f"{stack[-1] if stack else None!r}."
            )
        stack.pop()
