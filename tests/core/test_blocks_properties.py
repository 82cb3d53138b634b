"""Property tests: the O(local) plans (torchshard._core.sharding's array feeds and
blocks.plan_from_local for one process's devices) against the full plans of before issue 28
(``tests/dict_plan.py``: dicts over every device and process), on random meshes (1-64 devices,
rank 1-3, permuted ids), device -> process maps (contiguous, strided, random groups), specs,
local shapes and given global shapes. Every result must be identical, and every failure the
same exception type."""

import dict_plan
import numpy as np
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import SETTINGS, specs

import torchshard as ts
from torchshard._core import blocks, sharding
from torchshard._core.layout import describe_layout
from torchshard._core.layout_text import _box_table, compact, table_rows
from torchshard._core.sharding import dim_axes
from torchshard._core.topology import Topology, override_topology

NAMES = ("a", "b", "c")


def _factorizations(n, rank):
    if rank == 1:
        return [(n,)]
    return [
        (d, *rest) for d in (1, 2, 4, 8) if n % d == 0 for rest in _factorizations(n // d, rank - 1)
    ]


@st.composite
def meshes(draw):
    size = draw(st.sampled_from((1, 2, 4, 8, 16, 32, 64)))
    rank = draw(st.integers(1, 3))
    shape = draw(st.sampled_from(_factorizations(size, rank) or [(size,)]))
    rank = len(shape)
    ids = draw(st.permutations(range(size)))
    return ts.Mesh(np.asarray(ids).reshape(shape), NAMES[:rank])


@st.composite
def device_processes(draw, size):
    """``device_process`` for ``size`` devices: contiguous equal hosts, strided hosts, or random
    groups of any sizes (every process owns a device)."""
    kind = draw(st.sampled_from(("contiguous", "strided", "random")))
    divisors = [h for h in range(1, size + 1) if size % h == 0]
    if kind != "random":
        hosts = draw(st.sampled_from(divisors))
        if kind == "contiguous":
            return tuple(d // (size // hosts) for d in range(size))
        return tuple(d % hosts for d in range(size))
    hosts = draw(st.integers(1, size))
    order = draw(st.permutations(range(size)))
    cuts = sorted(draw(st.sets(st.integers(1, size - 1), max_size=hosts - 1))) if size > 1 else []
    owner = [0] * size
    for p, (a, b) in enumerate(zip([0, *cuts], [*cuts, size], strict=True)):
        for d in order[a:b]:
            owner[d] = p
    return tuple(owner)


@st.composite
def cases(draw):
    mesh = draw(meshes())
    owners = draw(device_processes(mesh.size))
    ndim = draw(st.integers(0, 3))
    spec = draw(specs(mesh, ndim))
    counts = [int(np.prod([mesh.shape[a] for a in axes])) for axes in dim_axes(mesh, spec, ndim)]
    local = tuple(draw(st.sampled_from((0, 1, 2, 3, k, 2 * k, 3 * k))) for k in counts)
    given_shape = None
    if draw(st.booleans()):
        given_shape = tuple(
            draw(st.sampled_from((m, k * m, 2 * k, k))) for m, k in zip(local, counts, strict=True)
        )
    return mesh, owners, spec, local, given_shape


def _outcome(fn, *args):
    try:
        return fn(*args)
    except ts.ShardingError as e:
        return type(e)


@SETTINGS
@given(case=cases())
def test_feeds_match_the_full_dicts(case):
    mesh, owners, spec, local, _ = case
    axes = dim_axes(mesh, spec, len(local))
    assert dict(sharding.device_shard_numbers(mesh, axes)) == dict_plan.device_shard_numbers(
        mesh, axes
    )
    for new, old in zip(
        sharding.dim_feeds(mesh, axes, owners), dict_plan.dim_feeds(mesh, axes, owners), strict=True
    ):
        assert (new.uniform, new.count) == (old.uniform, old.count)
        assert new.sets == old.sets
        for p, held in old.sets.items():
            assert new.held(p) == held
        assert new.sizes() == {p: len(s) for p, s in old.sets.items()}
        if old.uniform:
            assert new.feed_of == old.feed_of


@SETTINGS
@given(case=cases())
def test_feeds_kept_for_one_process_match_the_full_dicts(case):
    """What a process keeps of a split (its own shards and feed index, the count) is the full
    plan's; another process's shards and the dicts over every process, read from it, are
    computed again, equal too."""
    mesh, owners, spec, local, _ = case
    axes = dim_axes(mesh, spec, len(local))
    old = dict_plan.dim_feeds(mesh, axes, owners)
    numbers = dict_plan.device_shard_numbers(mesh, axes)
    for p in sorted(set(owners)):
        mine = sharding.dim_feeds(mesh, axes, owners, (p,))
        devices = [d for d in range(mesh.size) if owners[d] == p]
        for i, (new, full) in enumerate(zip(mine, old, strict=True)):
            assert (new.uniform, new.count) == (full.uniform, full.count)
            assert new.held(p) == full.sets[p]
            assert new.distinct_sizes() == tuple(sorted({len(s) for s in full.sets.values()}))
            if full.uniform:
                assert new.feed(p) == full.feed_of[p]
                assert new.feed_of == full.feed_of
            other = max(full.sets)  # not kept: made again from every process's rows
            assert new.held(other) == full.sets[other]
            assert new.sets == full.sets
            shards = [numbers[d][i] for d in devices]
            index, size = new.places(np.asarray([p] * len(devices)), np.asarray(shards))
            assert index.tolist() == [full.sets[p].index(j) for j in shards]
            assert size.tolist() == [len(full.sets[p])] * len(devices)


@SETTINGS
@given(case=cases(), shuffled=st.booleans())
def test_each_processs_plan_is_its_part_of_the_full_plan(case, shuffled):
    mesh, owners, spec, local, given_shape = case
    for p in sorted(set(owners)):
        devices = tuple(d for d in range(mesh.size) if owners[d] == p)
        if shuffled:
            devices = devices[::-1]
        new = _outcome(blocks.plan_from_local, mesh, spec, local, owners, devices, given_shape)
        old = _outcome(dict_plan.plan_from_local, mesh, spec, local, owners, devices, given_shape)
        assert new == old, (p, devices)
        event("planned" if isinstance(new, blocks.HostPlan) else f"refused: {new.__name__}")
    every = tuple(range(mesh.size))  # virtual hosts: one process plans every device
    assert _outcome(blocks.plan_from_local, mesh, spec, local, owners, every, given_shape) == (
        _outcome(dict_plan.plan_from_local, mesh, spec, local, owners, every, given_shape)
    )


@SETTINGS
@given(case=cases(), shuffled=st.booleans())
def test_shared_blocks_match_the_grouping_per_piece(case, shuffled):
    """The blocks several hosts supply (numpy over the pieces) are those of grouping every
    piece by its shard numbers (the dict oracle), in the same order, for every device's plan
    (virtual hosts) and for each process's own."""
    mesh, owners, spec, local, given_shape = case
    every = tuple(range(mesh.size))
    for devices in (every[::-1] if shuffled else every, every[: mesh.size // 2]):
        plan = _outcome(blocks.plan_from_local, mesh, spec, local, owners, devices, given_shape)
        if not isinstance(plan, blocks.HostPlan):
            return
        new = [(b.ranges, b.owners) for b in blocks.shared_blocks(mesh, plan)]
        assert new == dict_plan.shared_blocks(mesh, plan)
        event(f"{min(len(new), 3)} shared blocks")


@SETTINGS
@given(case=cases())
def test_the_index_map_and_the_layout_match_the_full_dicts(case):
    mesh, owners, spec, shape, _ = case
    assert ts.NamedSharding(mesh, spec).devices_indices_map(shape) == (
        dict_plan.devices_indices_map(mesh, spec, shape)
    )
    topology = Topology(0, max(owners) + 1, owners)
    try:
        with override_topology(topology, backend=mesh.backend):
            layout = describe_layout(mesh, spec, shape)
    except ts.ShardingError:
        return
    assert [(b.device, b.host, b.ranges) for b in layout.blocks] == (
        dict_plan.layout_blocks(mesh, spec, shape, owners)
    )
    assert layout.host_blocks() == dict_plan.host_blocks(layout)
    rows = [("block", "devices", "hosts"), *dict_plan.table_rows(layout)]
    assert table_rows(layout) == rows[1:]
    assert _box_table(rows) == dict_plan.box_table(rows)


@SETTINGS
@given(ids=st.lists(st.integers(0, 40), max_size=12))
def test_compact_matches_the_full_scan(ids):
    assert compact(ids) == dict_plan.compact(ids)
