"""A one-pass source read ahead of the consumer (torchshard.data._loader.replay): the batches
read and not taken are kept, and the next epoch yields them first, then reads on; one thread
inside the source at a time. Through ``GlobalBatchLoader``: a generator broken off, closed, or
failed mid-epoch loses nothing and repeats nothing, as the same loops over the generator itself
would (the oracle)."""

import itertools
import threading

import numpy as np
import pytest
from data_helpers import ids, no_loader_thread_left
from hypothesis import given, settings
from hypothesis import strategies as st

import torchshard as ts
from torchshard.data._loader.prefetch import Outside, Retired
from torchshard.data._loader.replay import END, Replay, one_pass
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


def _batches(n=100, start=0):
    return ({"id": np.arange(8) + 8 * i} for i in range(start, n))


def _first_ids(batches):
    return [ids(b)[0] // 8 for b in batches]


def test_one_pass_sources_are_their_own_iterators():
    gen = iter([1, 2])
    assert one_pass(gen, iter(gen))
    data = [1, 2]
    assert not one_pass(data, iter(data))


def test_a_reader_reads_on_and_the_next_starts_at_the_first_batch_not_taken():
    replay, outside = Replay(iter(range(10))), Outside()
    first = replay.reader(outside)
    assert [next(first) for _ in range(5)] == [0, 1, 2, 3, 4]
    first.taken(2)  # the consumer took 0 and 1; 2, 3, 4 were read ahead
    assert replay.kept == 3
    second = replay.reader(outside)
    assert list(second) == list(range(2, 10))  # kept ones first, then the source
    second.taken(second.position)
    assert replay.kept == 0
    assert list(replay.reader(outside)) == []  # the source's end stays the end
    assert replay.read(10, outside) is END


def test_a_reader_waits_for_an_earlier_thread_inside_the_source_and_reads_what_it_brings():
    inside, release = threading.Event(), threading.Event()

    def slow():
        yield 0
        inside.set()
        release.wait(30)
        yield 1
        yield 2

    replay = Replay(slow())
    old, new_outside = Outside(), Outside()
    stale = replay.reader(old)
    assert next(stale) == 0
    stale.taken(1)
    got = []
    t = threading.Thread(target=lambda: got.append(next(stale, None)))
    t.start()
    assert inside.wait(30)  # the old reader is inside the source, reading batch 1
    fresh = replay.reader(new_outside)
    reader = threading.Thread(target=lambda: got.append(list(fresh)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # waits: one thread inside the source at a time
    release.set()
    t.join(30)
    reader.join(30)
    assert got == [1, [1, 2]]  # what the old one read is the new one's first: nothing lost


def test_a_reader_waiting_for_the_source_gives_up_once_its_run_is_stopped():
    inside, release = threading.Event(), threading.Event()

    def slow():
        inside.set()
        release.wait(30)
        yield 0

    replay = Replay(slow())
    holder = threading.Thread(target=lambda: next(replay.reader(Outside()), None))
    holder.start()
    assert inside.wait(30)
    outside = Outside()
    waiting = replay.reader(outside)
    raised = []

    def read():
        try:
            next(waiting)
        except Retired:
            raised.append("Retired")

    t = threading.Thread(target=read)
    t.start()
    outside.stop()
    t.join(30)
    assert raised == ["Retired"] and not t.is_alive()
    release.set()
    holder.join(30)
    assert replay.kept == 1  # the holder's batch, for whoever reads next


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_a_generator_broken_off_then_read_again_loses_no_batch(mesh8, prefetch):
    """The issue's case (``prefetch=3``): ``break`` after 2 batches, then a new loop lost the
    batches read ahead (2, 3, 4) without an error; the second loop began at 5."""
    loader = ts.GlobalBatchLoader(_batches(12), prefetch=prefetch)
    first = []
    for batch in loader:
        first += _first_ids([batch])
        if len(first) == 2:
            break
    assert _first_ids(loader) == list(range(2, 12))
    assert first == [0, 1]
    assert _first_ids(loader) == []  # the generator is spent, as itself would be
    assert no_loader_thread_left()


@pytest.mark.xla
@settings(max_examples=12, deadline=None)
@given(
    stops=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    prefetch=st.integers(0, 4),
    how=st.sampled_from(["break", "close()", "a new iter()"]),
)
def test_every_batch_comes_once_in_order_whatever_the_loops(stops, prefetch, how):
    """Loops that stop after ``stops[k]`` batches each (by ``break``, ``close()``, or a new
    ``iter()`` started mid-epoch), then one loop to the end: the concatenation is the generator
    itself, whatever the read-ahead (the oracle: ``range``)."""
    with ts.Mesh(np.arange(8), ("data",)):
        loader = ts.GlobalBatchLoader(_batches(20), prefetch=prefetch)
        got = []
        for stop in stops:
            it = iter(loader)
            got += _first_ids(itertools.islice(it, stop))
            if how == "close()":
                loader.close()
            elif how == "break":
                del it
        got += _first_ids(loader)
        assert got == list(range(20))
        loader.close()


def test_a_batch_that_failed_is_read_again_by_the_next_epoch(mesh8):
    """A batch the consumer never got (its check failed) is not dropped either: the next
    ``iter()`` gives it again, and raises again."""
    source = iter(
        [{"id": np.arange(8)}, {"id": np.arange(8) + 8}, {"id": np.arange(4)}]
        + [{"id": np.arange(8) + 8 * k} for k in range(3, 6)]
    )
    loader = ts.GlobalBatchLoader(source, prefetch=2)
    it = iter(loader)
    assert _first_ids([next(it), next(it)]) == [0, 1]
    with pytest.raises(ts.ShardingError, match="batch 2"):
        next(it)
    with pytest.raises(ts.ShardingError, match="batch 0"):  # a new epoch counts from 0
        next(iter(loader))
    loader.close()


def test_per_host_one_pass_sources_stay_paired(mesh8):
    """Two virtual hosts' generators, broken off after one batch: the next epoch pairs their
    kept batches as they were read (host 0's rows first)."""

    def host(h):
        for i in range(6):
            yield {"id": np.arange(4) + 100 * h + 4 * i}

    sources = [host(0), host(1)]
    with virtual_hosts(2):
        loader = global_batch_loader_per_host(sources, partition=ts.P("data"), prefetch=3)
        for batch in loader:
            assert ids(batch) == [*range(0, 4), *range(100, 104)]
            break
        rest = [ids(b) for b in loader]
    assert rest == [
        [*range(4 * i, 4 * i + 4), *range(100 + 4 * i, 104 + 4 * i)] for i in range(1, 6)
    ]
