"""host_sampler: each host reads its own shard; the assembled batches hold every example once."""

import re

import numpy as np
import pytest
from data_helpers import FakeDispatcher, Rows
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import torchshard as ts
from torchshard.testing import (
    global_batch_loader_per_host,
    global_to_host_array_per_host,
    virtual_hosts,
)


@given(n=st.integers(1, 60), shards=st.integers(1, 6), drop_last=st.booleans())
def test_unshuffled_shards_are_numpy_strides(n, shards, drop_last):
    usable = n - n % shards if drop_last else n
    for index in range(shards):
        got = list(
            ts.host_sampler(
                range(n),
                {"num_shards": shards, "shard_index": index},
                shuffle=False,
                drop_last=drop_last,
            )
        )
        if drop_last:
            assert got == np.arange(usable)[index::shards].tolist()
        else:  # padded with the first indices, as DistributedSampler does
            padded = np.resize(np.arange(n), -(-n // shards) * shards)
            assert got == padded[index::shards].tolist()


@settings(max_examples=30)
@given(n=st.integers(1, 80), shards=st.integers(1, 8), seed=st.integers(0, 5))
def test_shuffled_shards_are_disjoint_and_cover_the_epoch(n, shards, seed):
    parts = [
        list(ts.host_sampler(range(n), {"num_shards": shards, "shard_index": i}, seed=seed))
        for i in range(shards)
    ]
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == n - n % shards
    assert all(len(p) == n // shards for p in parts)


def test_reads_the_config_of_a_dispatcher():
    dispatcher = FakeDispatcher(num_shards=4, shard_index=3)
    assert list(ts.host_sampler(range(8), dispatcher, shuffle=False)) == [3, 7]


def test_set_epoch_changes_the_order_on_every_host_alike():
    a = ts.host_sampler(range(64), {"num_shards": 2, "shard_index": 0})
    b = ts.host_sampler(range(64), {"num_shards": 2, "shard_index": 1})
    first = list(a) + list(b)
    a.set_epoch(1)
    b.set_epoch(1)
    second = list(a) + list(b)
    assert first != second and sorted(first) == sorted(second) == list(range(64))


@pytest.mark.parametrize(
    ("config", "error", "msg"),
    [
        (
            [2, 0],
            TypeError,
            (
                "dispatcher_or_feed_config: expected a PartitionSpec (the batch's layout on the "
                "current mesh, e.g. P('dp')), an input dispatcher (with feed_read_config()) or a "
                "dict {'num_shards': int, 'shard_index': int}, but got list."
            ),
        ),
        (
            {"num_shards": 2},
            ValueError,
            (
                "dispatcher_or_feed_config: expected the keys ['num_shards', 'shard_index'], but "
                "got ['num_shards']."
            ),
        ),
        (
            {"num_shards": 2, "shard_index": 2},
            ValueError,
            (
                "dispatcher_or_feed_config: expected num_shards >= 1 and 0 <= shard_index < "
                "num_shards, but got num_shards=2, shard_index=2."
            ),
        ),
        (
            {"num_shards": 2, "shard_index": True},
            TypeError,
            "dispatcher_or_feed_config['shard_index']: expected an int, but got True.",
        ),
        (
            FakeDispatcher(num_shards=0),
            ValueError,
            (
                "dispatcher_or_feed_config.feed_read_config(): expected num_shards >= 1 and 0 <= "
                "shard_index < num_shards, but got num_shards=0, shard_index=0."
            ),
        ),
    ],
)
def test_bad_config(config, error, msg):
    with pytest.raises(error, match=f"^{re.escape(msg)}$"):
        ts.host_sampler(range(8), config)


def test_a_spec_reads_the_feed_of_the_current_mesh():
    # virtual hosts emulate on torch_xla; DTensor's side: tests/cross/test_stacks.py (tp_training)
    pytest.importorskip("torch_xla", reason="virtual_hosts emulates hosts on torch_xla")
    # (dp=2, tp=4) over 4 hosts of 2 devices: hosts 0, 1 hold dp row 0, hosts 2, 3 row 1, so
    # the tp peers read the same examples (process_index() would give them different ones).
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    got = []
    for h in range(4):
        with virtual_hosts(4, process_index=h), mesh:
            sampler = ts.host_sampler(range(8), ts.P("dp"), shuffle=False)
            assert (sampler.num_replicas, sampler.rank) == (2, h // 2)
            got.append(list(sampler))
            full = list(ts.host_sampler(range(8), ts.DataPartitionType.FULL, shuffle=False))
            assert full == list(range(8))[h::4]  # FULL: every host its own block
    assert got == [[0, 2, 4, 6], [0, 2, 4, 6], [1, 3, 5, 7], [1, 3, 5, 7]]
    with pytest.raises(
        ts.errors.NoMeshError,
        match=re.escape(
            "host_sampler(dataset, P('dp',)): feed_read_config must be called inside `with mesh:`"
        ),
    ):
        ts.host_sampler(range(8), ts.P("dp"))


def test_dataset_needs_a_length():
    msg = "dataset: expected a map-style dataset with len(), but got generator."
    with pytest.raises(TypeError, match=f"^{re.escape(msg)}$"):
        ts.host_sampler((i for i in range(3)), {"num_shards": 1, "shard_index": 0})


@pytest.mark.parametrize("hosts", [2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_example_once_per_epoch_with_virtual_hosts(mesh42, hosts, shuffle, prefetch):
    n, per_host = 96, 8  # 96 examples, global batch 8 * hosts
    dataset = Rows(n)
    samplers = [
        ts.host_sampler(dataset, {"num_shards": hosts, "shard_index": h}, shuffle=shuffle)
        for h in range(hosts)
    ]
    loaders = [DataLoader(dataset, batch_size=per_host, sampler=s) for s in samplers]
    with virtual_hosts(hosts):
        loader = global_batch_loader_per_host(loaders, prefetch=prefetch)
        assert len(loader) == n // hosts // per_host
        seen = []
        host_views = [[] for _ in range(hosts)]
        for batch in loader:
            assert batch["id"].shape == (per_host * hosts,)
            seen += ts.replicate_to_local_data(batch["id"]).tolist()
            for h, block in enumerate(global_to_host_array_per_host(batch)):
                host_views[h] += block["id"].tolist()
    assert sorted(seen) == list(range(n))  # every example exactly once
    for h, sampler in enumerate(samplers):  # host h's rows are what its sampler read
        assert host_views[h] == list(sampler)
