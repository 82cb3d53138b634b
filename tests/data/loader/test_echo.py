"""DataLoader workers that echo one stream (torchshard.data._loader.echo): the
``ShardingError`` at the first batch when a DataLoader's workers all read the whole stream, on
torch_xla and on every gloo process at the same batch; map-style sources and one worker are not
checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import torchshard as ts
from torchshard.data._loader import echo

CASES = "_loader_cases:"


class Unsplit(IterableDataset):
    """A stream every copy reads whole."""

    def __iter__(self):
        for i in range(32):
            yield {"id": np.int64(i), "x": np.full(2, i, np.float32)}


def test_workers_that_read_the_same_stream_raise_at_the_first_batch(mesh8):
    source = DataLoader(Unsplit(), batch_size=8, num_workers=2)
    loader = ts.GlobalBatchLoader(source, prefetch=0)
    msg = (
        "GlobalBatchLoader: batch 0: the DataLoader has 2 worker processes over a stream "
        "(IterableDataset), and workers [0, 1] yielded the same first batch: each of them reads "
        "the whole stream, so its examples would come several times. Split the stream by worker "
        "inside the dataset's __iter__: index, count = torchshard.stream_shard() (over the "
        "processes and the workers) and read shard index of count (HF datasets: "
        "split_dataset_by_node(ds, rank=index, world_size=count) in the main process; datasets "
        "splits by worker itself). If the stream is split and its examples are equal on purpose "
        "(synthetic data such as zeros), pass GlobalBatchLoader(..., allow_equal_batches=True)."
    )
    with pytest.raises(ts.ShardingError) as info:
        next(iter(loader))
    assert str(info.value) == msg


class SyntheticZeros(IterableDataset):
    """A stream split by worker (``stream_shard``) whose 32 examples are all zeros: each
    worker reads its own 16, which happen to be equal."""

    def __iter__(self):
        index, count = ts.stream_shard()
        for _ in range(index, 32, count):
            yield {"x": np.zeros(2, np.float32)}


def test_equal_examples_meant_are_said_with_allow_equal_batches(mesh8):
    def loader(**kw):
        source = DataLoader(SyntheticZeros(), batch_size=8, num_workers=2)
        return ts.GlobalBatchLoader(source, **kw)

    with pytest.raises(ts.ShardingError, match=r"allow_equal_batches=True\)\."):
        next(iter(loader()))
    rows = [b["x"].shape[0] for b in loader(allow_equal_batches=True)]
    assert rows == [8] * 4  # every example once: the stream was split
    with pytest.raises(TypeError, match=r"allow_equal_batches: expected a bool, but got 'yes'\."):
        ts.GlobalBatchLoader([], allow_equal_batches="yes")


def test_a_map_style_source_or_one_worker_is_not_checked():
    assert echo.stream_workers(DataLoader(Unsplit(), num_workers=1)) == 0
    assert echo.stream_workers(DataLoader(list(range(4)), num_workers=2)) == 0
    assert echo.stream_workers([1, 2]) == 0
    assert echo.stream_workers(DataLoader(Unsplit(), num_workers=2)) == 2
    batch = {"x": torch.arange(4)}
    assert echo.echo_error([batch, {"x": torch.arange(4) + 1}], 2, host=None, batch=0) is None
    assert echo.echo_error([batch], 2, host=None, batch=0) is None  # one batch in all
    error = echo.echo_error([batch, batch], 2, host=1, batch=0)
    assert "host 1's DataLoader has 2 worker processes" in str(error)


# -- gloo processes ---------------------------------------------------------------------------


def test_gloo_workers_that_read_the_same_stream_raise_on_every_process(pools):
    results = pools(2).run(CASES + "stream_workers", split=False)
    for r in results:
        assert r["error"].startswith(
            "ShardingError: GlobalBatchLoader: batch 0: the DataLoader has 2 worker processes "
            "over a stream (IterableDataset), and workers [0, 1] yielded the same first batch"
        )
        assert r["got"] == []
        assert r["after"] == (2, 2)  # every process raised at the same batch: still in step
