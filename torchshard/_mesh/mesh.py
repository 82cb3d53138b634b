"""``torchshard.Mesh``: the core's mesh value bound to its backend.

The value (device grid, axis names, backend name; ``torchshard._core.mesh``) knows no runtime.
This class adds what needs one: entering it as a context (``with mesh:``, through
``torchshard._mesh.context``), the topology its backend reports, and conversions to and from
the runtimes' own meshes, each implemented by its backend (``Backend.meshes``).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from torchshard._backend.registry import default_name, lookup, names
from torchshard._core import mesh as value
from torchshard._core.topology import Topology
from torchshard._mesh import context


class Mesh(value.Mesh):
    """A named N-D grid of device ids; the shape of the grid is the mesh shape.

    Args:
        devices: integer array-like of device ids; its shape is the mesh shape. Every id
            appears once. The mesh must cover every device of the runtime (checked when the
            mesh is entered or used).
        axis_names: one distinct name per dimension of ``devices``.
        backend: ``"xla"`` (torch_xla SPMD), ``"dtensor"`` or ``"torchax"`` (PyTorch on
            JAX). Default: the process's backend: torch_xla when it is imported, else DTensor
            once torch.distributed's default process group exists, else torchax when it is
            imported, else torch_xla when it is installed, else DTensor (a plain install needs
            no torch_xla).

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

    __slots__ = ()

    def __init__(
        self,
        devices: Any,
        axis_names: Any,
        *,
        backend: str | None = None,
        native: Any = None,
    ) -> None:
        if backend is None:
            backend = default_name()
        super().__init__(devices, axis_names, backend=backend, native=native)
        known = names()
        if backend not in known:
            quoted = [repr(n) for n in known]
            listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
            raise ValueError(f"Mesh backend must be {listed}, but got {backend!r}.")

    @classmethod
    def of(cls, mesh: value.Mesh) -> Mesh:
        """``mesh`` bound to its backend (itself when it is one already)."""
        if isinstance(mesh, cls):
            return mesh
        return cls(mesh.devices, mesh.axis_names, backend=mesh.backend, native=mesh.native)

    # -- context -----------------------------------------------------------------------
    def __enter__(self) -> Mesh:
        context.enter(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        context.exit(self)

    # -- the runtime -------------------------------------------------------------------
    def _runtime_topology(self) -> Topology:
        return lookup(self).place.topology()

    @classmethod
    def from_xla(cls, xla_mesh: Any) -> Mesh:
        """The ``Mesh`` of a ``torch_xla.distributed.spmd.Mesh`` (which must have axis names)."""
        return cls.of(lookup("xla").meshes.from_native(xla_mesh))

    @property
    def xla_mesh(self) -> Any:
        """This mesh as a ``torch_xla.distributed.spmd.Mesh`` (cached)."""
        return lookup("xla").meshes.native(self)

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
        return cls.of(lookup("dtensor").meshes.from_native(device_mesh))

    @classmethod
    def from_jax(cls, jax_mesh: Any) -> Mesh:
        """The ``Mesh`` of a ``jax.sharding.Mesh`` (every axis ``Auto``): arrays placed on it
        are torchax tensors (``backend="torchax"``), and ``mesh.native`` is the JAX mesh.

        Device ids are torchshard's: ``jax.devices()`` ordered by process, then JAX's id (JAX
        numbers process 1's CPU devices from 2048). ``jax.make_mesh`` makes ``Explicit`` axes
        since JAX 0.9, on which torchax cannot shard: pass ``axis_types=(AxisType.Auto,) * n``.

        Example (8 CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)::

            from jax.sharding import AxisType
            jm = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
            mesh = torchshard.Mesh.from_jax(jm)
            assert mesh.backend == "torchax" and mesh.native is jm
        """
        return cls.of(lookup("torchax").meshes.from_native(jax_mesh))

    @property
    def jax_mesh(self) -> Any:
        """This mesh as a ``jax.sharding.Mesh`` with ``Auto`` axes (cached)."""
        return lookup("torchax").meshes.native(self)
