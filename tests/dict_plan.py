"""The oracle of the O(local) plans: torchshard's host plans as they were before issue 28 (a
dict over every device and every process, built for each mesh, split and device -> process
map), frozen here so that property tests can compare the new plans, per process, with the full
plans. Only the maths: the wording of errors is compared by the tests (type and message)."""

from __future__ import annotations

import numpy as np

from torchshard._core.blocks import DevicePiece, HostPlan
from torchshard._core.errors import NonUniformShardingError, ShardingError
from torchshard._core.sharding import check_divisible, dim_axes, shard_counts, shard_range


def device_shard_numbers(mesh, axes):
    names = mesh.axis_names
    sizes = mesh.devices.shape
    coords = np.indices(sizes).reshape(len(sizes), -1)
    flat_ids = mesh.devices.reshape(-1)
    numbers = np.zeros((len(axes), flat_ids.size), dtype=np.int64)
    for i, dim in enumerate(axes):
        for axis in dim:
            k = names.index(axis)
            numbers[i] = numbers[i] * sizes[k] + coords[k]
    return {int(d): tuple(int(x) for x in numbers[:, n]) for n, d in enumerate(flat_ids)}


class DimFeeds:
    def __init__(self, sets, k):
        self.sets = sets
        distinct = sorted(set(sets.values()), key=lambda s: s[0])
        sizes = {len(s) for s in distinct}
        covered = sorted(j for s in distinct for j in s)
        self.uniform = len(sizes) == 1 and covered == list(range(k))
        self.count = len(distinct) if self.uniform else None
        rank = {s: r for r, s in enumerate(distinct)}
        self.feed_of = {p: rank[s] for p, s in sets.items()}


def dim_feeds(mesh, axes, device_process):
    numbers = device_shard_numbers(mesh, axes)
    out = []
    for i, _ in enumerate(shard_counts(mesh, axes)):
        sets = {}
        for d, js in numbers.items():
            sets.setdefault(device_process[d], set()).add(js[i])
        out.append(DimFeeds({p: tuple(sorted(s)) for p, s in sets.items()}, _))
    return tuple(out)


def infer_global_shape(mesh, spec, axes, local_shape, device_process):
    feeds = dim_feeds(mesh, axes, device_process)
    out = []
    for i, (n, f) in enumerate(zip(local_shape, feeds, strict=True)):
        if f.count is None:
            raise NonUniformShardingError(f"dim {i} is not process-uniform")
        out.append(n * f.count)
    check_divisible(mesh, spec, axes, tuple(out))
    return tuple(out)


def given_global_shape(mesh, spec, axes, local_shape, global_shape, device_process, hosts):
    """Per dimension the whole of it, or the own part of each host in ``hosts`` (those that
    own a planned device: their own parts may differ in size from other hosts', as in JAX)."""
    if len(global_shape) != len(local_shape):
        raise ShardingError("rank")
    check_divisible(mesh, spec, axes, global_shape)
    feeds = dim_feeds(mesh, axes, device_process)
    full = []
    for m, n, k, f in zip(local_shape, global_shape, shard_counts(mesh, axes), feeds, strict=True):
        if m == n:
            full.append(True)
            continue
        chunk = n // k
        parts = {h: len(held) * chunk for h, held in sorted(f.sets.items()) if h in hosts}
        if set(parts.values()) != {m}:
            raise ShardingError("size")
        full.append(False)
    return tuple(full)


def plan_from_local(mesh, spec, local_shape, device_process, devices, global_shape=None):
    """The old ``plan_from_local``: raises a ``ShardingError`` where it raised one (the type
    is compared; the new plan's message is checked by the unit tests)."""
    axes = dim_axes(mesh, spec, len(local_shape))
    if global_shape is None:
        global_shape = infer_global_shape(mesh, spec, axes, local_shape, device_process)
        full = (False,) * len(local_shape)
    else:
        hosts = {device_process[d] for d in devices}
        full = given_global_shape(
            mesh, spec, axes, local_shape, global_shape, device_process, hosts
        )
    feeds = dim_feeds(mesh, axes, device_process)
    counts = shard_counts(mesh, axes)
    numbers = device_shard_numbers(mesh, axes)
    pieces = []
    for d in devices:
        owner = device_process[d]
        cuts = []
        for dim, (n, k, f, j) in enumerate(
            zip(global_shape, counts, feeds, numbers[d], strict=True)
        ):
            if k == 1:
                continue
            chunk = n // k
            if full[dim]:
                cuts.append((dim, j * chunk, chunk))
                continue
            held = f.sets[owner]
            if len(held) > 1:
                cuts.append((dim, held.index(j) * chunk, chunk))
        pieces.append(DevicePiece(d, owner, tuple(cuts)))
    return HostPlan(axes, global_shape, local_shape, tuple(pieces))


def devices_indices_map(mesh, spec, shape):
    axes = dim_axes(mesh, spec, len(shape))
    counts = shard_counts(mesh, axes)
    numbers = device_shard_numbers(mesh, axes)
    return {
        d: tuple(slice(*shard_range(n, k, j)) for n, k, j in zip(shape, counts, js, strict=True))
        for d, js in sorted(numbers.items())
    }


# -- describe_layout's blocks and text, as before issue 28 -----------------------------------


def layout_blocks(mesh, spec, shape, owners):
    index = devices_indices_map(mesh, spec, shape)
    return [(d, owners[d], tuple((s.start, s.stop) for s in index[d])) for d in sorted(index)]


def compact(ids):
    ids = sorted(ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{ids[i]}-{ids[j]}")
        else:
            out.extend(str(x) for x in ids[i : j + 1])
        i = j + 1
    return ",".join(out)


def table_rows(layout):
    rows = []
    for ranges, blocks in layout.distinct_blocks.items():
        block = "[" + ", ".join(f"{r[0]}:{r[1]}" for r in ranges) + "]"
        rows.append(
            (block, compact([b.device for b in blocks]), compact(sorted({b.host for b in blocks})))
        )
    return rows


def box_table(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [rule]
    for n, r in enumerate(rows):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
        if n == 0:
            out.append(rule)
    out.append(rule)
    return out


def host_blocks(layout):
    from torchshard._core.blocks import block_offsets

    by_host = {}
    for b in layout.blocks:
        by_host.setdefault(b.host, []).append(b)
    out = {}
    for h in sorted(by_host):
        mine = by_host[h]
        shape, _ = block_offsets([b.ranges for b in mine], len(layout.global_shape))
        out[h] = (tuple(b.device for b in mine), shape)
    return out


def shared_blocks(mesh, plan):
    """The blocks more than one host supplies, as ``(ranges, ((owner, cuts, devices), ...))``,
    by first piece (a dict of devices' shard numbers, grouped per piece in Python)."""
    numbers = device_shard_numbers(mesh, plan.axes)
    counts = shard_counts(mesh, plan.axes)
    groups = {}
    for piece in plan.pieces:
        groups.setdefault(numbers[piece.device], {}).setdefault(piece.owner, []).append(piece)
    out = []
    for js, by_owner in groups.items():
        if len(by_owner) < 2:
            continue
        ranges = tuple(
            shard_range(n, k, j) for n, k, j in zip(plan.global_shape, counts, js, strict=True)
        )
        owners = tuple(
            (owner, pieces[0].cuts, tuple(p.device for p in pieces))
            for owner, pieces in sorted(by_owner.items())
        )
        out.append((ranges, owners))
    return out
