"""A loader's counters (torchshard.data._loader.stats): ``LoaderStats``, the frozen value, and
``Counters``, added to from the loader's thread and its consumer's under a lock; through a
loader, its len() and stats."""

import dataclasses
import re
import threading
import types

import numpy as np
import pytest

import torchshard as ts
from torchshard.data._loader.stats import Counters, LoaderStats


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
    msg = "len(GlobalBatchLoader): the source (generator) has no len(), so the epoch's length"
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
        "warmup_batches",
        "warmup_wait_seconds",
        "step_seconds",
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


def test_the_input_wait_fraction_leaves_the_warm_up_out():
    stats = LoaderStats(batches=11, wait_seconds=3.5, warmup_batches=1, warmup_wait_seconds=3.0)
    assert np.isnan(stats.input_wait_fraction)  # no step time yet: not measured
    stats = dataclasses.replace(stats, step_seconds=10.0)
    assert stats.input_wait_fraction == pytest.approx(0.05)
    assert str(stats) == (
        "11 batches, 0 bytes; input wait 5.0% of step time (10 batches after the warm-up); "
        "warm-up: 1 batch(es), 3.00 s waited; 0.00 s transferring"
    )
    assert str(LoaderStats(batches=1, warmup_batches=1)).startswith(
        "1 batches, 0 bytes; input wait not measured yet (it needs an epoch's second batch)"
    )


def _slow_start(n, first_seconds, each_seconds=0.0):
    """A source whose first batch takes ``first_seconds`` (a worker start), the others
    ``each_seconds``."""
    import time

    def source():
        for i in range(n):
            time.sleep(first_seconds if i == 0 else each_seconds)
            yield {"id": np.arange(8) + i}

    return source


class _Epochs:
    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return self.make()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_slow_first_batch_is_the_warm_up_not_the_input_wait(mesh8, prefetch):
    """Before: only raw seconds, and wait_seconds / wall time over a short run was mostly the
    first batch's wait (the DataLoader workers' start)."""
    import time

    loader = ts.GlobalBatchLoader(_Epochs(_slow_start(6, 0.4)), prefetch=prefetch)
    start = time.perf_counter()
    for _ in range(2):  # two epochs: two warm-ups
        for _ in loader:
            time.sleep(0.05)  # the step
    wall = time.perf_counter() - start
    stats = loader.stats
    assert (stats.batches, stats.warmup_batches) == (12, 2)
    # 2 x 0.4 s; with a prefetching thread, less the head start it has on the consumer's wait
    assert stats.warmup_wait_seconds >= (0.8 if prefetch == 0 else 0.5)
    assert stats.warmup_wait_seconds <= stats.wait_seconds
    assert stats.wait_seconds / wall > 0.5  # the newcomer's figure: the warm-up dominates
    assert stats.input_wait_fraction < 0.3  # the step time is the 10 steps' sleeps and waits
    assert stats.step_seconds >= 10 * 0.05


def test_a_source_slower_than_the_step_is_most_of_the_step_time(mesh8):
    loader = ts.GlobalBatchLoader(_Epochs(_slow_start(8, 0.0, 0.08)), prefetch=0)
    for _ in loader:
        pass  # a step that takes no time: the step time is the wait
    stats = loader.stats
    assert stats.warmup_batches == 1
    assert stats.input_wait_fraction > 0.8


class _WithWorkers(list):
    """A source that says it has worker processes, as a DataLoader does (``num_workers``)."""

    num_workers = 3


def test_a_source_with_workers_warms_up_one_batch_per_worker(mesh8):
    """A DataLoader takes batch i from worker i % num_workers: each of the first num_workers
    batches waits for a worker's start (on DTensor with the agreement check, for the slowest
    process's), so they are the warm-up, not the input wait."""
    from torchshard.data._loader.stats import warmup_batches

    assert warmup_batches([[1]]) == 1
    assert warmup_batches([_WithWorkers()]) == 3
    assert warmup_batches([types.SimpleNamespace(num_workers=0)]) == 1
    assert warmup_batches([types.SimpleNamespace(num_workers=True)]) == 1  # not a count
    loader = ts.GlobalBatchLoader(_WithWorkers({"id": np.arange(8) + i} for i in range(5)))
    for _ in range(2):
        list(loader)
    assert (loader.stats.batches, loader.stats.warmup_batches) == (10, 6)
