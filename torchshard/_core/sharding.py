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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from torchshard._core.errors import IndivisibleError, NonUniformShardingError, ShardingError, at
from torchshard._core.mesh import Mesh, topology_of
from torchshard._core.spec import UNCONSTRAINED, PartitionSpec, as_partition_spec, spec_entry_axes

DimAxes = tuple[tuple[str, ...], ...]
_T = TypeVar("_T")


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


class _ById:
    """A key that stands for one object by identity (``memo`` keeps the object alive)."""

    __slots__ = ("ident",)

    def __init__(self, obj: object) -> None:
        self.ident = id(obj)

    def __eq__(self, other: object) -> bool:
        return type(other) is _ById and other.ident == self.ident

    def __hash__(self) -> int:
        return self.ident


_BIG = 256  # a tuple argument longer than this is keyed by identity (a topology's map)


def _key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` as a cache key: a tuple of more than ``_BIG`` items by identity (``memo``)."""
    return tuple(_ById(a) if type(a) is tuple and len(a) > _BIG else a for a in args)


def memo(maxsize: int) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """``functools.lru_cache`` for functions of a device -> process map: positional arguments
    only, a tuple of more than ``_BIG`` items (``Topology.device_process``) keyed by identity,
    not hashed (16,384 ints take ~0.1 ms to hash, on every call). The kept arguments hold each
    such tuple alive, so its id is not reused while it keys an entry; an equal tuple that is
    another object only misses. Results are kept, exceptions are not; cleared past
    ``maxsize`` entries (``cache_clear()`` clears it)."""

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        table: dict[tuple[Any, ...], tuple[tuple[Any, ...], _T]] = {}

        @functools.wraps(fn)
        def call(*args: Any) -> _T:
            key = _key(args)
            hit = table.get(key)
            if hit is not None:
                return hit[1]
            out = fn(*args)
            if len(table) >= maxsize:
                table.clear()
            table[key] = (args, out)
            return out

        call.cache_clear = table.clear  # type: ignore[attr-defined]
        return call

    return wrap


def _positions(mesh: Mesh) -> tuple[np.ndarray, np.ndarray]:
    """The device ids in flat mesh order, and per device id its flat position (``-1``: none):
    O(devices) work, not kept (``local_positions`` keeps a few devices' positions)."""
    ids = mesh.devices.reshape(-1)
    position = np.full(int(ids.max()) + 1 if ids.size else 0, -1, dtype=np.int64)
    position[ids] = np.arange(ids.size)
    return ids, position


def _dim_numbers(mesh: Mesh, dim: tuple[str, ...]) -> np.ndarray:
    """Per flat mesh position, the device's shard number along a dimension split over the
    axes ``dim`` (major to minor)."""
    sizes = mesh.devices.shape
    out = np.zeros(mesh.devices.size, dtype=np.int64)
    for axis in dim:
        k = mesh.axis_names.index(axis)
        coord = np.arange(sizes[k], dtype=np.int64).reshape(
            tuple(sizes[k] if a == k else 1 for a in range(len(sizes)))
        )
        out = out * sizes[k] + np.broadcast_to(coord, sizes).reshape(-1)
    return out


def _numbers_at(mesh: Mesh, axes: DimAxes, where: np.ndarray) -> np.ndarray:
    """``[dims, len(where)]``: the shard numbers of the devices at flat mesh positions
    ``where`` (O(len(where)) work: their mesh coordinates, not the whole mesh's)."""
    sizes = mesh.devices.shape
    coords = np.unravel_index(where, sizes) if where.size else [where] * len(sizes)
    out = np.zeros((len(axes), where.size), dtype=np.int64)
    for i, dim in enumerate(axes):
        for axis in dim:
            k = mesh.axis_names.index(axis)
            out[i] = out[i] * sizes[k] + coords[k]
    return out


@memo(4096)
def local_positions(mesh: Mesh, devices: tuple[int, ...]) -> np.ndarray:
    """The flat mesh positions of ``devices`` (``-1``: not in the mesh), read-only: O(devices
    of the mesh) work once per mesh and device tuple, O(``len(devices)``) kept."""
    position = _positions(mesh)[1]
    want = np.asarray(devices, dtype=np.int64).reshape(-1)
    out = np.full(want.size, -1, dtype=np.int64)
    inside = (want >= 0) & (want < position.size)
    out[inside] = position[want[inside]]
    out.setflags(write=False)
    return out


def local_shard_numbers(
    mesh: Mesh, axes: DimAxes, devices: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """The flat mesh positions of ``devices`` (``-1``: not in the mesh) and ``[dims,
    len(devices)]``, their shard numbers along each dimension (a device not in the mesh gets
    zeros): what a plan for a few devices needs, without an array over the whole mesh kept."""
    where = local_positions(mesh, devices)
    return where, _numbers_at(mesh, axes, np.maximum(where, 0))


class ShardNumbers(Mapping[int, tuple[int, ...]]):
    """For each device id, its shard number along each dimension: a read-only mapping over
    arrays (``array[:, n]`` for the device at flat mesh position ``n``), so that one device's
    numbers cost a few array reads and no per-device object is built for the whole mesh."""

    __slots__ = ("_ids", "_numbers", "_position")

    def __init__(self, mesh: Mesh, axes: DimAxes) -> None:
        self._ids, self._position = _positions(mesh)
        self._numbers = tuple(_dim_numbers(mesh, dim) for dim in axes)

    @property
    def ids(self) -> np.ndarray:
        """The device ids, in flat mesh order."""
        return self._ids

    @property
    def array(self) -> np.ndarray:
        """``[dims, devices]``: shard numbers, devices in flat mesh order (a new array)."""
        return self.columns(slice(None))

    def columns(self, where: Any) -> np.ndarray:
        """``[dims, len(where)]``: the shard numbers of the devices at flat positions
        ``where`` (an index of numpy's: a list of positions, a slice)."""
        if not self._numbers:
            return np.zeros((0, self._ids[where].size), dtype=np.int64)
        return np.stack([numbers[where] for numbers in self._numbers])

    def position(self, device: object) -> int:
        """The flat mesh position of ``device``, ``-1`` when the mesh lacks it."""
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            return -1
        if 0 <= device < self._position.size:
            return int(self._position[device])
        return -1

    def __getitem__(self, device: int) -> tuple[int, ...]:
        n = self.position(device)
        if n < 0:
            raise KeyError(device)
        return tuple(int(numbers[n]) for numbers in self._numbers)

    def __contains__(self, device: object) -> bool:
        return self.position(device) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())

    def __len__(self) -> int:
        return int(self._ids.size)


def device_shard_numbers(mesh: Mesh, axes: DimAxes) -> ShardNumbers:
    """For each device id of the mesh, its shard number along each dimension (numpy,
    O(devices) integer work per call, not kept: for what needs every device, a layout or an
    index map; a plan for a few devices reads ``local_shard_numbers``)."""
    return ShardNumbers(mesh, axes)


def device_ranges(
    mesh: Mesh, axes: DimAxes, shape: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The device ids, ascending, and each one's block of a ``shape`` array (``axes`` per
    dimension): ``(ids, starts, stops)``, the last two ``[devices, dims]`` arrays of the global
    ``[start, stop)`` per dimension (``shard_range``'s rule, in numpy)."""
    numbers = device_shard_numbers(mesh, axes)
    order = np.argsort(numbers.ids, kind="stable")
    j = numbers.array[:, order]  # [dims, devices]
    n = np.asarray(shape, dtype=np.int64).reshape(-1, 1)
    chunk = -(-n // np.asarray(shard_counts(mesh, axes), dtype=np.int64).reshape(-1, 1))
    starts = np.minimum(j * chunk, n)
    stops = np.minimum((j + 1) * chunk, n)
    return numbers.ids[order], starts.T, stops.T


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


class DimFeeds:
    """The per-process view of one dimension (see the module docstring), from arrays.

    Made from O(devices) integer work in numpy over the whole mesh, once per split of a
    dimension and set of ``processes``, it keeps only what is O(those processes): ``count``
    (the feed count; ``None`` when not uniform), ``uniform``, the distinct numbers of shards a
    process holds, and for each of ``processes`` (every process when ``None``: virtual hosts)
    its sorted shards (``held``) and feed index (``feed``). Any other process's, and the
    dicts over every process (``sets``, ``sizes()``, ``feed_of``: error messages), are
    computed again when read (O(devices) work) and not kept.
    """

    __slots__ = (
        "_device_process",
        "_dim",
        "_distinct",
        "_everyone",
        "_feeds",
        "_mesh",
        "_offsets",
        "_pairs",
        "_procs",
        "count",
        "k",
        "uniform",
    )

    def __init__(
        self,
        mesh: Mesh,
        dim: tuple[str, ...],
        device_process: tuple[int, ...],
        processes: tuple[int, ...] | None,
        owner: np.ndarray | None = None,
    ) -> None:
        # owner: per flat mesh position, the process that owns the device (else computed)
        self._mesh, self._dim, self._device_process = mesh, dim, device_process
        self._everyone = processes is None
        k = self.k = math.prod(mesh.shape[a] for a in dim)
        if owner is None:
            owner = mesh_owners(mesh, device_process)
        if k == 1:  # not split: every process holds the one shard
            pairs = np.flatnonzero(np.bincount(owner))
        else:  # (process, shard) as process * k + shard, distinct, ascending (< devices * k)
            # stable: timsort, linear on the runs a pod's meshes give (hosts in mesh order)
            pairs = np.sort(owner * k + _dim_numbers(mesh, dim), kind="stable")
            keep = np.empty(pairs.size, dtype=bool)
            keep[0] = True
            np.not_equal(pairs[1:], pairs[:-1], out=keep[1:])
            pairs = pairs[keep]
        proc, held = np.divmod(pairs, k)
        starts = np.flatnonzero(np.concatenate(([True], proc[1:] != proc[:-1])))
        procs = proc[starts]  # the processes that own a device, ascending
        offsets = np.append(starts, proc.size)  # row r: held[offsets[r]:offsets[r + 1]]
        sizes = np.diff(offsets)
        uniform, firsts = False, None
        if sizes.size and (sizes == sizes[0]).all():
            rows = held.reshape(-1, int(sizes[0]))
            first = rows[:, 0]
            rep = np.full(k, -1, dtype=np.int64)
            rep[first] = np.arange(first.size)  # one process per distinct first shard
            firsts = np.flatnonzero(rep >= 0)  # the distinct first shards, ascending
            # uniform: processes with the same first shard hold the same set, and the distinct
            # sets (one per first shard) hold every shard exactly once
            if firsts.size * rows.shape[1] == k and (rows == rows[rep[first]]).all():
                cover = np.bincount(rows[rep[firsts]].reshape(-1), minlength=k)
                uniform = bool((cover == 1).all())
        self.uniform = uniform
        self.count = int(firsts.size) if uniform and firsts is not None else None
        self._distinct = (int(sizes[0]),) if uniform else tuple(np.unique(sizes).tolist())
        # What is kept: the rows of ``processes`` (copies: a view would keep the whole array)
        if processes is None:
            kept = np.arange(procs.size)
            self._pairs, self._offsets, self._procs = pairs, offsets, procs
        else:
            want = np.asarray(processes, dtype=np.int64).reshape(-1)
            found = np.minimum(np.searchsorted(procs, want), procs.size - 1)
            kept = found[procs[found] == want]  # a process that owns no device has no row
            parts = [pairs[offsets[r] : offsets[r + 1]] for r in kept.tolist()]
            self._pairs = np.concatenate(parts) if parts else pairs[:0].copy()
            self._offsets = np.concatenate(([0], np.cumsum(sizes[kept])))
            self._procs = procs[kept]
        self._feeds = None  # per kept row, its feed index (uniform only)
        if uniform and firsts is not None:
            self._feeds = np.searchsorted(firsts, held[offsets[kept]])

    def _row(self, process: int) -> int:
        """``process``'s row among the kept ones (``-1``: not kept)."""
        row = int(np.searchsorted(self._procs, process))
        if row >= self._procs.size or self._procs[row] != process:
            return -1
        return row

    def _all(self) -> DimFeeds:
        """The same dimension with every process's rows (made again, not kept)."""
        if self._everyone:
            return self
        return DimFeeds(self._mesh, self._dim, self._device_process, None)

    def held(self, process: int) -> tuple[int, ...]:
        """The sorted shard numbers ``process``'s devices hold (``KeyError``: it owns none)."""
        row = self._row(process)
        if row < 0:
            if self._everyone:
                raise KeyError(process)
            return self._all().held(process)
        part = self._pairs[self._offsets[row] : self._offsets[row + 1]]
        return tuple((part % self.k).tolist())

    def places(self, owners: np.ndarray, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For devices of processes ``owners`` holding ``shards`` (arrays, one entry per
        device): each shard's index among its owner's sorted shards, and how many its owner
        holds (``owners`` among the kept processes; else from every process's rows)."""
        rows = np.searchsorted(self._procs, owners)
        if rows.size and (
            int(rows.max()) >= self._procs.size or (self._procs[rows] != owners).any()
        ):
            return self._all().places(owners, shards)
        start = self._offsets[rows]
        size = self._offsets[rows + 1] - start
        return np.searchsorted(self._pairs, owners * self.k + shards) - start, size

    def feed(self, process: int) -> int:
        """``process``'s feed index: the rank of its set, ordered by first shard (uniform
        layouts only)."""
        if self._feeds is None:
            raise ValueError("feed indices are defined only for a uniform dimension.")
        row = self._row(process)
        if row < 0:
            if self._everyone:
                raise KeyError(process)
            return self._all().feed(process)
        return int(self._feeds[row])

    def sizes(self) -> dict[int, int]:
        """Per process, how many distinct shards its devices hold (a dict over every process:
        for errors and checks that need every process)."""
        every = self._all()
        return dict(zip(every._procs.tolist(), np.diff(every._offsets).tolist(), strict=True))

    def distinct_sizes(self) -> tuple[int, ...]:
        """The distinct numbers of shards a process holds, ascending."""
        return self._distinct

    @property
    def sets(self) -> dict[int, tuple[int, ...]]:
        """``{process: sorted shard numbers held}`` for every process (made when read)."""
        every = self._all()
        held = (every._pairs % self.k).tolist()
        offsets = every._offsets.tolist()
        return {
            p: tuple(held[offsets[r] : offsets[r + 1]]) for r, p in enumerate(every._procs.tolist())
        }

    @property
    def feed_of(self) -> dict[int, int]:
        """``{process: feed index}`` for every process (uniform layouts; made when read)."""
        every = self._all()
        if every._feeds is None:
            raise ValueError("feed indices are defined only for a uniform dimension.")
        return dict(zip(every._procs.tolist(), every._feeds.tolist(), strict=True))


def mesh_owners(mesh: Mesh, device_process: Sequence[int]) -> np.ndarray:
    """Per flat mesh position, the process that owns the device (O(devices) work, not kept;
    the mesh covers ``device_process``'s devices)."""
    owner = np.fromiter(device_process, dtype=np.int64, count=len(device_process))
    return owner[mesh.devices.reshape(-1)]


# Per split of a dimension, device -> process map (by identity past ``_BIG`` devices) and set of
# processes: its ``DimFeeds``, with the arguments that keep the map's id from being reused.
_FEEDS: dict[tuple[Any, ...], tuple[tuple[Any, ...], DimFeeds]] = {}
_FEEDS_BOUND = 4096


def dim_feeds(
    mesh: Mesh,
    axes: DimAxes,
    device_process: tuple[int, ...],
    processes: tuple[int, ...] | None = None,
) -> tuple[DimFeeds, ...]:
    """For each dimension, which shards each process holds, and whether that is uniform:
    O(devices) integer work in numpy once per split of a dimension (kept per split), O(the
    shards of ``processes``) kept: the processes a caller reads (its own; ``None``: every
    process, as virtual hosts plan every device). The mesh must cover ``device_process``'s
    devices."""
    owner = None
    out = []
    for dim in axes:
        args = (mesh, dim, device_process, processes)
        key = _key(args)
        hit = _FEEDS.get(key)
        if hit is None:
            if owner is None:  # the map as numpy, once for every dimension of this call
                owner = mesh_owners(mesh, device_process)
            f = DimFeeds(mesh, dim, device_process, processes, owner)
            if len(_FEEDS) >= _FEEDS_BOUND:
                _FEEDS.clear()
            _FEEDS[key] = (args, f)
        else:
            f = hit[1]
        out.append(f)
    return tuple(out)


dim_feeds.cache_clear = _FEEDS.clear  # type: ignore[attr-defined]


def planned_processes(owners: Sequence[int]) -> tuple[int, ...] | None:
    """The processes whose feeds a plan for devices owned by ``owners`` reads: those, sorted
    and distinct, or ``None`` (every process) past ``_BIG`` of them."""
    distinct = sorted(set(owners))
    return tuple(distinct) if len(distinct) <= _BIG else None


def covers(mesh: Mesh, device_count: int) -> bool:
    """Whether the mesh's device ids are exactly ``0..device_count-1`` (they are distinct)."""
    devices = mesh.devices
    return devices.size == device_count and (
        device_count == 0 or (int(devices.min()) == 0 and int(devices.max()) == device_count - 1)
    )


def check_device_process(mesh: Mesh, device_process: Sequence[int]) -> None:
    """The mesh must name exactly the devices of the run (a torch_xla rule)."""
    if not covers(mesh, len(device_process)):
        ids = sorted(mesh.device_ids)
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
        ids, starts, stops = device_ranges(self._mesh, self._dims(len(shape)), shape)
        pairs = zip(starts.tolist(), stops.tolist(), strict=True)
        index = [tuple(map(slice, a, b)) for a, b in pairs]
        return dict(zip(ids.tolist(), index, strict=True))

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

    def _feeds(self, ndim: int, device_process: Sequence[int] | None) -> tuple[DimFeeds, ...]:
        if device_process is None:
            device_process = topology_of(self._mesh).device_process
        device_process = tuple(device_process)
        check_device_process(self._mesh, device_process)
        return dim_feeds(self._mesh, self._dims(ndim), device_process, ())  # counts only

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
        feeds = dim_feeds(self._mesh, self._dims(len(shape)), device_process, (process_index,))
        counts = self.shard_counts(len(shape))
        return tuple(
            sum(_shard_size(n, k, j) for j in f.held(process_index))
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
        so the answer is deterministic and feed ``i`` is the ``i``-th block of the data. JAX's
        ``get_process_index_and_count`` forms the same groups but numbers them in a Python set's
        order (JAX 0.10.2, 4 processes on a plain mesh: feeds 1, 2, 3, 0; docs/differences.md).
        Raises ``NonUniformShardingError`` when the layout is not process-uniform along ``dim``.
        ``ndim`` defaults to ``max(len(spec), dim + 1)``.

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
        f = dim_feeds(self._mesh, self._dims(ndim), device_process, (process_index,))[dim]
        if f.count is None:
            raise NonUniformShardingError(
                f"{self!r} is not process-uniform along dim {dim}: the processes hold the shard "
                f"sets {dict(sorted(f.sets.items()))}, which do not split the shards into "
                "equal, disjoint groups."
            )
        return f.feed(process_index), f.count
