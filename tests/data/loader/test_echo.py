"""Copies of a stream that echo each other (torchshard.data._loader.echo): the
``ShardingError`` at the first batch when a DataLoader's workers all read the whole stream, or
when processes (virtual hosts) that hold different blocks all read it, on torch_xla and on every
gloo process at the same batch; map-style sources and one worker are not checked, nor tp peers
(one block), nor equal batches said to be meant (``allow_equal_batches``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _loader_cases import kept
from torch.utils.data import DataLoader, IterableDataset

import torchshard as ts
from torchshard.data._loader import echo

CASES = "_loader_cases:"


class Unsplit(IterableDataset):
    """A stream every copy reads whole (ids from ``offset``)."""

    def __init__(self, offset=0):
        self.offset = offset

    def __iter__(self):
        for i in range(self.offset, self.offset + 32):
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


FEED_ECHO = (
    "GlobalBatchLoader: batch 0: process 0 (feed 0) and process 1 (feed 1) passed the same "
    "first batch, but under {spec} they hold different blocks of it: each reads the whole "
    "stream (nothing split it by process)"
)


def test_hosts_of_different_blocks_that_read_one_stream_raise_at_the_first_batch(mesh8):
    from torchshard.testing import global_batch_loader_per_host, virtual_hosts

    def loader(**kw):
        sources = [DataLoader(Unsplit(), batch_size=4) for _ in range(2)]
        return global_batch_loader_per_host(sources, partition=ts.P("data"), prefetch=0, **kw)

    with virtual_hosts(2), mesh8:
        with pytest.raises(ts.ShardingError) as e:
            next(iter(loader()))
        assert str(e.value).startswith(FEED_ECHO.format(spec="P('data',)"))
        assert "allow_equal_batches=True" in str(e.value)
        # replicas meant: said so, every batch as it comes
        assert len(list(loader(allow_equal_batches=True))) == 8
        # a map-style source is not checked (its sampler splits it)
        rows = [torch.arange(4) for _ in range(2)]
        same = global_batch_loader_per_host([rows, rows], partition=ts.P("data"), prefetch=0)
        assert len(list(same)) == 2
    # tp peers hold one block: their equal batches are right (hosts 0, 1 and 2, 3 on dp x tp)
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    with virtual_hosts(4), mesh:
        sources = [DataLoader(Unsplit(), batch_size=4) for _ in range(2)]
        sources += [DataLoader(Unsplit(offset=100), batch_size=4) for _ in range(2)]
        peers = global_batch_loader_per_host(sources, partition=ts.P("dp"), prefetch=0)
        assert len(list(peers)) == 8
        sources[2:] = [DataLoader(Unsplit(), batch_size=4) for _ in range(2)]  # feed 0's
        echoed = global_batch_loader_per_host(sources, partition=ts.P("dp"), prefetch=0)
        with pytest.raises(ts.ShardingError, match=r"process 0 \(feed 0\) and process 2"):
            next(iter(echoed))


def test_the_feed_check_compares_feeds_not_hosts():
    same = [("0:abc", [0, 1]), ("1:abc", [2])]
    error = echo.feed_echo_error(same, spec=ts.P("dp"), batch=3)
    assert error is not None and str(error).startswith(
        "GlobalBatchLoader: batch 3: process 0 (feed 0) and process 2 (feed 1)"
    )
    assert echo.feed_echo_error([("0:abc", [0]), ("1:def", [1])], spec=ts.P(), batch=0) is None
    assert echo.is_stream(DataLoader(Unsplit())) and echo.is_stream(Unsplit())
    assert not echo.is_stream(DataLoader(list(range(4)))) and not echo.is_stream([1, 2])


@pytest.mark.parametrize("policy", ["error", "pad"])
def test_gloo_processes_that_read_one_stream_raise_on_every_process(pools, policy):
    results = pools(2).run(CASES + "stream_unsplit", policy=policy, allow=False)
    for r in results:
        assert r["error"].startswith("ShardingError: " + FEED_ECHO.split(", but under")[0]), r[
            "error"
        ]
        assert "allow_equal_batches=True" in r["error"]
        assert r["got"] == []
        assert r["after"] == (2, 2)  # every process raised at the same batch: still in step
    meant = pools(2).run(CASES + "stream_unsplit", policy=policy, allow=True)
    assert [r["error"] for r in meant] == ["no error"] * 2
    ids = [i for i in range(16) if kept(i)][: 12 if policy == "error" else None]
    assert sorted(meant[0]["got"]) == sorted(2 * ids)  # every example twice: meant
    if policy == "pad":  # split by process (uneven lengths): not flagged
        split = pools(2).run(CASES + "stream_unsplit", policy=policy, allow=False, split=True)
        assert [r["error"] for r in split] == ["no error"] * 2
        assert sorted(split[0]["got"]) == [i for i in range(16) if kept(i)]
