"""The DataLoader protocol of GlobalBatchLoader (torchshard.data._loader.source): ``sampler``,
``batch_sampler`` and ``dataset`` are the source's (``None`` where it has none), and
``set_epoch`` reaches the source's sampler (or the source), so a new epoch has a new order.
No mesh is needed for any of them."""

import importlib.util
import re

import pytest
import torch
from data_helpers import Rows
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

import torchshard as ts


def test_the_sources_attributes():
    dataset = Rows(16)
    sampler = ts.host_sampler(dataset, {"num_shards": 2, "shard_index": 1})
    source = DataLoader(dataset, batch_size=4, sampler=sampler)
    loader = ts.GlobalBatchLoader(source)
    assert loader.sampler is sampler
    assert loader.batch_sampler is source.batch_sampler
    assert loader.dataset is dataset
    bare = ts.GlobalBatchLoader([{"x": torch.ones(2)}])
    assert (bare.sampler, bare.batch_sampler, bare.dataset) == (None, None, None)


def _order(sampler):
    return list(sampler)


def test_set_epoch_reaches_the_sampler_and_changes_the_order():
    dataset = Rows(64)
    sampler = ts.host_sampler(dataset, {"num_shards": 2, "shard_index": 0})
    loader = ts.GlobalBatchLoader(DataLoader(dataset, batch_size=4, sampler=sampler))
    first = _order(sampler)
    loader.set_epoch(1)
    assert sampler.epoch == 1
    second = _order(sampler)
    assert second != first and len(second) == len(first) == 32
    # the same order as a DistributedSampler of the same shard at epoch 1
    oracle = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)
    oracle.set_epoch(1)
    assert second == list(oracle)
    loader.set_epoch(0)
    assert _order(sampler) == first


class EpochBatchSampler(BatchSampler):
    def __init__(self, sampler):
        super().__init__(sampler, batch_size=2, drop_last=True)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_set_epoch_reaches_a_batch_sampler_and_its_sampler_once_each():
    dataset = Rows(8)
    inner = ts.host_sampler(dataset, {"num_shards": 1, "shard_index": 0})
    batches = EpochBatchSampler(inner)
    source = DataLoader(dataset, batch_sampler=batches)
    ts.GlobalBatchLoader(source).set_epoch(3)
    assert batches.epochs == [3] and inner.epoch == 3


class EpochSource:
    def __init__(self):
        self.epochs = []
        self.sampler = ts.host_sampler(range(8), {"num_shards": 1, "shard_index": 0})

    def __iter__(self):
        return iter([])

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_a_source_with_its_own_set_epoch_gets_it():
    source = EpochSource()
    ts.GlobalBatchLoader(source).set_epoch(2)
    assert source.epochs == [2]
    assert source.sampler.epoch == 0  # the source decides what its epoch means


def test_a_source_without_an_epoch_raises():
    source = DataLoader(Rows(4), batch_size=2, sampler=SequentialSampler(range(4)))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "GlobalBatchLoader.set_epoch(1): the source (DataLoader) has no set_epoch, and "
            "neither has its sampler, batch_sampler or dataset, so its order cannot change per "
            "epoch."
        ),
    ):
        ts.GlobalBatchLoader(source).set_epoch(1)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(
            TypeError, match=re.escape(f"set_epoch: epoch must be an int >= 0, but got {bad!r}.")
        ):
            ts.GlobalBatchLoader(EpochSource()).set_epoch(bad)


class EpochStream(torch.utils.data.IterableDataset):
    """A stream whose order depends on its epoch (HF's ``IterableDataset`` seeds its shuffle
    buffer and shard order so)."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        yield from torch.randperm(8, generator=g).tolist()


def test_set_epoch_reaches_a_streams_dataset():
    # A DataLoader over a stream has an _InfiniteConstantSampler (no set_epoch): the epoch
    # goes to the dataset, which the workers copy at iter() (was: TypeError).
    stream = EpochStream()
    loader = ts.GlobalBatchLoader(DataLoader(stream, batch_size=4, num_workers=0))
    loader.set_epoch(3)
    assert stream.epoch == 3
    assert [x.tolist() for x in DataLoader(stream, batch_size=4)] == [
        torch.randperm(8, generator=torch.Generator().manual_seed(3))[i : i + 4].tolist()
        for i in (0, 4)
    ]


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs HF datasets")
def test_set_epoch_reaches_an_hf_stream_as_hfs_own_set_epoch_does():
    from datasets import Dataset

    def stream():
        rows = Dataset.from_dict({"id": list(range(24))}).to_iterable_dataset(num_shards=4)
        return rows.shuffle(seed=7, buffer_size=8)

    ours = stream()
    loader = ts.GlobalBatchLoader(DataLoader(ours, batch_size=6))
    oracle = stream()
    orders = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        oracle.set_epoch(epoch)  # the oracle: HF's own epoch on its own stream
        got = [int(i) for b in DataLoader(ours, batch_size=6) for i in b["id"]]
        assert got == [row["id"] for row in oracle]
        orders.append(got)
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == list(range(24))
