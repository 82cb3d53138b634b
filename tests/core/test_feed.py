"""Feeds from the mesh (torchshard._core.feed): ``feed_read_config`` gives processes whose
devices hold the same block of dim 0 the same shard, on any mesh, and ``feed_slices`` each
process's slice of every dim. Oracles: the placement rule written out with numpy
(``helpers.reference_ranges``), hypothesis over random meshes, specs and host counts; on gloo
(4 ranks) a batch fed from the slices assembles the global value (DTensor's
``full_tensor()``); under torch_xla's virtual hosts likewise."""

from __future__ import annotations

import contextlib
import itertools
import re

import _stacks_cases  # noqa: F401 -- the workers import it; here it must import too
import numpy as np
import pytest
import torch
from helpers import reference_ranges, virtual_host_of
from hypothesis import given
from hypothesis import strategies as st
from strategies import SETTINGS, _shard_counts, meshes, specs

import torchshard as ts
from torchshard._core.topology import Topology, override_topology
from torchshard.errors import IndivisibleError, NoMeshError, NonUniformShardingError

P = ts.P

# Feeds on meshes of torch_xla's emulated devices (virtual hosts); the DTensor feed is tested
# on gloo processes in tests/cross/test_stacks.py.
pytestmark = pytest.mark.xla


@contextlib.contextmanager
def hosts(num_hosts: int, process: int, devices: int = 8):
    """``num_hosts`` contiguous hosts of the xla backend's meshes, this process ``process``
    (no runtime: the topology provider stands in for it)."""
    with override_topology(Topology(process, num_hosts, virtual_host_of(num_hosts, devices))):
        yield


def _configs(mesh, spec, num_hosts, devices=8):
    out = []
    for h in range(num_hosts):
        with hosts(num_hosts, h, devices):
            out.append(ts.feed_read_config(spec, mesh=mesh))
    return out


def _config(n, i):
    return {"num_shards": n, "shard_index": i}


def test_tp_peers_share_a_shard_on_a_dp_by_tp_mesh():
    # One device per process, (dp=2, tp=2): ranks 0, 1 hold the first block of P("dp").
    mesh = ts.Mesh(np.arange(4).reshape(2, 2), ("dp", "tp"))
    assert _configs(mesh, P("dp"), 4, 4) == [_config(2, 0)] * 2 + [_config(2, 1)] * 2
    # The old recipe, {"num_shards": process_count(), "shard_index": process_index()}, gives
    # the four processes four shards: tp peers read different rows of one block.
    assert [_config(4, h) for h in range(4)] != _configs(mesh, P("dp"), 4, 4)
    assert _configs(mesh, P("tp"), 4, 4) == [_config(2, 0), _config(2, 1)] * 2
    assert _configs(mesh, P(("dp", "tp")), 4, 4) == [_config(4, h) for h in range(4)]
    assert _configs(mesh, P(("tp", "dp")), 4, 4) == [_config(4, h) for h in (0, 2, 1, 3)]
    assert _configs(mesh, P(), 4, 4) == [_config(1, 0)] * 4
    assert _configs(mesh, P(None, "dp"), 4, 4) == [_config(1, 0)] * 4
    # Only dim 0 decides: P("dp", "tp") (a sequence split over tp) reads as P("dp").
    assert _configs(mesh, P("dp", "tp"), 4, 4) == _configs(mesh, P("dp"), 4, 4)


def test_the_processes_of_a_feed_are_the_peers_that_read_it():
    from torchshard._core.feed import feed_processes

    mesh = ts.Mesh(np.arange(4).reshape(2, 2), ("dp", "tp"))

    def peers(spec, process):
        with hosts(4, process, devices=4):
            return feed_processes(spec, mesh=mesh, caller="test")

    assert [peers(P("dp"), h) for h in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [peers(P("tp"), h) for h in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert peers(P(("dp", "tp")), 2) == (2,)
    assert peers(P(), 3) == (0, 1, 2, 3)
    # The oracle: the processes whose feed_read_config is this one's.
    for spec, h in itertools.product((P("dp"), P("tp"), P(("tp", "dp"))), range(4)):
        configs = _configs(mesh, spec, 4, 4)
        assert peers(spec, h) == tuple(p for p in range(4) if configs[p] == configs[h])


def test_permuted_hybrid_and_multi_device_hosts():
    # A transposed grid: row 0 of dp holds ranks 0 and 2.
    mesh = ts.Mesh(np.array([[0, 2], [1, 3]]), ("dp", "tp"))
    assert _configs(mesh, P("dp"), 4, 4) == [_config(2, 0), _config(2, 1)] * 2
    # 4 hosts of 2 devices, (dp=2, tp=4): hosts 0, 1 hold block 0, hosts 2, 3 block 1.
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    assert _configs(mesh, P("dp"), 4) == [_config(2, 0)] * 2 + [_config(2, 1)] * 2
    # A hybrid mesh (data = DCN 2 x ICI 2, model = 2) on 2 hosts: each host one block of data;
    # split over model only, both hosts hold the whole batch.
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    assert _configs(mesh, P("data"), 2) == [_config(2, 0), _config(2, 1)]
    assert _configs(mesh, P("model"), 2) == [_config(1, 0)] * 2
    # A permuted device order: host 1 holds the first block.
    mesh = ts.Mesh(np.array([4, 5, 6, 7, 0, 1, 2, 3]), ("data",))
    assert _configs(mesh, P("data"), 2) == [_config(2, 1), _config(2, 0)]


def test_data_partition_types_and_the_current_mesh():
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    with hosts(2, 1):
        assert ts.feed_read_config(ts.DataPartitionType.FULL, mesh=mesh) == _config(2, 1)
        assert ts.feed_read_config(ts.DataPartitionType.BATCH, mesh=mesh) == _config(2, 1)
        assert ts.feed_read_config(ts.DataPartitionType.REPLICATED, mesh=mesh) == _config(1, 0)
        from torchshard._core.context import thread_mesh

        with thread_mesh(mesh):  # the current mesh is the default
            assert ts.feed_read_config(P("data")) == _config(2, 1)
            assert ts.feed_slices(P("data"), (8, 3)) == (slice(4, 8), slice(0, 3))


def test_bad_arguments():
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    with pytest.raises(NoMeshError, match=re.escape("feed_read_config must be called inside")):
        ts.feed_read_config(P("data"))
    with pytest.raises(NoMeshError, match=re.escape("feed_slices must be called inside")):
        ts.feed_slices(P("data"), (8,))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "feed_read_config: mesh must be a torchshard.Mesh (or None: the current mesh), but "
            "got str; wrap a torch.distributed DeviceMesh with "
            "torchshard.Mesh.from_device_mesh(device_mesh)."
        ),
    ):
        ts.feed_read_config(P("data"), mesh="data")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "feed_read_config: partition must be one PartitionSpec (e.g. P('dp')) or a "
            "DataPartitionType, but got {'x': P('data',)} of type dict; a tree of specs has one "
            "layout per leaf: pass the spec of the batch leaves (e.g. partition['tokens'])."
        ),
    ):
        ts.feed_read_config({"x": P("data")}, mesh=mesh)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "but got None of type NoneType; for a batch every process reads whole "
            "(replicated), pass P()."
        ),
    ):
        ts.feed_read_config(None, mesh=mesh)
    with pytest.raises(TypeError, match=re.escape("but got 'data' of type str")):
        ts.feed_slices("data", (8,), mesh=mesh)
    with hosts(2, 0):
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "feed_read_config: dim 0 of P(UNCONSTRAINED,) is UNCONSTRAINED, which leaves the "
                "feed undefined"
            ),
        ):
            ts.feed_read_config(P(P.UNCONSTRAINED), mesh=mesh)
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "feed_read_config: partition spec P('dp',) names mesh axis 'dp', which is not an "
                "axis of the mesh; expected one of ('data', 'model')."
            ),
        ):
            ts.feed_read_config(P("dp"), mesh=mesh)
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "feed_slices: partition spec P('data', None, 'model') has 3 entries but the array "
                "has rank 2"
            ),
        ):
            ts.feed_slices(P("data", None, "model"), (8, 4), mesh=mesh)
        with pytest.raises(
            IndivisibleError,
            match=re.escape("feed_slices: dim 1 has size 3, not divisible by 2 (axes ('model',)"),
        ):
            ts.feed_slices(P("data", "model"), (8, 3), mesh=mesh)
        with pytest.raises(TypeError, match=re.escape("global_shape: expected a shape")):
            ts.feed_slices(P("data"), 8, mesh=mesh)
    bare = ts.Mesh(np.arange(8), ("data",), backend="dtensor")  # no process group, no emulation
    with pytest.raises(ts.errors.NoProcessGroupError):
        ts.feed_read_config(P("data"), mesh=bare)


def test_layouts_that_leave_the_feed_undefined():
    # Hosts 0 (devices 0-3) and 1 (4-7) on rows [0, 1], [2, 4], [3, 5], [6, 7]: host 0 holds
    # dim-0 blocks {0, 1, 2}, host 1 {1, 2, 3}: no split of the examples serves both.
    mesh = ts.Mesh(np.array([0, 1, 2, 4, 3, 5, 6, 7]).reshape(4, 2), ("data", "model"))
    with hosts(2, 0):
        with pytest.raises(
            NonUniformShardingError,
            match=re.escape(
                "feed_read_config: P('data',) on Mesh({'data': 4, 'model': 2}, devices=[0, 1, 2, "
                "4, 3, 5, 6, 7]) is not process-uniform along dim 0: the processes hold the shard "
                "sets {0: (0, 1, 2), 1: (1, 2, 3)} of it, which are not equal, disjoint groups"
            ),
        ):
            ts.feed_read_config(P("data"), mesh=mesh)
        with pytest.raises(NonUniformShardingError, match=re.escape("feed_slices: P('data',)")):
            ts.feed_slices(P("data"), (8, 2), mesh=mesh)
    # Uniform but not neighbours: host 0 holds dim-0 blocks {0, 1, 2, 6}; its feed is defined,
    # its block is no slice.
    mesh = ts.Mesh(np.array([0, 1, 2, 4, 5, 6, 3, 7]), ("data",))
    with hosts(2, 0):
        assert ts.feed_read_config(P("data"), mesh=mesh) == _config(2, 0)
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "feed_slices: along dim 0 this process's devices hold the shards [0, 1, 2, 6] of "
                "8 under P('data',) on Mesh({'data': 8}, devices=[0, 1, 2, 4, 5, 6, 3, 7]), which "
                "are not neighbours, so its block is no slice of the global array"
            ),
        ):
            ts.feed_slices(P("data"), (8,), mesh=mesh)


def test_feed_slices_on_a_dp_by_cp_mesh():
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "cp"))
    got = []
    for h in range(4):
        with hosts(4, h):
            got.append(ts.feed_slices(P("dp", "cp"), (4, 16, 3), mesh=mesh))
    assert got == [
        (slice(0, 2), slice(0, 8), slice(0, 3)),
        (slice(0, 2), slice(8, 16), slice(0, 3)),
        (slice(2, 4), slice(0, 8), slice(0, 3)),
        (slice(2, 4), slice(8, 16), slice(0, 3)),
    ]
    with hosts(4, 2):  # dim 0's slice is the shard feed_read_config names
        config = ts.feed_read_config(P("dp", "cp"), mesh=mesh)
        assert config == _config(2, 1)
        rows = ts.feed_slices(P("dp", "cp"), (4, 16), mesh=mesh)[0]
        assert (rows.start, rows.stop) == (2 * config["shard_index"], 2 * config["shard_index"] + 2)


def _oracle(mesh, spec, shape, num_hosts):
    """Per host: the distinct ranges its devices hold along each dim (numpy's rule)."""
    ranges = reference_ranges(mesh, tuple(spec), shape)
    owner = virtual_host_of(num_hosts)
    per_host = {}
    for d, r in ranges.items():
        sets = per_host.setdefault(owner[d], [set() for _ in shape])
        for i, rng in enumerate(r):
            sets[i].add(rng)
    return {h: [sorted(s) for s in sets] for h, sets in per_host.items()}


@st.composite
def cases(draw):
    mesh = draw(meshes())
    ndim = draw(st.integers(1, 3))
    spec = draw(specs(mesh, ndim))
    counts = _shard_counts(mesh, spec, ndim)
    shape = tuple(k * draw(st.integers(1, 3)) for k in counts)
    num_hosts = draw(st.sampled_from([1, 2, 4, 8]))
    return mesh, spec, shape, num_hosts


def _uniform(per_host, dim):
    """The hosts' distinct sets of ranges along ``dim`` are equal-sized, disjoint groups that
    cover every range (numpy's side of process uniformity)."""
    distinct = {tuple(sets[dim]) for sets in per_host.values()}
    every = {r for group in distinct for r in group}
    return len({len(g) for g in distinct}) == 1 and sum(len(g) for g in distinct) == len(every)


def _tiles(ranges):
    return all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@SETTINGS
@given(cases())
def test_feeds_against_the_placement_rule(case):
    mesh, spec, shape, num_hosts = case
    oracle = _oracle(mesh, spec, shape, num_hosts)
    distinct = sorted({tuple(sets[0]) for sets in oracle.values()})
    for h in range(num_hosts):
        with hosts(num_hosts, h):
            if _uniform(oracle, 0):
                # hosts with equal blocks of dim 0 share a shard, numbered by the first row
                assert ts.feed_read_config(spec, mesh=mesh) == _config(
                    len(distinct), distinct.index(tuple(oracle[h][0]))
                )
            else:
                with pytest.raises(NonUniformShardingError):
                    ts.feed_read_config(spec, mesh=mesh)
            answers = all(_uniform(oracle, i) and _tiles(oracle[h][i]) for i in range(len(shape)))
            if not answers:
                with pytest.raises(ts.ShardingError):
                    ts.feed_slices(spec, shape, mesh=mesh)
                continue
            got = ts.feed_slices(spec, shape, mesh=mesh)
        # every dim's slice is exactly the host's ranges, which tile it
        assert [(s.start, s.stop) for s in got] == [(r[0][0], r[-1][1]) for r in oracle[h]]


@pytest.mark.parametrize(
    ("grid", "names", "spec", "shape", "num_hosts"),
    [
        (np.arange(8).reshape(2, 4), ("dp", "cp"), P("dp", "cp"), (4, 16), 4),
        (np.arange(8).reshape(2, 4), ("dp", "tp"), P("dp"), (4, 3), 4),
        (np.arange(8).reshape(4, 2), ("data", "model"), P("data", "model"), (8, 4), 2),
        (np.array([4, 5, 6, 7, 0, 1, 2, 3]).reshape(2, 4), ("dp", "cp"), P("dp", "cp"), (2, 8), 4),
    ],
)
def test_blocks_fed_from_the_slices_assemble_the_global_value(
    mesh8, grid, names, spec, shape, num_hosts
):
    from torchshard.testing import host_to_global_array_per_host, virtual_hosts

    g = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    mesh = ts.Mesh(grid, names)
    blocks = []
    for h in range(num_hosts):
        with hosts(num_hosts, h):
            blocks.append(g[ts.feed_slices(spec, shape, mesh=mesh)])
    with virtual_hosts(num_hosts), mesh:
        x = host_to_global_array_per_host(blocks, partition=spec)
        assert torch.equal(ts.replicate_to_local_data(x), torch.from_numpy(g))


FEEDS = [
    ([[0, 1], [2, 3]], ("dp", "tp"), ["dp"], (4, 3)),
    ([[0, 1], [2, 3]], ("dp", "tp"), ["dp", "tp"], (4, 6)),
    ([[0, 2], [1, 3]], ("dp", "tp"), ["dp"], (4, 3)),
    ([[0, 1], [2, 3]], ("rep", "shard"), [("rep", "shard")], (8, 3)),
    ([[0, 1], [2, 3]], ("dp", "cp"), ["dp", "cp"], (2, 8)),
]


@pytest.mark.parametrize("case", FEEDS, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_the_2d_feed_on_four_gloo_processes(pools, case):
    grid, names, spec, shape = case
    results = pools(4).run("_stacks_cases:feeds", grid=grid, names=names, spec=spec, shape=shape)
    arr = np.asarray(grid)
    for rank, r in enumerate(results):
        assert r["config"] == r["current"]
        assert r["full_equal"], "the blocks fed from feed_slices did not assemble the value"
        assert torch.equal(r["local"], r["oracle"])
        assert r["old_recipe"] == _config(4, rank)
    # Processes whose devices hold the same block of dim 0 read the same shard.
    first = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    for a in range(4):
        for b in range(4):
            ca, cb = (np.argwhere(arr == r)[0] for r in (a, b))
            same = all(ca[names.index(x)] == cb[names.index(x)] for x in first)
            assert (results[a]["config"] == results[b]["config"]) == same, (a, b)
    if case is FEEDS[0]:  # the old recipe gives the tp peers 0 and 1 two shards of one block
        assert results[0]["config"] == results[1]["config"] == _config(2, 0)
        assert results[0]["old_recipe"] != results[1]["old_recipe"]
