"""A loader's counters (torchshard.data._stats): ``LoaderStats``, the frozen value, and
``Counters``, added to from the loader's thread and its consumer's under a lock; through a
loader, its len() and stats."""

import dataclasses
import re
import threading

import numpy as np
import pytest

import torchshard as ts
from torchshard.data._stats import Counters, LoaderStats


def endless():
    i = 0
    while True:
        yield {"id": np.arange(8) + i}
        i += 1


def test_len_and_stats(mesh42):
    source = [{"id": np.arange(8), "x": np.ones((8, 4), np.float32)}] * 5
    loader = ts.GlobalBatchLoader(source)
    assert len(loader) == 5
    assert loader.stats == ts.data.LoaderStats()
    list(loader)
    stats = loader.stats
    assert (stats.batches, stats.bytes) == (5, 5 * (8 * 8 + 8 * 4 * 4))
    assert stats.wait_seconds >= 0 and stats.transfer_seconds > 0
    msg = "GlobalBatchLoader: the source (generator) has no len()."
    with pytest.raises(TypeError, match=re.escape(msg)):
        len(ts.GlobalBatchLoader(endless()))


def test_loader_stats_is_a_frozen_value_of_zeros():
    stats = LoaderStats()
    assert (stats.batches, stats.bytes, stats.wait_seconds, stats.transfer_seconds) == (0, 0, 0, 0)
    assert ts.data.LoaderStats is LoaderStats
    assert stats == LoaderStats(0, 0, 0.0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.batches = 1
    assert [f.name for f in dataclasses.fields(LoaderStats)] == [
        "batches",
        "bytes",
        "wait_seconds",
        "transfer_seconds",
        "dropped_examples",
    ]


def test_counters_add_to_the_named_fields():
    counters = Counters()
    before = counters.value
    counters.add(batches=1, wait_seconds=0.5)
    counters.add(bytes=64, transfer_seconds=0.25)
    counters.add(batches=2)
    assert counters.value == LoaderStats(
        batches=3, bytes=64, wait_seconds=0.5, transfer_seconds=0.25
    )
    assert before == LoaderStats()  # a value: never changed in place
    with pytest.raises(AttributeError):
        counters.add(frames=1)  # no such counter
    assert counters.value.batches == 3


def test_counters_from_two_threads_lose_nothing():
    counters = Counters()
    barrier = threading.Barrier(2, timeout=10)

    def add(**delta):
        barrier.wait()
        for _ in range(2000):
            counters.add(**delta)

    threads = [
        threading.Thread(target=add, kwargs={"batches": 1, "wait_seconds": 0.5}, name="consumer"),
        threading.Thread(target=add, kwargs={"bytes": 3, "transfer_seconds": 0.25}, name="loader"),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert counters.value == LoaderStats(
        batches=2000, bytes=6000, wait_seconds=1000.0, transfer_seconds=500.0
    )
