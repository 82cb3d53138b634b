"""Building meshes: ``create_device_mesh``, ``infer_mesh_shape`` and ``HybridMeshShape``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchshard._backend.registry import default_name, lookup
from torchshard._mesh.context import current_topology
from torchshard._mesh.mesh import Mesh

MeshShape = Sequence[int]


@dataclasses.dataclass(frozen=True)
class HybridMeshShape:
    """A mesh shape for hybrid parallelism: ICI (within a host group) times DCN (across).

    The mesh shape is ``ici * dcn`` per axis; the DCN part is split across process groups
    (hosts).

    Example (2 hosts of 4 devices: a ``(4, 2)`` mesh whose first two rows are host 0's):
        >>> from torchshard.testing import virtual_hosts
        >>> shape = torchshard.HybridMeshShape(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1))
        >>> with virtual_hosts(2):
        ...     mesh = torchshard.create_device_mesh(shape, ("data", "model"))
        >>> mesh.devices
        array([[0, 1],
               [2, 3],
               [4, 5],
               [6, 7]])
    """

    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "ici_mesh_shape", _checked_shape(self.ici_mesh_shape, "ici_mesh_shape")
        )
        object.__setattr__(
            self, "dcn_mesh_shape", _checked_shape(self.dcn_mesh_shape, "dcn_mesh_shape")
        )
        if len(self.ici_mesh_shape) != len(self.dcn_mesh_shape):
            raise ValueError(
                f"{self.ici_mesh_shape=} should have the same length as {self.dcn_mesh_shape}."
            )

    def __len__(self) -> int:
        return len(self.ici_mesh_shape)


def _checked_shape(mesh_shape: Any, name: str) -> tuple[int, ...]:
    """``mesh_shape`` as a tuple of ints, each a positive size or ``-1`` (inferred); a clear
    ``TypeError``/``ValueError`` naming ``name`` otherwise (a string would iterate as digits)."""
    if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence | np.ndarray):
        raise TypeError(
            f"{name} must be a sequence of ints (one size per mesh axis, -1 inferred), but got "
            f"{type(mesh_shape).__name__} {mesh_shape!r}. Pass a tuple such as (4, 2) or "
            "(-1, 2)."
        )
    out = []
    for i, n in enumerate(mesh_shape):
        if isinstance(n, bool) or not isinstance(n, int | np.integer):
            raise TypeError(
                f"{name} {tuple(mesh_shape)!r}: axis {i} must be an int, but got "
                f"{type(n).__name__} {n!r}. Pass a tuple of ints such as (4, 2)."
            )
        if n < 1 and n != -1:
            raise ValueError(
                f"{name} {tuple(int(m) for m in mesh_shape)!r}: axis {i} is {int(n)}, but each "
                "axis must be a positive size, or -1 for the one axis inferred from the device "
                "count. Use sizes >= 1 (e.g. (2, 4)) or -1 (e.g. (-1, 4))."
            )
        out.append(int(n))
    return tuple(out)


def infer_mesh_shape(mesh_shape: MeshShape, *, num_devices: int | None = None) -> tuple[int, ...]:
    """``mesh_shape`` with its (at most one) ``-1`` inferred from the device count (axlearn
    compatibility: ``create_device_mesh`` infers it itself).

    Example:
        >>> torchshard.infer_mesh_shape((-1, 2), num_devices=8)
        (4, 2)
    """
    mesh_shape = _checked_shape(mesh_shape, "mesh_shape")
    if -1 not in mesh_shape:
        return mesh_shape
    if mesh_shape.count(-1) > 1:
        raise ValueError(f"Only one axis can be -1 in {mesh_shape=}.")
    prod = math.prod(mesh_shape, start=-1)
    if num_devices is None:
        num_devices = _device_count()
    if prod <= 0 or num_devices % prod != 0:
        raise ValueError(
            f"Unable to infer -1 in mesh shape {mesh_shape} as num_devices {num_devices} "
            f"is not a multiple of the product {prod} of mesh axes."
        )
    return tuple(x if x != -1 else num_devices // prod for x in mesh_shape)


def _device_count() -> int:
    return current_topology().device_count


def create_device_mesh(
    mesh_shape: MeshShape | HybridMeshShape,
    axis_names: Sequence[str],
    *,
    devices: Sequence[int] | np.ndarray | None = None,
    backend: str | None = None,
) -> Mesh:
    """A ``Mesh`` of ``mesh_shape`` over ``devices`` (default: every device of the run).

    A plain shape reshapes the device ids in order (at most one ``-1`` is inferred). On
    several hosts it is split as axlearn splits it: its first axis that is not 1 goes over the
    hosts (it must be a multiple of the host count, else ``ValueError``), so that each host's
    devices form one block of the mesh, i.e. the ``HybridMeshShape`` with that axis divided by
    the host count and a DCN shape of the host count on that axis. (With one device per
    process, as on the DTensor backend, the ids are reshaped as given.) A ``HybridMeshShape``
    groups the devices by owning process (the DCN granule), lays each group out as
    ``ici_mesh_shape`` and tiles the groups as ``dcn_mesh_shape``; both work on the CPU,
    including under ``torchshard.testing.virtual_hosts``.

    ``backend``: ``"xla"`` (torch_xla SPMD), ``"dtensor"`` or ``"torchax"`` (PyTorch on JAX);
    by default the process's (``torchshard.Mesh``'s default): torch_xla when it is imported,
    else DTensor once torch.distributed's default process group exists, else torchax when it
    is imported, else torch_xla when it is installed, else DTensor. With DTensor the devices
    are the ranks of the default process group (one device per process) and the mesh carries a
    ``DeviceMesh`` built with ``init_device_mesh`` (every rank must call this, as for any
    DeviceMesh). With torchax the devices are JAX's (``jax.devices()`` by process, then id:
    every JAX process's devices, after ``jax.distributed.initialize``), and ``mesh.jax_mesh``
    is a ``jax.sharding.Mesh`` with ``Auto`` axes.

    Example:
        >>> mesh = torchshard.create_device_mesh((-1, 2), ("data", "model"))
        >>> mesh
        Mesh({'data': 4, 'model': 2})
        >>> mesh.devices
        array([[0, 1],
               [2, 3],
               [4, 5],
               [6, 7]])

    Example (on each of 4 processes, after ``torch.distributed.init_process_group("gloo")``;
    without torch_xla ``backend="dtensor"`` is the default)::

        mesh = torchshard.create_device_mesh((2, 2), ("data", "model"), backend="dtensor")
        mesh.devices.tolist()  # [[0, 1], [2, 3]]: the ranks
        mesh.native  # DeviceMesh((data=2, model=2), device: 'cpu', stride: (2, 1))
    """
    if not isinstance(mesh_shape, HybridMeshShape):
        mesh_shape = _checked_shape(mesh_shape, "create_device_mesh: mesh_shape")
    ndim = len(mesh_shape)
    names_ = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if len(names_) != ndim:
        raise ValueError(
            f"create_device_mesh: mesh_shape has {ndim} axes ({_shown(mesh_shape)}), but "
            f"axis_names has {len(names_)} ({names_!r}); give one name per axis, e.g. "
            f"create_device_mesh({_shown(mesh_shape)}, {_names_for(names_, ndim)!r}) or "
            f"create_device_mesh({_shape_for(len(names_))}, {names_!r})."
        )
    if backend is None:
        backend = default_name()
    runtime = lookup(backend)
    # The named backend's devices (or their emulation), whatever the default backend is.
    topology = current_topology(backend=backend)
    ids = (
        np.arange(topology.device_count)
        if devices is None
        else np.asarray(devices, dtype=np.int64).reshape(-1)
    )
    if isinstance(mesh_shape, HybridMeshShape):
        grid = _hybrid(mesh_shape, ids, topology.device_process)
    else:
        shape = infer_mesh_shape(mesh_shape, num_devices=ids.size)
        if math.prod(shape) != ids.size:
            raise ValueError(_count_mismatch(shape, ids.size, backend, given=devices is not None))
        grid = _split_over_hosts(shape, ids, topology.device_process)
    return Mesh.of(runtime.meshes.create(np.asarray(grid, dtype=np.int64), names_))


def _shown(mesh_shape: Any) -> str:
    if isinstance(mesh_shape, HybridMeshShape):
        return f"ici {mesh_shape.ici_mesh_shape}, dcn {mesh_shape.dcn_mesh_shape}"
    return str(tuple(mesh_shape))


def _shape_for(n: int) -> tuple[int, ...]:
    """A shape with ``n`` axes that fits any device count: ``(-1, 1, ...)``."""
    return (-1, *([1] * (n - 1))) if n else ()


def _names_for(names: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    """``names`` cut or extended to ``n`` distinct names."""
    extra = [f for f in ("data", "model", "expert", "seq", "fsdp") if f not in names]
    extra += [f"axis{i}" for i in range(n)]
    return (names + tuple(extra))[:n]


def _count_mismatch(shape: tuple[int, ...], count: int, backend: str, *, given: bool) -> str:
    """The error of a mesh shape whose device count is not the run's (or ``devices=``'s)."""
    need = math.prod(shape)
    head = f"create_device_mesh: mesh shape {shape} has {need} devices"
    if given:
        return (
            f"{head}, but devices= gives {count}; a mesh covers exactly the devices given: pass "
            f"{need} device ids, or a shape with -1 (e.g. {(-1, *shape[1:])}) to fit {count}."
        )
    if backend == "xla":
        fix = (
            f"On a CPU, emulate {need} devices: call torchshard.setup_cpu_emulation({need}) "
            f"before torch_xla starts (or run with PJRT_DEVICE=CPU CPU_NUM_DEVICES={need}); on "
            "a TPU, use a shape of this host's devices"
        )
        where = f"torch_xla's runtime has {count} device{'s' if count != 1 else ''}"
    elif backend == "torchax":
        fix = (
            f"On a CPU, have JAX make {need} devices: set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} before JAX is imported (over "
            "several JAX processes, each process's share); on a TPU, use a shape of the job's "
            "devices"
        )
        where = f"JAX has {count} device{'s' if count != 1 else ''}"
    else:
        fix = (
            f"Start {need} processes (e.g. torchrun --nproc-per-node {need} train.py; the "
            "dtensor backend has one device per process)"
        )
        ranks = f"{count} rank{'s' if count != 1 else ''}"
        where = f"torch.distributed's default process group has {ranks}"
    return (
        f"{head}, but {where}; a mesh covers every device of the run. {fix}, or a shape with -1 "
        f"(e.g. {(-1, *shape[1:])}) to fit any count."
    )


def _granules(ids: np.ndarray, device_process: Sequence[int]) -> list[list[int]]:
    """The given device ids grouped by owning process (in process order), each group in the
    order given; ``ValueError`` when the processes own different numbers of them."""
    groups: dict[int, list[int]] = {}
    for d in ids.tolist():
        groups.setdefault(device_process[d], []).append(d)
    granules = [groups[k] for k in sorted(groups)]
    counts = {k: len(groups[k]) for k in sorted(groups)}
    if len(set(counts.values())) > 1:
        raise ValueError(
            "create_device_mesh: a mesh over several hosts gives every host the same block, so "
            "each host must own the same number of the mesh's devices, but the hosts own "
            f"{counts} (host: devices; the devices by host: {groups}). Pass devices= with the "
            "same number of devices from each host."
        )
    return granules


def _split_over_hosts(
    shape: tuple[int, ...], ids: np.ndarray, device_process: Sequence[int]
) -> Any:
    """The grid of a plain ``shape``: on several hosts (each owning several of the devices),
    axlearn's rule: the first axis that is not 1 is split over the hosts (the DCN part), the
    rest is each host's own (ICI) layout; else ``ids`` reshaped in order."""
    granules = _granules(ids, device_process)
    hosts = len(granules)
    if hosts == 1 or len(granules[0]) == 1:
        return ids.reshape(shape)
    axis = next(i for i, n in enumerate(shape) if n != 1)  # prod(shape) == ids.size > 1
    if shape[axis] % hosts:
        raise ValueError(
            f"create_device_mesh: mesh shape {shape} on {hosts} hosts: the first non-singleton "
            f"mesh axis {axis} has size {shape[axis]}, which must be divisible by the number of "
            f"slices/granules (hosts) {hosts}: that axis is split over the hosts so that each "
            f"host's {len(granules[0])} devices form one block of the mesh. Make axis {axis} a "
            f"multiple of {hosts} (e.g. put the axis that spans hosts first), or lay the hosts "
            "out yourself with a HybridMeshShape."
        )
    ici = (*shape[:axis], shape[axis] // hosts, *shape[axis + 1 :])
    dcn = (1,) * axis + (hosts,) + (1,) * (len(shape) - axis - 1)
    return _hybrid(HybridMeshShape(ici, dcn), ids, device_process, granules)


def _hybrid(
    shape: HybridMeshShape,
    ids: np.ndarray,
    device_process: Sequence[int],
    granules: list[list[int]] | None = None,
) -> Any:
    if granules is None:
        granules = _granules(ids, device_process)
    per = len(granules[0])
    dcn = infer_mesh_shape(shape.dcn_mesh_shape, num_devices=len(granules))
    ici = infer_mesh_shape(shape.ici_mesh_shape, num_devices=per)
    if math.prod(dcn) != len(granules):
        raise ValueError(
            f"Number of slices/granules {len(granules)} must equal the product of "
            f"dcn_mesh_shape {dcn}, but that product is {math.prod(dcn)}: the DCN mesh tiles "
            f"the hosts, and {len(granules)} hosts own the mesh's devices ({per} each). Use a "
            f"dcn_mesh_shape whose product is {len(granules)} (-1 infers one axis)."
        )
    if math.prod(ici) != per:
        raise ValueError(
            f"Product of ICI mesh {ici} does not match num_devices_per_granule={per}: the ICI "
            f"mesh has {math.prod(ici)} devices, but each of the {len(granules)} hosts owns "
            f"{per} of the mesh's devices. Use an ici_mesh_shape whose product is {per} (-1 "
            "infers one axis)."
        )
    per_granule = [np.asarray(g).reshape(ici) for g in granules]
    grid = np.arange(len(granules)).reshape(dcn)
    blocks = np.empty(dcn, dtype=object)
    for idx in np.ndindex(*dcn):
        blocks[idx] = per_granule[grid[idx]]
    return np.block(blocks.tolist())
