"""GlobalBatchLoader, host_sampler and sharded_collate with the real dispatchers
(InputDispatcher, SpmdInputDispatcher), end to end: host shards -> physical batches ->
global batches -> ``physical_to_logical_batch`` in the step, with 1, 2 and 4 virtual hosts.

The oracle is independent of the loader: each host's DataLoader iterated on its own (the
examples it reads, in order) and the dispatcher's documented layout (logical feed ``i`` is
physical feed ``logical_feed_indices[i]`` and owns logical rows ``[i * fl, (i + 1) * fl)``).
Padding feeds follow the dispatcher's semantics: they read the shard ``feed_read_config()``
names, and their rows are zeroed on the host and dropped in the step.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
from data_helpers import loader_threads, no_loader_thread_left, save_resume
from helpers import reference_ranges, virtual_host_of
from sharding_oracle import assert_sharded_as
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import torchshard as ts
from torchshard.testing import global_batch_loader_per_host, virtual_hosts

KEY = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY


class Examples(Dataset):
    """Example ``i``: its id, 3 (or ``features``) float32 features with arbitrary bits, 2 int32
    tokens, a flag."""

    def __init__(self, n: int, features: int = 3) -> None:
        rng = np.random.default_rng(7)
        self.x = rng.standard_normal((n, features)).astype(np.float32) * 1e3
        self.tok = rng.integers(-(2**31), 2**31 - 1, (n, 2), dtype=np.int32)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"id": np.int64(i), "x": self.x[i], "tok": self.tok[i], "flag": np.bool_(i % 3 == 0)}

    def rows(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """The examples ``ids`` as a batch (what the step must see, bit for bit)."""
        idx = np.asarray(ids, dtype=np.int64)
        return {
            "id": torch.from_numpy(idx),
            "x": torch.from_numpy(self.x[idx]),
            "tok": torch.from_numpy(self.tok[idx]),
            "flag": torch.from_numpy(idx % 3 == 0),
        }


def logical_to_host(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    torch_xla.sync()
    return {k: ts.replicate_to_local_data(v) for k, v in batch.items()}


def assert_batch_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype, k
        assert torch.equal(got[k], expected[k]), (k, got[k], expected[k])


def input_dispatchers(hosts: int, global_logical: int, **kwargs) -> list[ts.InputDispatcher]:
    """One InputDispatcher per (virtual) host: physical feed ``h`` of ``hosts``."""
    return [
        ts.InputDispatcher(
            global_logical, num_physical_feeds=hosts, physical_feed_index=h, **kwargs
        )
        for h in range(hosts)
    ]


def host_loaders(dataset, dispatchers, *, shuffle, stateful=False):
    cls = StatefulDataLoader if stateful else DataLoader
    return [
        cls(
            dataset,
            batch_size=d.feed_logical_batch_size,
            sampler=ts.host_sampler(dataset, d, shuffle=shuffle, seed=3),
        )
        for d in dispatchers
    ]


def expected_logical_ids(dispatchers, loaders) -> list[list[int]]:
    """Per step, the logical batch's ids: logical feed i's batch (read by physical feed
    ``logical_feed_indices[i]``), in logical feed order."""
    per_host = [[b["id"].tolist() for b in loader] for loader in loaders]
    order = dispatchers[0].logical_feed_indices
    steps = len(per_host[0])
    return [[i for feed in order for i in per_host[feed][s]] for s in range(steps)]


def run_epoch(loader, step_dispatcher, hosts: int):
    """The logical batches of one epoch, read back in the step after dispatching, and the
    physical batches' ids and keys as every host holds them."""
    logical, physical = [], []
    with hosts_context(hosts):
        for batch in loader:
            out = step_dispatcher.physical_to_logical_batch(batch)
            assert KEY not in out
            logical.append(logical_to_host(out))
            physical.append(ts.replicate_to_local_data(batch["id"]).tolist())
    return logical, physical


def hosts_context(hosts: int, process_index: int = 0):
    """``virtual_hosts(hosts)``, or nothing for one (real) host."""
    if hosts == 1:
        return contextlib.nullcontext()
    return virtual_hosts(hosts, process_index=process_index)


def make_loader(loaders, dispatchers, hosts, **kwargs):
    """``GlobalBatchLoader`` for one host, the per-host loader for virtual hosts."""
    if hosts == 1:
        d = None if dispatchers is None else dispatchers[0]
        return ts.GlobalBatchLoader(loaders[0], dispatcher=d, **kwargs)
    return global_batch_loader_per_host(loaders, dispatchers=dispatchers, **kwargs)


# -- InputDispatcher: every logical example once per epoch, in order, bit-exact -----------------

CASES = {
    # name: (hosts, global logical, dispatcher kwargs, mesh shape)
    "1 host, 4 examples over 8 devices": (1, 4, {}, (8,)),
    "1 host, 4 over (4,2)": (1, 4, {}, (4, 2)),
    "1 host, 6 padded to 16": (1, 6, {"global_physical_batch_size": 16}, (8,)),
    "2 hosts, 4 over 8 devices": (2, 4, {}, (8,)),
    "2 hosts, 6 padded to 16 (uneven feeds)": (2, 6, {"global_physical_batch_size": 16}, (4, 2)),
    "2 hosts, host 0 pads": (2, 4, {"logical_feed_indices": (1,)}, (8,)),
    "4 hosts, 4 over 8 devices": (4, 4, {}, (4, 2)),
    "4 hosts, hosts 0 and 2 pad": (4, 4, {"logical_feed_indices": (1, 3)}, (8,)),
    "4 hosts, feeds reordered": (4, 4, {"logical_feed_indices": (3, 1)}, (4, 2)),
    "4 hosts, one reads, 2 examples": (4, 2, {"logical_feed_indices": (2,)}, (8,)),
}


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_input_dispatcher_epoch_is_exact(case, prefetch, shuffle):
    hosts, global_logical, kwargs, mesh_shape = CASES[case]
    n = 48
    dataset = Examples(n)
    mesh = ts.Mesh(np.arange(8).reshape(mesh_shape), ("data", "model")[: len(mesh_shape)])
    with mesh:
        dispatchers = input_dispatchers(hosts, global_logical, **kwargs)
        d = dispatchers[0]
        loaders = host_loaders(dataset, dispatchers, shuffle=shuffle)
        expected = expected_logical_ids(dispatchers, loaders)
        loader = make_loader(loaders, dispatchers, hosts, prefetch=prefetch)
        logical, physical = run_epoch(loader, d, hosts)

    assert len(logical) == len(expected) == n // global_logical
    for got, ids in zip(logical, expected, strict=True):
        assert_batch_equal(got, dataset.rows(ids))  # in order and bit-exact
    seen = [i for b in logical for i in b["id"].tolist()]
    assert sorted(seen) == list(range(n))  # every example exactly once per epoch
    # The physical batch: P rows; padding rows (and a padding feed's rows) are zeros.
    fp = d.feed_physical_batch_size
    for ids, rows in zip(expected, physical, strict=True):
        assert len(rows) == d.global_physical_batch_size
        blocks = [rows[h * fp : (h + 1) * fp] for h in range(hosts)]
        real = [
            r for feed in d.logical_feed_indices for r in blocks[feed][: d.feed_logical_batch_size]
        ]
        assert real == ids
        assert all(r == 0 for h, b in enumerate(blocks) for r in b[d.feed_logical_batch_size :])
        padding_hosts = set(range(hosts)) - set(d.logical_feed_indices)
        assert all(r == 0 for h in padding_hosts for r in blocks[h])
    assert no_loader_thread_left()


def test_padding_hosts_read_the_shard_their_read_config_names():
    """The dispatcher's semantics: a padding feed reads a shard (spread over the logical
    feeds' shards) and its rows are zeroed; it does not skip reading."""
    with ts.Mesh(np.arange(8), ("data",)):
        dispatchers = input_dispatchers(4, 4, logical_feed_indices=(1, 3))
    configs = [d.feed_read_config() for d in dispatchers]
    assert configs == [
        {"num_shards": 2, "shard_index": 0},  # padding feed 0 reads logical feed 0's shard
        {"num_shards": 2, "shard_index": 0},
        {"num_shards": 2, "shard_index": 1},  # padding feed 2 reads logical feed 1's shard
        {"num_shards": 2, "shard_index": 1},
    ]
    dataset = Examples(16)
    samplers = [ts.host_sampler(dataset, d, shuffle=False) for d in dispatchers]
    assert [list(s) for s in samplers] == [list(range(0, 16, 2)), list(range(0, 16, 2))] + [
        list(range(1, 16, 2))
    ] * 2
    batch = {"id": np.arange(2), "x": np.ones((2, 3), np.float32)}
    padded = dispatchers[0].logical_to_physical_batch(batch)
    assert padded["id"].tolist() == [0, 0] and padded[KEY].tolist() == [-1, -1]
    assert not padded["x"].any()


# -- SpmdInputDispatcher ---------------------------------------------------------------------

SPMD_CASES = {
    # name: (hosts, mesh device ids (4, 2), spec, global logical[, features per example])
    "1 host, P(data)": (1, np.arange(8), ts.P("data"), 8),
    "2 hosts, P(data)": (2, np.arange(8), ts.P("data"), 8),
    "4 hosts, P((data, model))": (4, np.arange(8), ts.P(("data", "model")), 8),
    "4 hosts, reversed mesh": (4, np.arange(8)[::-1].copy(), ts.P("data"), 16),
    "2 hosts, reversed mesh": (2, np.arange(8)[::-1].copy(), ts.P(("data", "model")), 8),
    # Host 0 holds rows 1 and 3 of the mesh, host 1 rows 0 and 2: each host's block is split
    # into two pieces that interleave in the global batch (as in JAX).
    "2 hosts, interleaved mesh": (2, np.array([4, 5, 0, 1, 6, 7, 2, 3]), ts.P("data"), 8),
    # 8 rows of 32768 float32 make "x" a 1 MiB leaf: with prefetch, the loader's thread sends it
    # by torch_xla's GIL-free transfer, whose tile order torchshard writes itself.
    "2 hosts, reversed, 1 MiB": (2, np.arange(8)[::-1].copy(), ts.P(("data", "model")), 8, 32768),
}


def global_rows(mesh, spec, host_rows):
    """JAX's layout rule, by numpy: host ``h`` (devices ``h * 8 // n ...``) holds the dim-0
    slices of its devices (``helpers.reference_ranges``, the placement rule written out with
    numpy, not torchshard's index maths); its rows fill them in increasing order."""
    hosts = len(host_rows)
    total = sum(len(r) for r in host_rows)
    ranges = reference_ranges(mesh, tuple(spec), (total,))
    owners = virtual_host_of(hosts)
    out = np.full(total, -1)
    for h, rows in enumerate(host_rows):
        starts = sorted({ranges[d][0][0] for d in range(8) if owners[d] == h})
        size = len(rows) // len(starts)
        for k, start in enumerate(starts):
            out[start : start + size] = rows[k * size : (k + 1) * size]
    assert (out >= 0).all()
    return out.tolist()


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("case", list(SPMD_CASES))
def test_spmd_input_dispatcher_epoch_is_exact(case, prefetch):
    hosts, ids, spec, global_logical, *features = SPMD_CASES[case]
    n = 64
    dataset = Examples(n, *features)
    mesh = ts.Mesh(ids.reshape(4, 2), ("data", "model"))
    with mesh:
        dispatchers = []
        for h in range(hosts):
            with hosts_context(hosts, h):
                dispatchers.append(ts.SpmdInputDispatcher(global_logical, partition_spec=spec))
        feed_of = [d.logical_feed_index for d in dispatchers]
        assert sorted(feed_of) == list(range(hosts))
        loaders = host_loaders(dataset, dispatchers, shuffle=True)
        per_host = [[b["id"].tolist() for b in loader] for loader in loaders]
        expected = [
            global_rows(mesh, spec, [per_host[h][s] for h in range(hosts)])
            for s in range(len(per_host[0]))
        ]
        loader = make_loader(loaders, dispatchers, hosts, prefetch=prefetch)
        logical, physical = run_epoch(loader, dispatchers[0], hosts)
        with hosts_context(hosts):  # the dispatcher's spec is the loader's default
            for batch in make_loader(loaders, dispatchers, hosts):
                assert_sharded_as(batch["x"], mesh, ts.P(*spec, None))
    assert physical == expected  # identity dispatch: the global batch is the logical one
    for got, want in zip(logical, expected, strict=True):
        assert_batch_equal(got, dataset.rows(want))
    assert sorted(i for b in expected for i in b) == list(range(n))
    assert no_loader_thread_left()


class Wide(Dataset):
    """Example ``i``: its id and 32768 float32 features (128 KiB), so that a batch of 8 is a
    1 MiB leaf."""

    def __init__(self, n: int) -> None:
        self.wide = np.arange(n * 32768, dtype=np.float32).reshape(n, 32768)

    def __len__(self) -> int:
        return len(self.wide)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"id": np.int64(i), "wide": self.wide[i]}


def test_a_1_mib_leaf_from_the_loader_thread_is_placed_as_the_dispatchers_spec_says():
    # Leaves of 1 MiB or more that the loader's thread assembles take torch_xla's GIL-free
    # transfer, for which torchshard writes the tile order itself (from its index maths): the
    # placement is checked against torch_xla's report and the numpy rule (sharding_oracle).
    dataset = Wide(32)
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    spec = ts.P(("data", "model"))
    with mesh:
        dispatchers = [ts.SpmdInputDispatcher(8, partition_spec=spec)]
        loaders = host_loaders(dataset, dispatchers, shuffle=False)
        batches = list(make_loader(loaders, dispatchers, 1, prefetch=2))
        assert len(batches) == 4
        for s, batch in enumerate(batches):
            assert_sharded_as(batch["wide"], mesh, ts.P(*spec, None))
            got = ts.replicate_to_local_data(batch["wide"])
            assert torch.equal(got, torch.from_numpy(dataset.wide[8 * s : 8 * (s + 1)]))
    assert no_loader_thread_left()


# -- resume -----------------------------------------------------------------------------------


def physical_rows(batch):
    """The physical batch as the step receives it: ids and dispatch key, row by row."""
    return list(
        zip(
            ts.replicate_to_local_data(batch["id"]).tolist(),
            ts.replicate_to_local_data(batch[KEY]).tolist(),
            strict=True,
        )
    )


# hosts -> (global logical batch, the feeds that read; the others pad); all padded to 8 rows
RESUME = {1: (4, (0,)), 2: (8, (1,)), 4: (8, (1, 3))}


@pytest.mark.parametrize(
    ("hosts", "prefetch", "midpoint"), [(1, 2, 3), (1, 0, "end"), (2, 3, 2), (4, 0, 5), (4, 2, 0)]
)
def test_resume_with_a_dispatcher_yields_exactly_the_remaining_physical_batches(
    hosts, prefetch, midpoint
):
    dataset = Examples(64)
    mesh = ts.Mesh(np.arange(8), ("data",))
    logical, feeds = RESUME[hosts]

    def make(prefetch):
        dispatchers = input_dispatchers(hosts, logical, logical_feed_indices=feeds)
        loaders = host_loaders(dataset, dispatchers, shuffle=True, stateful=True)
        return make_loader(loaders, dispatchers, hosts, prefetch=prefetch)

    with mesh, hosts_context(hosts):
        d = input_dispatchers(hosts, logical, logical_feed_indices=feeds)[0]
        assert not d.is_identity
        rows = d.global_physical_batch_size
        batch_bytes = rows * (8 + 12 + 8 + 1 + 8)  # id, x, tok, flag, key
        save_resume(
            make, midpoint=midpoint, prefetch=prefetch, batch_bytes=batch_bytes, read=physical_rows
        )


# -- partitions ----------------------------------------------------------------------------------


def test_the_dispatchers_spec_is_the_default_and_an_explicit_partition_wins(mesh42):
    d = ts.InputDispatcher(4)
    source = [{"id": np.arange(4), "x": np.ones((4, 3), np.float32)}]
    (batch,) = ts.GlobalBatchLoader(source, dispatcher=d)
    full = "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert torch_xla._XLAC._get_xla_sharding_spec(batch["x"]) == full
    (batch,) = ts.GlobalBatchLoader(source, dispatcher=d, partition=ts.P("data"))
    by_data = "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert torch_xla._XLAC._get_xla_sharding_spec(batch["x"]) == by_data
    out = logical_to_host(d.physical_to_logical_batch(batch))
    assert out["id"].tolist() == [0, 1, 2, 3]


def test_a_partition_that_does_not_split_dim_0_over_the_hosts_is_refused(mesh42):
    dispatchers = input_dispatchers(2, 8)
    sources = [[{"id": np.arange(4) + 4 * h}] * 2 for h in range(2)]
    msg = (
        "GlobalBatchLoader: batch 0: under partition P(), dim 0 of batch['id'] holds 1 per-host "
        "block, but the dispatcher's physical batch is 2 blocks of 4 rows "
        "(num_physical_feeds=2), 8 rows in all. Omit partition= to use the dispatcher's "
        "partition_spec (P(('data', 'model'),)), or pass a partition that splits dim 0 over the "
        "hosts."
    )
    with virtual_hosts(2):
        it = iter(global_batch_loader_per_host(sources, dispatchers=dispatchers, partition=ts.P()))
        with pytest.raises(ts.ShardingError) as info:
            next(it)
        assert str(info.value) == msg
        # The advice: no partition (the dispatcher's partition_spec).
        loader = global_batch_loader_per_host(sources, dispatchers=dispatchers)
        got = [logical_to_host(dispatchers[0].physical_to_logical_batch(b)) for b in loader]
    assert [b["id"].tolist() for b in got] == [[0, 1, 2, 3, 4, 5, 6, 7]] * 2
    assert no_loader_thread_left()


def test_a_dispatcher_with_more_feeds_than_hosts_is_refused(mesh8):
    def source(d):  # what a host reads: feed_logical_batch_size examples per batch
        return [{"id": np.arange(d.feed_logical_batch_size) + 10 * s} for s in range(2)]

    bad = ts.InputDispatcher(4, num_physical_feeds=2, physical_feed_index=0)
    msg = (
        "GlobalBatchLoader: batch 0: under partition P('data',), dim 0 of batch['id'] holds 1 "
        "per-host block, but the dispatcher's physical batch is 2 blocks of 4 rows "
        "(num_physical_feeds=2), 8 rows in all. Set the dispatcher's num_physical_feeds to 1 "
        "(one feed per host; the default is process_count())."
    )
    with pytest.raises(ts.ShardingError) as info:
        next(iter(ts.GlobalBatchLoader(source(bad), dispatcher=bad)))
    assert str(info.value) == msg
    good = ts.InputDispatcher(4, num_physical_feeds=1, physical_feed_index=0)  # the advice
    loader = ts.GlobalBatchLoader(source(good), dispatcher=good)
    got = [good.physical_to_logical_batch(b) for b in loader]
    assert [ts.replicate_to_local_data(b["id"]).tolist() for b in got] == [
        [0, 1, 2, 3],
        [10, 11, 12, 13],
    ]


def test_an_spmd_dispatchers_feed_must_be_where_the_partition_puts_the_host(mesh42):
    """A partition that puts this host's block at another feed of dim 0 than the one the
    dispatcher read would reorder the batch silently; it is an error."""
    with virtual_hosts(2, process_index=1):
        d1 = ts.SpmdInputDispatcher(8, partition_spec=ts.P("data"))
    with virtual_hosts(2):
        d0 = ts.SpmdInputDispatcher(8, partition_spec=ts.P("data"))
        sources = [[{"id": np.arange(4) + 4 * h}] for h in range(2)]
        reversed_mesh = ts.Mesh(np.arange(8)[::-1].reshape(4, 2).copy(), ("data", "model"))
        loader = global_batch_loader_per_host(
            sources, dispatchers=[d0, d1], mesh=reversed_mesh, partition=ts.P("data")
        )
        msg = (
            "GlobalBatchLoader: batch 0: partition P('data',) puts host 0's block of batch['id'] "
            "at feed 1 of 2 along dim 0, but its dispatcher (SpmdInputDispatcher) read feed 0 "
            "of 2 (feed_read_config()), so the global batch would be reordered. Build the "
            "dispatcher under the same mesh as the loader and omit partition= (the "
            "dispatcher's partition_spec is the default)."
        )
        with pytest.raises(ts.ShardingError) as info:
            next(iter(loader))
    assert str(info.value) == msg


# -- errors that name dispatcher settings, and their advice followed --------------------------


def test_indivisible_physical_batch_advice_works(mesh8):
    source = [{"id": np.arange(4), "x": np.ones((4, 3), np.float32)}] * 2
    bad = ts.InputDispatcher(4, global_physical_batch_size=4)
    with pytest.raises(ts.errors.IndivisibleError) as info:
        next(iter(ts.GlobalBatchLoader(source, dispatcher=bad)))
    msg = str(info.value)
    assert msg.endswith(
        "\nThe dispatcher's physical batch has 4 rows (4 per host x 1 host) at batch['id'], "
        "which do not split over the 8 shards of dim 0: set the dispatcher's "
        "global_physical_batch_size to a multiple of 8 (e.g. 8)."
    )
    physical = int(re.search(r"\(e\.g\. (\d+)\)\.$", msg).group(1))
    good = ts.InputDispatcher(4, global_physical_batch_size=physical)
    got = [good.physical_to_logical_batch(b) for b in ts.GlobalBatchLoader(source, dispatcher=good)]
    assert [ts.replicate_to_local_data(b["id"]).tolist() for b in got] == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("hosts", [1, 2])
def test_indivisible_batch_advice_works(mesh8, hosts):
    """Without a dispatcher, a batch that does not split names the InputDispatcher to add;
    adding exactly that (one per host) makes the epoch exact."""
    rows = 3
    sources = [[{"id": np.arange(rows) + 100 * s + 10 * h} for s in range(2)] for h in range(hosts)]
    with hosts_context(hosts):
        with pytest.raises(ts.errors.IndivisibleError) as info:
            next(iter(make_loader(sources, None, hosts)))
        fix = re.search(
            r"dispatcher=torchshard\.InputDispatcher\((\d+), global_physical_batch_size=(\d+)\)",
            str(info.value),
        )
        global_logical, physical = int(fix.group(1)), int(fix.group(2))
        assert (global_logical, physical) == (rows * hosts, 8)
        dispatchers = [
            ts.InputDispatcher(
                global_logical, global_physical_batch_size=physical, physical_feed_index=h
            )
            for h in range(hosts)
        ]
        loader = make_loader(sources, dispatchers, hosts)
        got = [logical_to_host(dispatchers[0].physical_to_logical_batch(b)) for b in loader]
    expected = [[100 * s + 10 * h + r for h in range(hosts) for r in range(rows)] for s in range(2)]
    assert [b["id"].tolist() for b in got] == expected


# -- host_sampler and sharded_collate with the real dispatchers --------------------------------


@pytest.mark.parametrize(
    ("hosts", "kwargs"), [(2, {}), (4, {}), (4, {"logical_feed_indices": (3, 0)})]
)
def test_host_sampler_reads_the_dispatchers_shard(mesh8, hosts, kwargs):
    dataset = Examples(40)
    dispatchers = input_dispatchers(hosts, 8, **kwargs)
    reads = [list(ts.host_sampler(dataset, d, shuffle=False)) for d in dispatchers]
    for d, got in zip(dispatchers, reads, strict=True):
        cfg = d.feed_read_config()
        assert got == list(range(cfg["shard_index"], 40, cfg["num_shards"]))
    logical = [reads[f] for f in dispatchers[0].logical_feed_indices]
    flat = [i for r in logical for i in r]
    assert sorted(flat) == list(range(40))  # the logical feeds read every example once


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_host_sampler_with_spmd_dispatcher(mesh42, hosts):
    dataset = Examples(32)
    reads = []
    for h in range(hosts):
        with hosts_context(hosts, h):
            d = ts.SpmdInputDispatcher(8, partition_spec=ts.P("data"))
        assert d.feed_read_config() == {"num_shards": hosts, "shard_index": h}
        reads.append(list(ts.host_sampler(dataset, d, shuffle=True, seed=1)))
    flat = [i for r in reads for i in r]
    assert len(flat) == len(set(flat)) == 32


def test_sharded_collate_with_an_input_dispatcher(mesh8):
    dataset = Examples(12)
    d = ts.InputDispatcher(4)
    collate = ts.sharded_collate(dispatcher=d)
    out = list(DataLoader(dataset, batch_size=4, collate_fn=collate))
    assert len(out) == 3
    for s, batch in enumerate(out):
        assert batch["x"].shape == (8, 3)  # physical: 4 examples padded to the 8 devices
        assert torch_xla._XLAC._get_xla_sharding_spec(batch["x"]) == (
            "{devices=[8,1]0,1,2,3,4,5,6,7}"
        )
        got = logical_to_host(d.physical_to_logical_batch(batch))
        assert_batch_equal(got, dataset.rows(list(range(4 * s, 4 * s + 4))))
    assert loader_threads() == []
