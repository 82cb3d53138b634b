"""``Mesh``: the value of a named grid of device ids (immutable, validated when built).

This is the value only: no context and no runtime. The mesh users hold, ``torchshard.Mesh``
(``torchshard._mesh.mesh``), is this value bound to its backend: it enters as a context
(``with mesh:``) and converts to and from the runtimes' own meshes. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from torchshard._core.topology import Topology, emulated


class Mesh:
    """The value of a named N-D grid of device ids; the shape of the grid is the mesh shape.

    Validated when built, immutable, equal by value (axis names, device grid, backend name).
    The public ``torchshard.Mesh`` is this value bound to its backend (see its docstring for
    the arguments); the core computes with either.
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
        return tuple(self._devices.reshape(-1).tolist())

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
        flat = self._devices.reshape(-1)  # numpy: a pod's mesh is 16,384 ids
        ordered = "" if np.array_equal(flat, np.arange(flat.size)) else f", devices={flat.tolist()}"
        return f"Mesh({{{shape}}}{ordered})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._devices.tolist(), self._axis_names, self._backend))

    # -- the runtime (a bound mesh, ``torchshard.Mesh``, answers) --------------------------
    def _runtime_topology(self) -> Topology:
        """The topology of this mesh's runtime: which process owns which device."""
        raise RuntimeError(
            f"{self!r} is a bare mesh value (torchshard._core.mesh.Mesh), bound to no runtime, "
            "so it cannot say which process owns which device. Use torchshard.Mesh, or pass "
            "device_process= (and process_index=) explicitly."
        )


def _check_backend_name(backend: Any) -> None:
    # Which names a runtime serves is the registry's to say (torchshard.Mesh checks them).
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"Mesh backend must be a backend name, but got {backend!r}.")


def _rebuild(
    cls: type[Mesh], devices: list[Any], axis_names: tuple[str, ...], backend: str
) -> Mesh:
    return cls(np.asarray(devices, dtype=np.int64), axis_names, backend=backend)


def topology_of(mesh: Mesh) -> Topology:
    """The topology of ``mesh``: an installed emulation's for its backend (``virtual_hosts``),
    else its runtime's (``Mesh._runtime_topology``, which a bound mesh answers)."""
    found = emulated(mesh.backend)
    return found if found is not None else mesh._runtime_topology()
