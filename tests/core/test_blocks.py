"""Host plans (torchshard._core.blocks): global shape from a local block, per-device pieces."""

import re

import numpy as np
import pytest
from helpers import host_segments, reference_ranges, take_segments, virtual_host_of

import torchshard as ts
from torchshard._core.blocks import (
    block_offsets,
    given_global_shape,
    infer_global_shape,
    merge_plans,
    plan_from_local,
)

ONE_HOST = (0,) * 8
TWO_HOSTS = (0,) * 4 + (1,) * 4
ALL = tuple(range(8))
MESH42 = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))


def _apply(plan, blocks):
    """What each planned device receives, computed with numpy from the host blocks."""
    out = {}
    for p in plan.pieces:
        x = blocks[p.owner]
        for dim, start, length in p.cuts:
            x = np.take(x, np.arange(start, start + length), axis=dim)
        out[p.device] = x
    return out


def test_one_host_full_batch():
    plan = plan_from_local(MESH42, ts.P(("data", "model")), (16, 3), ONE_HOST, ALL)
    assert plan.global_shape == (16, 3)
    assert plan.axes == (("data", "model"), ())
    assert plan.single_split == (0, 2)
    got = _apply(plan, {0: np.arange(48).reshape(16, 3)})
    for d in range(8):
        np.testing.assert_array_equal(got[d], np.arange(48).reshape(16, 3)[2 * d : 2 * d + 2])


def test_two_hosts_each_device_of_a_host_gets_its_part_of_the_host_block():
    plan = plan_from_local(MESH42, ts.P("data"), (4, 3), TWO_HOSTS, ALL)
    assert plan.global_shape == (8, 3)
    assert [p.owner for p in plan.pieces] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [p.cuts for p in plan.pieces] == [((0, 2 * (d // 2 % 2), 2),) for d in range(8)]
    blocks = {0: np.arange(12).reshape(4, 3), 1: np.arange(12, 24).reshape(4, 3)}
    glob = np.arange(24).reshape(8, 3)
    got = _apply(plan, blocks)
    for d in range(8):
        np.testing.assert_array_equal(got[d], glob[2 * (d // 2) : 2 * (d // 2) + 2])


def test_device_holding_the_whole_local_dim_gets_no_cut():
    # 2 hosts, mesh (2, 4): host h owns data row h, so each host holds one "data" shard.
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
    plan = plan_from_local(mesh, ts.P("data", "model"), (3, 8), TWO_HOSTS, ALL)
    assert plan.global_shape == (6, 8)
    assert [p.cuts for p in plan.pieces] == [((1, 2 * (d % 4), 2),) for d in range(8)]


# Meshes whose device order does not follow host boundaries.
PERMUTED24 = ts.Mesh(np.array([0, 4, 1, 5, 2, 6, 3, 7]).reshape(2, 4), ("a", "b"))
PERMUTED42 = ts.Mesh(np.array([0, 2, 4, 6, 1, 3, 5, 7]).reshape(4, 2), ("data", "model"))
MESH24 = ts.Mesh(np.arange(8).reshape(2, 4), ("a", "b"))

# Hosts whose shards are not contiguous: (mesh, spec, hosts, global shape, host 0's distinct
# ranges per dim). The expected pieces and host blocks are numpy slices of the global array
# (helpers.reference_ranges: the placement rule written out).
NON_CONTIGUOUS = [
    (PERMUTED24, ts.P("b"), 2, (8, 3), [[(0, 2), (4, 6)], [(0, 3)]]),
    (MESH24, ts.P(("b", "a")), 2, (16, 2), [[(0, 2), (4, 6), (8, 10), (12, 14)], [(0, 2)]]),
    (MESH42, ts.P(("model", "data")), 4, (16, 3), [[(0, 2), (8, 10)], [(0, 3)]]),
    (PERMUTED24, ts.P("a", "b"), 2, (4, 8), [[(0, 2), (2, 4)], [(0, 2), (4, 6)]]),
    (PERMUTED42, ts.P("data"), 4, (8, 3), [[(0, 2), (4, 6)], [(0, 3)]]),
]
NON_CONTIGUOUS_IDS = [
    "permuted mesh, 2 hosts: host 0 holds rows 0:2 and 4:6",
    "minor axis crosses hosts, 2 hosts: host 0 holds every other pair of rows",
    "minor axis crosses hosts, 4 hosts: host 0 holds rows 0:2 and 8:10",
    "permuted mesh, 2 hosts: host 0 holds every row, columns 0:2 and 4:6",
    "permuted mesh, 4 hosts: hosts 0 and 1 both hold rows 0:2 and 4:6",
]


@pytest.mark.parametrize(
    ("mesh", "spec", "hosts", "shape", "host0"), NON_CONTIGUOUS, ids=NON_CONTIGUOUS_IDS
)
def test_hosts_with_non_contiguous_shards_get_their_pieces_in_global_order(
    mesh, spec, hosts, shape, host0
):
    owners = virtual_host_of(hosts)
    glob = np.arange(int(np.prod(shape))).reshape(shape)
    ranges = reference_ranges(mesh, spec, shape)
    segments = host_segments(ranges, owners, len(shape))
    assert segments[0] == host0  # the case is what its name says
    blocks = {h: take_segments(glob, seg) for h, seg in segments.items()}
    local_shape = blocks[0].shape
    assert {b.shape for b in blocks.values()} == {local_shape}

    plan = plan_from_local(mesh, spec, local_shape, owners, ALL)
    assert plan.global_shape == shape and plan.local_shape == local_shape
    assert [(p.device, p.owner) for p in plan.pieces] == [(d, owners[d]) for d in range(8)]
    got = _apply(plan, blocks)
    for d in range(8):
        want = glob[tuple(slice(a, b) for a, b in ranges[d])]
        np.testing.assert_array_equal(got[d], want, err_msg=f"device {d}")


def test_a_host_block_of_rows_0_2_and_4_6_is_cut_where_each_range_landed():
    # Written out by hand: mesh (2, 4) with ids [[0, 4, 1, 5], [2, 6, 3, 7]], P("b"), 2 hosts.
    # Host 0 (devices 0-3) sits in "b" columns 0 and 2, so it holds global rows 0:2 and 4:6,
    # concatenated: its local rows 2:4 are global rows 4:6.
    glob = np.arange(24).reshape(8, 3)
    blocks = {0: glob[[0, 1, 4, 5]], 1: glob[[2, 3, 6, 7]]}
    plan = plan_from_local(PERMUTED24, ts.P("b"), (4, 3), TWO_HOSTS, ALL)
    assert plan.global_shape == (8, 3)
    got = _apply(plan, blocks)
    rows = {0: 0, 1: 4, 2: 0, 3: 4, 4: 2, 5: 6, 6: 2, 7: 6}  # device -> first global row
    for d, r in rows.items():
        np.testing.assert_array_equal(got[d], glob[r : r + 2], err_msg=f"device {d}")


def test_two_cut_pieces_and_no_single_split():
    plan = plan_from_local(MESH42, ts.P("data", "model"), (8, 4), ONE_HOST, ALL)
    assert plan.single_split is None
    assert plan.pieces[3].cuts == ((0, 2, 2), (1, 2, 2))


def test_replicated_and_0d():
    plan = plan_from_local(MESH42, ts.P(), (), ONE_HOST, ALL)
    assert plan.global_shape == () and all(p.cuts == () for p in plan.pieces)
    assert plan.single_split is None


def test_empty_batch_has_empty_pieces_and_no_split():
    plan = plan_from_local(MESH42, ts.P("data"), (0, 3), ONE_HOST, ALL)
    assert plan.global_shape == (0, 3)
    assert plan.single_split is None
    assert all(p.cuts == ((0, 0, 0),) for p in plan.pieces)


def test_only_the_given_devices_are_planned():
    plan = plan_from_local(MESH42, ts.P("data"), (4, 3), TWO_HOSTS, (4, 5, 6, 7))
    assert [p.device for p in plan.pieces] == [4, 5, 6, 7]
    with pytest.raises(ts.ShardingError, match=re.escape("device 9 is not in")):
        plan_from_local(MESH42, ts.P("data"), (4, 3), TWO_HOSTS, (9,))


def test_plans_are_cached():
    a = plan_from_local(MESH42, ts.P("data"), (4, 3), TWO_HOSTS, ALL)
    assert plan_from_local(MESH42, ts.P("data"), (4, 3), TWO_HOSTS, ALL) is a


def test_infer_global_shape_errors():
    axes = (("data",), ())
    with pytest.raises(
        ts.errors.IndivisibleError, match=re.escape("dim 0 has size 6, not divisible by 4")
    ):
        infer_global_shape(MESH42, ts.P("data"), axes, (3, 2), TWO_HOSTS)
    mesh = ts.Mesh(np.array([0, 1, 2, 4, 3, 5, 6, 7]).reshape(2, 4), ("a", "b"))
    with pytest.raises(
        ts.errors.NonUniformShardingError,
        match=re.escape(
            "dim 0 is not process-uniform under P('a',) on Mesh({'a': 2, 'b': 4}, devices=[0, 1, "
            "2, 4, 3, 5, 6, 7]): the hosts hold the shard sets {0: (0,), 1: (0, 1), 2: (0, 1), "
            "3: (1,)} along it, which are not equal, disjoint groups, so no global shape has one "
            "block per host. Choose a spec or a mesh device order that follows host boundaries, "
            "or give global_shape (as in JAX: each host then passes its own part, whose size may "
            "differ from host to host, or the whole dimension)."
        ),
    ):
        infer_global_shape(mesh, ts.P("a"), (("a",), ()), (2, 2), (0, 0, 1, 1, 2, 2, 3, 3))


def test_block_offsets():
    ranges = [((4, 6), (0, 3)), ((0, 2), (3, 6)), ((4, 6), (3, 6)), ((0, 2), (0, 3))]
    shape, local = block_offsets(ranges, 2)
    assert shape == (4, 6)
    assert local == [
        (slice(2, 4), slice(0, 3)),
        (slice(0, 2), slice(3, 6)),
        (slice(2, 4), slice(3, 6)),
        (slice(0, 2), slice(0, 3)),
    ]
    assert block_offsets([((5, 5),), ((4, 5),)], 1) == ((1,), [(slice(1, 1),), (slice(0, 1),)])


# Rows held by hosts 0; 1, 2; 1, 2; 3 (4 hosts of 2 devices): along dim 0 the hosts hold 1, 2,
# 2 and 1 of its 4 blocks (JAX's case, tests/cross/test_jax.py).
UNEQUAL = ts.Mesh(np.array([0, 1, 2, 4, 3, 5, 6, 7]).reshape(4, 2), ("data", "model"))
FOUR_HOSTS = tuple(d // 2 for d in range(8))


def test_a_given_global_shape_checks_each_hosts_own_part():
    """With global_shape, each host passes its own part: 2, 4, 4 and 2 of 8 rows here (before:
    one size for every host, so these hosts could pass only the whole dimension)."""
    axes = (("data",), ())
    for host, rows in enumerate((2, 4, 4, 2)):
        full = given_global_shape(
            UNEQUAL, ts.P("data"), axes, (rows, 3), (8, 3), FOUR_HOSTS, (host,)
        )
        assert full == (False, True)
    assert given_global_shape(UNEQUAL, ts.P("data"), axes, (8, 3), (8, 3), FOUR_HOSTS, (0,)) == (
        True,
        True,
    )
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "dim 0 of the host block has size 2, but with global_shape (8, 3) a host passes along "
            "it either the whole dimension, 8 (each host then takes the slices its devices need), "
            "or its own part, 4 (2 distinct shard(s) of 2 on its devices), under P('data',) on "
            "mesh {'data': 4, 'model': 2}. Pass a block of one of those sizes, or fix "
            "global_shape."
        ),
    ):
        given_global_shape(UNEQUAL, ts.P("data"), axes, (2, 3), (8, 3), FOUR_HOSTS, (1,))
    with pytest.raises(ts.ShardingError, match=re.escape("its own part (per host: {0: 2, 1: 4, ")):
        given_global_shape(UNEQUAL, ts.P("data"), axes, (2, 3), (8, 3), FOUR_HOSTS)


def test_plans_of_hosts_whose_parts_differ_merge_in_device_order():
    G = np.arange(24).reshape(8, 3)
    blocks = {0: G[0:2], 1: G[2:6], 2: G[2:6], 3: G[6:8]}
    plans = [
        plan_from_local(
            UNEQUAL,
            ts.P("data"),
            blocks[h].shape,
            FOUR_HOSTS,
            tuple(d for d in ALL if FOUR_HOSTS[d] == h),
            (8, 3),
        )
        for h in range(4)
    ]
    plan = merge_plans(plans, ALL)
    assert [p.device for p in plan.pieces] == list(ALL)
    assert plan.global_shape == (8, 3) and plan.local_shape == (2, 3)
    assert plan.owner_shapes == ((0, (2, 3)), (1, (4, 3)), (2, (4, 3)), (3, (2, 3)))
    assert [plan.shape_of(h) for h in range(4)] == [(2, 3), (4, 3), (4, 3), (2, 3)]
    got = _apply(plan, blocks)
    want = reference_ranges(UNEQUAL, ts.P("data"), (8, 3))
    for d in ALL:
        np.testing.assert_array_equal(got[d], G[tuple(slice(a, b) for a, b in want[d])])


@pytest.mark.parametrize("devices", [1024, 16384])
def test_one_hosts_plan_keeps_what_its_host_owns(devices):
    """The first plan of one host of 4 devices on a pod's mesh keeps O(its devices) in the
    caches (issue 28: the device -> process map and the feeds as arrays over the whole mesh
    were ~55 B per device of the pod, 0.9 MB at 16,384): the same few KiB at any size."""
    import tracemalloc

    from torchshard._core import sharding

    hosts = devices // 4
    mesh = ts.Mesh(np.arange(devices).reshape(hosts, 4), ("data", "model"))
    owners = tuple(d // 4 for d in range(devices))
    mine = tuple(range(4 * (hosts // 2), 4 * (hosts // 2) + 4))
    for cache in (plan_from_local, sharding.dim_feeds, sharding.local_positions):
        cache.cache_clear()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        plans = [
            plan_from_local(mesh, ts.P(("data", "model")), shape, owners, mine)
            for shape in ((8, 16), (8,))
        ]
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert [p.global_shape for p in plans] == [(8 * hosts, 16), (8 * hosts,)]
    assert [p.pieces[0].device for p in plans] == [mine[0]] * 2
    assert kept < 32 * 1024, kept  # 16,384 devices: ~900 KiB before
