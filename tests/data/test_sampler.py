"""host_sampler: each host reads its own shard; the assembled batches hold every example once."""

import re

import numpy as np
import pytest
from data_helpers import FakeDispatcher, Rows
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

import torchshard as ts
from torchshard.testing import (
    global_batch_loader_per_host,
    global_to_host_array_per_host,
    virtual_hosts,
)


@given(n=st.integers(1, 60), shards=st.integers(1, 6), drop_last=st.booleans())
def test_unshuffled_shards_are_numpy_strides(n, shards, drop_last):
    if drop_last and n < shards:  # every host's epoch would be empty: refused (below)
        return
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
        # drop_last=False: every index once, no repeats (DistributedSampler would pad)
        assert got == np.arange(usable)[index::shards].tolist()


@settings(max_examples=30)
@given(n=st.integers(1, 80), shards=st.integers(1, 8), seed=st.integers(0, 5))
def test_shuffled_shards_are_disjoint_and_cover_the_epoch(n, shards, seed):
    if n < shards:  # every host's epoch would be empty: refused (below)
        return
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


# -- HostSampler: the epoch's global order and a position in it --------------------------------


def _torch_order(n, seed, epoch, shuffle=True):
    """The epoch's order from torch's own DistributedSampler (one replica): the oracle."""
    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    s.set_epoch(epoch)
    return list(s)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 50),
    shards=st.integers(1, 6),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
)
def test_shards_follow_torchs_order_without_repeats(n, shards, seed, epoch, drop_last):
    if drop_last and n < shards:  # every host's epoch would be empty: refused
        with pytest.raises(ValueError, match="gives every host an empty epoch"):
            ts.host_sampler(range(n), {"num_shards": shards, "shard_index": 0})
        return
    parts = []
    for h in range(shards):
        s = ts.host_sampler(
            range(n), {"num_shards": shards, "shard_index": h}, seed=seed, drop_last=drop_last
        )
        s.set_epoch(epoch)
        parts.append(list(s))
        assert len(s) == len(parts[-1])
        if drop_last and n >= shards:  # what DistributedSampler itself gives
            ref = DistributedSampler(range(n), shards, h, shuffle=True, seed=seed, drop_last=True)
            ref.set_epoch(epoch)
            assert parts[-1] == list(ref)
    order = _torch_order(n, seed, epoch)
    usable = n // shards * shards if drop_last else n
    assert parts == [order[:usable][h::shards] for h in range(shards)]
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == usable


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), shards=st.integers(1, 5), data=st.data())
def test_a_resumed_pass_reads_on_from_the_global_position(n, shards, data):
    start = data.draw(st.integers(0, n))
    order = _torch_order(n, 7, 2)
    parts = []
    for h in range(shards):
        s = ts.host_sampler(range(n), {"num_shards": shards, "shard_index": h}, seed=7)
        s.resume(2, start)
        assert s.epoch == 2
        parts.append(list(s))
        assert s.start == 0  # the pass is complete: the next one is the whole epoch
        assert len(list(s)) == n // shards
    usable = (n - start) // shards * shards
    assert parts == [order[start : start + usable][h::shards] for h in range(shards)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_len_is_the_whole_epochs_share_also_for_a_resumed_pass(drop_last):
    """``len()`` counts the epoch as torch's DistributedSampler does, whether the pass is
    resumed or not, before, during and after it: Lightning sizes the epoch by it on every
    process while the loader's read-ahead may have finished the pass on one of them (on the
    old code: 2 before the pass, 8 after it, so two processes' Lightning disagreed)."""
    for h in range(2):
        s = ts.host_sampler(range(17), {"num_shards": 2, "shard_index": h}, drop_last=drop_last)
        torchs = DistributedSampler(range(17), num_replicas=2, rank=h, drop_last=True)
        whole = len(torchs) if drop_last else len(range(h, 17, 2))  # never repeats (9, 8)
        assert len(s) == whole
        s.resume(0, 13)  # 13 of the epoch's 17 examples consumed
        assert len(s) == whole
        it = iter(s)
        rest = [next(it)]
        assert len(s) == whole
        rest += list(it)  # the pass ends: the sampler restarts at 0
        assert len(s) == whole
        assert len(rest) == (2 if drop_last else len(range(h, 4, 2)))


def test_state_dict_and_load_state_dict_mid_pass():
    feed = {"num_shards": 2, "shard_index": 1}
    a = ts.host_sampler(range(20), feed, seed=1)
    a.resume(4, 6)
    it = iter(a)
    head = [next(it) for _ in range(3)]
    state = a.state_dict()
    assert state == {
        "drop_last": True,
        "epoch": 4,
        "num_examples": 20,
        "num_shards": 2,
        "seed": 1,
        "shard_index": 1,
        "shuffle": True,
        "start": 6,
        "yielded": 3,
    }
    rest = list(it)
    b = ts.host_sampler(range(20), feed, seed=1)
    b.load_state_dict(state)
    assert list(b) == rest and head + rest == _torch_order(20, 1, 4)[6:][1::2]


def test_set_epoch_keeps_the_resumed_start_only_for_its_own_epoch():
    s = ts.host_sampler(range(10), {"num_shards": 1, "shard_index": 0}, shuffle=False)
    s.resume(3, 4)
    s.set_epoch(3)  # the training loop's own call for the resumed epoch
    assert list(s) == [4, 5, 6, 7, 8, 9]
    s.resume(3, 4)
    s.set_epoch(4)
    assert list(s) == list(range(10))


def test_a_state_of_another_shard_count_is_refused():
    s = ts.host_sampler(range(10), {"num_shards": 2, "shard_index": 0})
    state = s.state_dict()
    other = ts.host_sampler(range(10), {"num_shards": 4, "shard_index": 0})
    msg = (
        "HostSampler.load_state_dict: state_dict: saved by a sampler with {'num_examples': 10, "
        "'seed': 0, 'shuffle': True, 'num_shards': 2, 'shard_index': 0}, but this one has "
        "{'num_examples': 10, 'seed': 0, 'shuffle': True, 'num_shards': 4, 'shard_index': 0}. A "
        "shard's position means something only in the same order and shard count; to resume on "
        "another number of hosts, load GlobalBatchLoader's state (it restarts every shard at the "
        "epoch's global position)."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("expected a dict with keys ['drop_last',")):
        other.load_state_dict({"yielded": 1})


def test_it_is_a_distributed_sampler():
    s = ts.host_sampler(range(10), {"num_shards": 4, "shard_index": 3}, drop_last=False)
    assert isinstance(s, DistributedSampler) and isinstance(s, ts.data.HostSampler)
    assert (s.num_replicas, s.rank, s.num_samples) == (4, 3, 2)  # shards of 3, 3, 2, 2


def test_a_dataset_smaller_than_the_shard_count_is_refused():
    """Every host got an empty epoch without a word; ``drop_last=False`` still pads."""
    with pytest.raises(
        ValueError,
        match=re.escape(
            "dataset: 3 example(s) over 4 shards with drop_last=True gives every host an empty "
            "epoch. Use a dataset of at least num_shards examples, or drop_last=False (every "
            "example once; with last_batch='pad' the short hosts are padded and masked)."
        ),
    ):
        ts.host_sampler(range(3), {"num_shards": 4, "shard_index": 0})
    feed = {"num_shards": 4, "shard_index": 3}
    short = ts.host_sampler(range(3), feed, shuffle=False, drop_last=False)
    assert list(short) == []  # every example once: the loader's last_batch='pad' masks it


def test_numpy_ints_in_a_feed_config_are_accepted():
    """``np.int64`` (a config read with numpy) was refused as not an int."""
    feed = {"num_shards": np.int64(2), "shard_index": np.int32(1)}
    assert list(ts.host_sampler(range(6), feed, shuffle=False)) == [1, 3, 5]
    with pytest.raises(TypeError, match=re.escape("expected an int, but got 1.0.")):
        ts.host_sampler(range(6), {"num_shards": 2, "shard_index": 1.0})
    with pytest.raises(TypeError, match=re.escape("expected an int, but got ")):
        ts.host_sampler(range(6), {"num_shards": 2, "shard_index": np.bool_(True)})
