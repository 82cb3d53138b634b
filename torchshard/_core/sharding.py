"""``NamedSharding``: which block of a global array each device and each process holds.

Pure index maths on numpy; no XLA call. The rules are torch_xla's (and, for even shapes,
JAX's): a dimension split over axes ``(a, b)`` has ``k = |a| * |b|`` shards; the device at mesh
coordinates ``(.., i_a, .., i_b, ..)`` holds shard ``j = i_a * |b| + i_b``, which is
``[min(j * c, n), min((j + 1) * c, n))`` with ``c = ceil(n / k)`` (so uneven splits leave the
last shards short or empty, exactly as torch_xla pads them).

Processes ("hosts", "feeds") are described per dimension: along dim ``i`` a process holds the
set of shard numbers of its devices. The layout is uniform along ``i`` when every process holds
the same number of shards and the distinct sets partition all shards; the number of distinct
sets is the feed count, and a process's feed index is the rank of its set, ordered by its
first (lowest) shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from torchshard._core.errors import IndivisibleError, NonUniformShardingError, ShardingError, at
from torchshard._core.mesh import Mesh, topology_of
from torchshard._core.spec import UNCONSTRAINED, PartitionSpec, as_partition_spec, spec_entry_axes

DimAxes = tuple[tuple[str, ...], ...]


def dim_axes(
    mesh: Mesh, spec: PartitionSpec, ndim: int | None = None, *, where: str = ""
) -> DimAxes:
    """Per dimension, the mesh axes that split it (``()`` when not split).

    Checks that every axis is in ``mesh`` and that ``spec`` is not longer than ``ndim``; the
    result is padded with ``()`` to ``ndim`` entries (to ``len(spec)`` when ``ndim`` is None).
    """
    if ndim is not None and len(spec) > ndim:
        raise ShardingError(
            at(
                where,
                f"partition spec {spec!r} has {len(spec)} entries but the array has rank "
                f"{ndim}; a spec may not be longer than the rank of the array it shards.",
            )
        )
    out: list[tuple[str, ...]] = []
    for i, entry in enumerate(spec):
        if entry is UNCONSTRAINED:
            raise ShardingError(
                at(
                    where,
                    f"partition spec {spec!r}: entry {i} is UNCONSTRAINED, which only "
                    "maybe_shard accepts; placing data needs a concrete spec.",
                )
            )
        axes = spec_entry_axes(entry)
        for axis in axes:
            if axis not in mesh.shape:
                raise ShardingError(
                    at(
                        where,
                        f"partition spec {spec!r} names mesh axis {axis!r}, which is not an "
                        f"axis of the mesh; expected one of {mesh.axis_names!r}.",
                    )
                )
        out.append(axes)
    if ndim is not None:
        out.extend(() for _ in range(ndim - len(out)))
    return tuple(out)


def shard_counts(mesh: Mesh, axes: DimAxes) -> tuple[int, ...]:
    """The number of shards of each dimension."""
    return tuple(math.prod(mesh.shape[a] for a in dim) for dim in axes)


@functools.lru_cache(maxsize=4096)
def device_shard_numbers(mesh: Mesh, axes: DimAxes) -> Mapping[int, tuple[int, ...]]:
    """For each device id, its shard number along each dimension."""
    names = mesh.axis_names
    sizes = mesh.devices.shape
    coords = np.indices(sizes).reshape(len(sizes), -1)  # [mesh rank, devices]
    flat_ids = mesh.devices.reshape(-1)
    numbers = np.zeros((len(axes), flat_ids.size), dtype=np.int64)
    for i, dim in enumerate(axes):
        for axis in dim:  # major to minor
            k = names.index(axis)
            numbers[i] = numbers[i] * sizes[k] + coords[k]
    return {int(d): tuple(int(x) for x in numbers[:, n]) for n, d in enumerate(flat_ids)}


def shard_range(n: int, k: int, j: int) -> tuple[int, int]:
    """The ``[start, stop)`` of shard ``j`` of ``k`` along a dimension of size ``n``."""
    chunk = -(-n // k) if k else n
    return min(j * chunk, n), min((j + 1) * chunk, n)


def _shard_size(n: int, k: int, j: int) -> int:
    start, stop = shard_range(n, k, j)
    return stop - start


def check_divisible(
    mesh: Mesh, spec: PartitionSpec, axes: DimAxes, shape: Sequence[int], *, where: str = ""
) -> None:
    """Raises ``IndivisibleError`` when a split dimension does not divide by its shard count."""
    for i, (n, k) in enumerate(zip(shape, shard_counts(mesh, axes), strict=True)):
        if k > 1 and n % k:
            raise IndivisibleError(
                at(
                    where,
                    f"dim {i} has size {n}, not divisible by {k} (axes {axes[i]!r} of "
                    f"{spec!r} on mesh {dict(mesh.shape)}); global shape {tuple(shape)}. Pad the "
                    "batch to a multiple, or use torchshard.InputDispatcher to pad and drop the "
                    "padding in the step.",
                )
            )


class _DimFeeds:
    """The per-process view of one dimension (see the module docstring)."""

    __slots__ = ("count", "feed_of", "sets", "uniform")

    def __init__(self, sets: dict[int, tuple[int, ...]], k: int) -> None:
        self.sets = sets  # process -> sorted shard numbers held
        distinct = sorted(set(sets.values()), key=lambda s: s[0])
        sizes = {len(s) for s in distinct}
        covered = sorted(j for s in distinct for j in s)
        self.uniform = len(sizes) == 1 and covered == list(range(k))
        self.count = len(distinct) if self.uniform else None
        rank = {s: r for r, s in enumerate(distinct)}
        self.feed_of = {p: rank[s] for p, s in sets.items()}


@functools.lru_cache(maxsize=4096)
def dim_feeds(mesh: Mesh, axes: DimAxes, device_process: tuple[int, ...]) -> tuple[_DimFeeds, ...]:
    """For each dimension, which shards each process holds, and whether that is uniform."""
    numbers = device_shard_numbers(mesh, axes)
    counts = shard_counts(mesh, axes)
    out = []
    for i, k in enumerate(counts):
        sets: dict[int, set[int]] = {}
        for d, js in numbers.items():
            sets.setdefault(device_process[d], set()).add(js[i])
        out.append(_DimFeeds({p: tuple(sorted(s)) for p, s in sets.items()}, k))
    return tuple(out)


def check_device_process(mesh: Mesh, device_process: Sequence[int]) -> None:
    """The mesh must name exactly the devices of the run (a torch_xla rule)."""
    ids = sorted(mesh.device_ids)
    if ids != list(range(len(device_process))):
        raise ShardingError(
            f"mesh {mesh!r} covers devices {ids}, but the runtime has {len(device_process)} "
            f"devices (ids 0..{len(device_process) - 1}); a mesh must cover every device "
            "exactly once."
        )


class NamedSharding:
    """A mesh and a partition spec: the layout of an array over devices and processes.

    Example (mesh ``(4, 2)``, axes ``data``/``model``, ids ``0..7`` row-major):
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> s = torchshard.NamedSharding(mesh, torchshard.P("data"))
        >>> s.devices_indices_map((8, 3))[3]
        (slice(2, 4, None), slice(0, 3, None))
        >>> s.shard_shape((8, 3))
        (2, 3)

    Row blocks of an ``(8, 3)`` array per device: devices 0,1 hold rows 0:2, devices 2,3 rows
    2:4, devices 4,5 rows 4:6 and devices 6,7 rows 6:8 (replicated over ``model``).
    """

    __slots__ = ("_axes", "_mesh", "_spec")

    def __init__(self, mesh: Mesh, spec: PartitionSpec | Sequence[Any]) -> None:
        self._mesh = mesh
        self._spec = as_partition_spec(spec)
        self._axes = dim_axes(mesh, self._spec)

    @property
    def mesh(self) -> Mesh:
        """The mesh."""
        return self._mesh

    @property
    def spec(self) -> PartitionSpec:
        """The partition spec, as given."""
        return self._spec

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        mine = tuple(a for a in self._axes)
        theirs = tuple(a for a in other._axes)
        strip = lambda t: t[: max((i + 1 for i, a in enumerate(t) if a), default=0)]  # noqa: E731
        return self._mesh == other._mesh and strip(mine) == strip(theirs)

    def __hash__(self) -> int:
        return hash((self._mesh, tuple(a for a in self._axes if a)))

    def __repr__(self) -> str:
        return f"NamedSharding(mesh={self._mesh!r}, spec={self._spec!r})"

    @property
    def is_fully_replicated(self) -> bool:
        """True when no dimension is split."""
        return all(math.prod(self._mesh.shape[a] for a in dim) == 1 for dim in self._axes)

    def _dims(self, ndim: int, where: str = "") -> DimAxes:
        return dim_axes(self._mesh, self._spec, ndim, where=where)

    def shard_counts(self, ndim: int) -> tuple[int, ...]:
        """The number of shards of each of ``ndim`` dimensions."""
        return shard_counts(self._mesh, self._dims(ndim))

    def devices_indices_map(self, global_shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """``{device id: per-dimension slices}`` of the block each device holds.

        Uneven splits are described exactly as torch_xla places them (ceil-sized chunks, the
        last ones short or empty).
        """
        shape = tuple(int(n) for n in global_shape)
        axes = self._dims(len(shape))
        counts = shard_counts(self._mesh, axes)
        numbers = device_shard_numbers(self._mesh, axes)
        return {
            d: tuple(
                slice(*shard_range(n, k, j)) for n, k, j in zip(shape, counts, js, strict=True)
            )
            for d, js in sorted(numbers.items())
        }

    def shard_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of every device's block (the shape must divide evenly)."""
        shape = tuple(int(n) for n in global_shape)
        axes = self._dims(len(shape))
        check_divisible(self._mesh, self._spec, axes, shape)
        return tuple(n // k for n, k in zip(shape, shard_counts(self._mesh, axes), strict=True))

    def _topology(
        self, process_index: int | None, device_process: Sequence[int] | None
    ) -> tuple[int, tuple[int, ...]]:
        """``(process_index, device_process)``, defaulting to the runtime (or emulated) topology,
        checked: the mesh covers every device, and the process owns at least one of them."""
        if process_index is None or device_process is None:
            topology = topology_of(self._mesh)
            process_index = topology.process_index if process_index is None else process_index
            device_process = topology.device_process if device_process is None else device_process
        device_process = tuple(device_process)
        check_device_process(self._mesh, device_process)
        if process_index not in device_process:
            raise ShardingError(
                f"process_index {process_index} owns no device of {self._mesh!r}; expected one "
                f"of the processes {sorted(set(device_process))}."
            )
        return process_index, device_process

    def _feeds(self, ndim: int, device_process: Sequence[int] | None) -> tuple[_DimFeeds, ...]:
        if device_process is None:
            device_process = topology_of(self._mesh).device_process
        device_process = tuple(device_process)
        check_device_process(self._mesh, device_process)
        return dim_feeds(self._mesh, self._dims(ndim), device_process)

    def process_local_shape(
        self,
        global_shape: Sequence[int],
        process_index: int | None = None,
        *,
        device_process: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """The shape of the block of the global array that ``process_index`` holds.

        Along each dimension: the total size of the distinct slices of that process's devices
        (uneven splits included, as torch_xla places them). ``process_index`` defaults to this
        process; ``device_process`` (``device_process[d]`` owns device ``d``) to the runtime
        topology.

        Example (mesh ``(4, 2)`` with ids ``0..7``, 2 hosts: devices 0-3 and 4-7):
            >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
            >>> s = torchshard.NamedSharding(mesh, torchshard.P("data"))
            >>> s.process_local_shape((8, 3), 1, device_process=(0, 0, 0, 0, 1, 1, 1, 1))
            (4, 3)
        """
        shape = tuple(int(n) for n in global_shape)
        process_index, device_process = self._topology(process_index, device_process)
        feeds = dim_feeds(self._mesh, self._dims(len(shape)), device_process)
        counts = self.shard_counts(len(shape))
        return tuple(
            sum(_shard_size(n, k, j) for j in f.sets[process_index])
            for n, k, f in zip(shape, counts, feeds, strict=True)
        )

    def global_shape_from_local(
        self, local_shape: Sequence[int], *, device_process: Sequence[int] | None = None
    ) -> tuple[int | None, ...]:
        """The global shape whose per-process blocks have ``local_shape`` (JAX's
        ``local_to_global_shape``); ``None`` for a dimension that is not process-uniform."""
        shape = tuple(int(n) for n in local_shape)
        feeds = self._feeds(len(shape), device_process)
        return tuple(
            n * f.count if f.count is not None else None for n, f in zip(shape, feeds, strict=True)
        )

    def process_index_and_count(
        self,
        dim: int,
        *,
        ndim: int | None = None,
        process_index: int | None = None,
        device_process: Sequence[int] | None = None,
    ) -> tuple[int, int]:
        """This process's feed index along ``dim`` and the number of feeds along it.

        Feeds (distinct per-process blocks) are numbered by the position of their first slice,
        so the answer is deterministic. Raises ``NonUniformShardingError`` when the layout is not
        process-uniform along ``dim``. ``ndim`` defaults to ``max(len(spec), dim + 1)``.

        Example (mesh ``(4, 2)`` with ids ``0..7``, 2 hosts: devices 0-3 and 4-7):
            >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
            >>> s = torchshard.NamedSharding(mesh, torchshard.P("data"))
            >>> hosts = (0, 0, 0, 0, 1, 1, 1, 1)
            >>> s.process_index_and_count(0, process_index=0, device_process=hosts)
            (0, 2)
            >>> s.process_index_and_count(0, process_index=1, device_process=hosts)
            (1, 2)
            >>> s.process_index_and_count(1, process_index=1, device_process=hosts)  # dim 1: whole
            (0, 1)
        """
        ndim = max(len(self._spec), dim + 1) if ndim is None else ndim
        if not 0 <= dim < ndim:
            raise ValueError(f"dim must be in [0, {ndim}), but got {dim}.")
        process_index, device_process = self._topology(process_index, device_process)
        f = dim_feeds(self._mesh, self._dims(ndim), device_process)[dim]
        if f.count is None:
            raise NonUniformShardingError(
                f"{self!r} is not process-uniform along dim {dim}: the processes hold the shard "
                f"sets {dict(sorted(f.sets.items()))}, which do not split the shards into "
                "equal, disjoint groups."
            )
        return f.feed_of[process_index], f.count
