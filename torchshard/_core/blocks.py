"""Host blocks: how a process's local array maps onto the devices it drives (pure maths).

Given a mesh, the per-dimension axes of a spec, and the device -> process map, a process's
local array along dim ``i`` is the concatenation, in global order, of the distinct shards its
devices hold along ``i``. ``plan_from_local`` infers the global shape from a local shape (JAX's
``make_array_from_process_local_data`` rule), or takes a given one (``given_global_shape``:
a host's block may then cover whole dimensions), and gives each device the slice of its
owner's local array that it must receive. ``block_offsets`` is the inverse used when reading back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from torchshard._core.errors import NonUniformShardingError, ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import (
    DimAxes,
    check_device_process,
    check_divisible,
    dim_axes,
    dim_feeds,
    local_shard_numbers,
    memo,
    planned_processes,
    shard_counts,
    shard_range,
)
from torchshard._core.spec import PartitionSpec

Cut = tuple[int, int, int]  # (dim, start, length): one ``Tensor.narrow``


@dataclasses.dataclass(frozen=True)
class DevicePiece:
    """What one device receives: its owner's local array, narrowed by ``cuts`` (in order)."""

    device: int
    owner: int
    cuts: tuple[Cut, ...]


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """The placement of one leaf: its split axes, global shape and each device's piece.

    ``local_shape`` is the block every host passes; where hosts pass blocks of different
    shapes (``plan_hosts``), ``owner_shapes`` holds ``(host, its shape)`` for each and
    ``local_shape`` is the first planned device's owner's."""

    axes: DimAxes
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    pieces: tuple[DevicePiece, ...]
    owner_shapes: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def shape_of(self, owner: int) -> tuple[int, ...]:
        """The shape of the block ``owner`` passes."""
        for host, shape in self.owner_shapes:
            if host == owner:
                return shape
        return self.local_shape

    @functools.cached_property
    def single_split(self) -> tuple[int, int] | None:
        """``(dim, chunk)`` when every piece is one ``chunk``-long cut of the same ``dim``
        (the common case: one ``Tensor.split`` then gives every piece at once)."""
        if not all(len(p.cuts) == 1 for p in self.pieces):
            return None
        cuts = {p.cuts[0][::2] for p in self.pieces}
        if len(cuts) != 1:
            return None
        dim, chunk = next(iter(cuts))
        return (dim, chunk) if chunk > 0 else None  # empty pieces: narrow, not split

    @functools.cached_property
    def split_parts(self) -> tuple[int, ...]:
        """With ``single_split``: each piece's index among its owner's ``chunk``-long parts."""
        split = self.single_split
        return tuple(p.cuts[0][1] // split[1] for p in self.pieces) if split else ()


def infer_global_shape(
    mesh: Mesh,
    spec: PartitionSpec,
    axes: DimAxes,
    local_shape: tuple[int, ...],
    device_process: tuple[int, ...],
    processes: tuple[int, ...] | None = (),
) -> tuple[int, ...]:
    """The global shape whose per-process blocks have ``local_shape``; checks divisibility.
    ``processes``: those whose feeds the caller reads next (``dim_feeds``: shared with it)."""
    check_device_process(mesh, device_process)
    feeds = dim_feeds(mesh, axes, device_process, processes)
    out = []
    for i, (n, f) in enumerate(zip(local_shape, feeds, strict=True)):
        if f.count is None:
            raise NonUniformShardingError(
                f"dim {i} is not process-uniform under {spec!r} on {mesh!r}: the hosts hold "
                f"the shard sets {dict(sorted(f.sets.items()))} along it, which are not equal, "
                "disjoint groups, so no global shape has one block per host. Choose a spec or "
                "a mesh device order that follows host boundaries, or give global_shape (as "
                "in JAX: each host then passes its own part, whose size may differ from "
                "host to host, or the whole dimension)."
            )
        out.append(n * f.count)
    shape = tuple(out)
    check_divisible(mesh, spec, axes, shape)
    return shape


def given_global_shape(
    mesh: Mesh,
    spec: PartitionSpec,
    axes: DimAxes,
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    device_process: tuple[int, ...],
    processes: tuple[int, ...] | None = None,
) -> tuple[bool, ...]:
    """Checks a given global shape against a host block (JAX's
    ``make_array_from_process_local_data`` with ``global_shape``) and says, per dimension,
    whether the block covers the whole dimension (each host then slices what its devices
    need, by global index) rather than only its own part (its devices' distinct shards, in
    order: the inferred case).

    ``processes`` pass a block of ``local_shape`` (``None``: every host); their feeds are the
    ones kept (as for ``infer_global_shape``). A host's own part along a dimension may have
    another size than another host's (a mesh whose hosts hold 1, 2, 2 and 1 blocks of dim 0):
    as in JAX, each host passes its own, so hosts may pass blocks of different shapes (plan
    each group with its hosts' devices, ``plan_from_local``)."""
    check_device_process(mesh, device_process)
    if len(global_shape) != len(local_shape):
        raise ShardingError(
            f"global_shape {global_shape} has {len(global_shape)} dimensions, but the host "
            f"block has shape {local_shape} ({len(local_shape)} dimensions); give one size per "
            "dimension."
        )
    check_divisible(mesh, spec, axes, global_shape)
    feeds = dim_feeds(mesh, axes, device_process, processes)
    full = []
    for i, (m, n, k, f) in enumerate(
        zip(local_shape, global_shape, shard_counts(mesh, axes), feeds, strict=True)
    ):
        if m == n:
            full.append(True)
            continue
        chunk = n // k
        if processes is None:  # every host: one size each, else the per-host sizes
            ok = [size * chunk for size in f.distinct_sizes()] == [m]
            parts = {} if ok else {h: size * chunk for h, size in f.sizes().items()}
        else:  # the planned hosts' own parts (O(their shards))
            parts = {h: len(f.held(h)) * chunk for h in processes}
            ok = set(parts.values()) == {m}
        if not ok:
            sizes = sorted(set(parts.values()))
            if len(sizes) == 1:
                held = sizes[0] // chunk if chunk else 0
                own = (
                    f"its own part, {sizes[0]} ({held} distinct shard(s) of {chunk} on its devices)"
                )
            else:
                own = f"its own part (per host: {dict(sorted(parts.items()))})"
            raise ShardingError(
                f"dim {i} of the host block has size {m}, but with global_shape {global_shape} "
                f"a host passes along it either the whole dimension, {n} (each host then takes "
                f"the slices its devices need), or {own}, under {spec!r} on mesh "
                f"{dict(mesh.shape)}. Pass a block of one of those sizes, or fix global_shape."
            )
        full.append(False)
    return tuple(full)


@memo(4096)
def plan_from_local(
    mesh: Mesh,
    spec: PartitionSpec,
    local_shape: tuple[int, ...],
    device_process: tuple[int, ...],
    devices: tuple[int, ...],
    global_shape: tuple[int, ...] | None = None,
) -> HostPlan:
    """The placement of a leaf whose every host passes a block of ``local_shape``.

    ``devices`` lists the devices to plan for (a backend's local devices), in its order; their
    owners pass the block. ``global_shape``: given (see ``given_global_shape``: a host's own
    part is checked against its own size), else inferred. Raises
    ``ShardingError`` subclasses without a tree path (callers add it); failures are not
    cached, successes are, so a steady input stream plans each leaf shape once.
    """
    axes = dim_axes(mesh, spec, len(local_shape))
    check_device_process(mesh, device_process)
    where, js = local_shard_numbers(mesh, axes, devices)  # js: [dims, planned devices]
    if where.size and int(where.min()) < 0:
        raise ShardingError(f"device {devices[int(where.argmin())]} is not in {mesh!r}.")
    owners = [device_process[d] for d in devices]
    # Only the planned devices' processes are read (one host's: O(its devices) kept per split;
    # every process under virtual hosts), after O(devices) integer work once per split.
    processes = planned_processes(owners)
    if global_shape is None:
        global_shape = infer_global_shape(mesh, spec, axes, local_shape, device_process, processes)
        full = (False,) * len(local_shape)
    else:
        full = given_global_shape(
            mesh, spec, axes, local_shape, global_shape, device_process, processes
        )
    feeds = dim_feeds(mesh, axes, device_process, processes)
    counts = shard_counts(mesh, axes)
    cut_dims = []  # (dim, chunk, each device's start or None: no cut)
    for dim, (n, k, f) in enumerate(zip(global_shape, counts, feeds, strict=True)):
        if k == 1:
            continue
        chunk = n // k
        if full[dim]:  # the host passed the whole dimension: cut by global index
            cut_dims.append((dim, chunk, (js[dim] * chunk).tolist()))
            continue
        index, size = f.places(np.asarray(owners, dtype=np.int64), js[dim])
        # a device whose owner holds one shard gets the owner's whole local dimension
        starts = np.where(size > 1, index * chunk, -1).tolist()
        cut_dims.append((dim, chunk, [None if s < 0 else s for s in starts]))
    if len(cut_dims) == 1:  # the common case, one cut per device (16,384 under virtual hosts)
        dim, chunk, starts = cut_dims[0]
        pieces = [
            DevicePiece(d, owner, () if s is None else ((dim, s, chunk),))
            for d, owner, s in zip(devices, owners, starts, strict=True)
        ]
    else:
        pieces = []
        for i, (d, owner) in enumerate(zip(devices, owners, strict=True)):
            cuts = tuple(
                (dim, starts[i], chunk) for dim, chunk, starts in cut_dims if starts[i] is not None
            )
            pieces.append(DevicePiece(d, owner, cuts))
    return HostPlan(axes, global_shape, local_shape, tuple(pieces))


def merge_plans(plans: Sequence[HostPlan], devices: Sequence[int]) -> HostPlan:
    """One plan of a leaf whose hosts pass blocks of different shapes under a given global
    shape (as in JAX, each host passes, per dimension, its own part, whose size may differ from
    host to host, or the whole dimension): ``plans`` are ``plan_from_local``'s for each host's
    own block over its own devices, merged in ``devices`` order."""
    pieces = {p.device: p for plan in plans for p in plan.pieces}
    owners = {p.owner: plan.local_shape for plan in plans for p in plan.pieces}
    first = plans[0]
    return HostPlan(
        first.axes,
        first.global_shape,
        owners[pieces[devices[0]].owner],
        tuple(pieces[d] for d in devices),
        tuple(sorted(owners.items())),
    )


@dataclasses.dataclass(frozen=True)
class SharedBlock:
    """A block of a leaf's global array that several hosts supply (a replicated leaf, or a
    mesh on which hosts' devices hold the same shards): their values for it must be equal.

    ``ranges``: the block's global ``[start, stop)`` per dimension. ``owners``: per host that
    supplies it (ascending), ``(host, cuts, devices)``: the cuts of its local array that give
    the block (as ``DevicePiece.cuts``) and the planned devices that receive its copy.
    """

    ranges: tuple[tuple[int, int], ...]
    owners: tuple[tuple[int, tuple[Cut, ...], tuple[int, ...]], ...]


def shared_blocks(mesh: Mesh, plan: HostPlan) -> tuple[SharedBlock, ...]:
    """The blocks of ``plan`` that more than one host supplies (empty when each block has one
    owner, as when every host feeds its own rows). Devices with equal shard numbers along
    every dimension hold the same block; pieces of such devices with different owners must
    carry equal values, or the replicas of one block disagree. Numpy over the pieces; a
    Python step only for the pieces of shared blocks."""
    pieces = plan.pieces
    if not pieces:
        return ()
    counts = shard_counts(mesh, plan.axes)
    _, js = local_shard_numbers(mesh, plan.axes, tuple(p.device for p in pieces))
    key = np.zeros(len(pieces), dtype=np.int64)  # the block: its shard numbers, as one int
    for k, j in zip(counts, js, strict=True):
        key = key * k + j
    owner = np.fromiter((p.owner for p in pieces), dtype=np.int64, count=len(pieces))
    order = np.lexsort((owner, key))
    k_sorted, o_sorted = key[order], owner[order]
    pair = np.ones(order.size, dtype=bool)  # a new (block, owner) pair
    pair[1:] = (k_sorted[1:] != k_sorted[:-1]) | (o_sorted[1:] != o_sorted[:-1])
    pair_keys = k_sorted[pair]
    owners_of = np.unique(pair_keys, return_counts=True)
    shared = owners_of[0][owners_of[1] > 1]  # blocks with more than one owner
    if not shared.size:
        return ()
    # block -> (its first piece's index, per owner its pieces): in the plan's order
    groups: dict[int, tuple[int, dict[int, list[DevicePiece]]]] = {}
    for i in np.flatnonzero(np.isin(key, shared)).tolist():
        piece = pieces[i]
        groups.setdefault(int(key[i]), (i, {}))[1].setdefault(piece.owner, []).append(piece)
    out = []
    for first, by_owner in groups.values():
        js_of = js[:, first].tolist()
        ranges = tuple(
            shard_range(n, k, j) for n, k, j in zip(plan.global_shape, counts, js_of, strict=True)
        )
        owners = tuple(
            (o, ps[0].cuts, tuple(p.device for p in ps)) for o, ps in sorted(by_owner.items())
        )
        out.append(SharedBlock(ranges, owners))
    return tuple(out)


def block_offsets(
    ranges: Sequence[tuple[tuple[int, int], ...]], ndim: int
) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """The local block of a set of shards: its shape, and each shard's slice of it.

    Along each dimension the distinct global ranges are sorted and concatenated; a shard's
    local slice is where its range lands.
    """
    starts: list[dict[tuple[int, int], int]] = []
    sizes = []
    for i in range(ndim):
        distinct = sorted({r[i] for r in ranges})
        offset, where = 0, {}
        for rng in distinct:
            where[rng] = offset
            offset += rng[1] - rng[0]
        starts.append(where)
        sizes.append(offset)
    local = [
        tuple(slice(starts[i][r[i]], starts[i][r[i]] + r[i][1] - r[i][0]) for i in range(ndim))
        for r in ranges
    ]
    return tuple(sizes), local
