"""Where an epoch's items are made (torchshard.data._loader.prefetch): on a thread, ahead
(``Prefetcher``: order, bound, errors, closing, the run's life moving only along its table), or in
place (``InPlace``, ``prefetch=0``)."""

import contextlib
import re
import threading
import time
import traceback

import pytest
from data_helpers import wait_until

from torchshard.data._loader import prefetch
from torchshard.data._loader.prefetch import Life, Outside, Prefetcher, Retired


def live(prefix="prefetch"):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def counting(n):
    def produce(i):
        if i == n:
            raise StopIteration("the end")
        return i

    return produce


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_items_arrive_in_order_then_stop(depth):
    p = Prefetcher(counting(7), depth=depth)
    assert [p.get() for _ in range(7)] == list(range(7))
    with pytest.raises(StopIteration) as info:
        p.get()
    assert info.value.value == "the end"
    with pytest.raises(StopIteration):  # stays finished
        p.get()
    assert wait_until(lambda: not p.alive)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_never_more_than_depth_in_flight(depth):
    started = []

    def produce(i):
        started.append(i)
        if i == 12:
            raise StopIteration
        return i

    p = Prefetcher(produce, depth=depth)
    for consumed in range(12):
        # Before taking item `consumed`, the thread may have started at most `depth` items
        # beyond the ones already taken; let it fill up, then check it stopped there.
        assert wait_until(lambda c=consumed: len(started) == min(c + depth, 13))
        time.sleep(0.01)
        assert len(started) == min(consumed + depth, 13)
        assert p.get() == consumed
    p.close()


def test_error_reaches_the_consumer_at_its_item_with_the_original_traceback():
    class SourceError(Exception):
        pass

    def produce_item(i):
        if i == 3:
            raise SourceError("bad item")
        return i

    p = Prefetcher(produce_item, depth=2, where=lambda i: f"batch {i}")
    assert [p.get() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(SourceError, match="bad item") as info:
        p.get()
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "produce_item" in frames  # the producer's frame is kept
    assert info.value.__notes__ == [f"(raised in torchshard's thread {p.name!r} at batch 3)"]
    with pytest.raises(StopIteration):
        p.get()
    assert wait_until(lambda: not p.alive)


def test_close_stops_a_blocked_producer_and_is_idempotent():
    p = Prefetcher(counting(1000), depth=2, name="prefetch-close")
    assert p.get() == 0
    p.close()
    p.close()
    assert not p.alive
    assert live("prefetch-close") == []
    with pytest.raises(StopIteration):
        p.get()


def test_context_is_entered_on_the_thread():
    seen = []

    @contextlib.contextmanager
    def ctx():
        seen.append(("enter", threading.current_thread().name))
        yield
        seen.append(("exit", threading.current_thread().name))

    p = Prefetcher(counting(1), depth=1, name="prefetch-ctx", context=ctx)
    assert p.get() == 0
    with pytest.raises(StopIteration):
        p.get()
    assert wait_until(lambda: len(seen) == 2)
    assert seen == [("enter", p.name), ("exit", p.name)]


def test_failing_context_is_reported():
    @contextlib.contextmanager
    def ctx():
        raise RuntimeError("no mesh here")
        yield

    p = Prefetcher(counting(1), depth=1, context=ctx)
    with pytest.raises(RuntimeError, match="no mesh here") as info:
        p.get()
    assert info.value.__notes__[-1].endswith("at the thread's set-up)")


@pytest.mark.parametrize("depth", [0, -1, 1.5, None])
def test_bad_depth(depth):
    with pytest.raises(
        ValueError, match=re.escape(f"depth must be a positive int, but got {depth!r}.")
    ):
        Prefetcher(counting(1), depth=depth)


@pytest.mark.parametrize(("size", "budget", "ahead"), [(100, 250, 2), (100, 300, 3), (100, 50, 1)])
def test_a_byte_budget_bounds_the_items_made_ahead(size, budget, ahead):
    """Items of ``size`` bytes, a budget of ``budget``: the thread makes at most ``ahead``
    items the consumer has not taken (one always moves, even larger than the budget), however
    deep the slots are."""
    started = []

    def produce(i):
        started.append(i)
        if i == 12:
            raise StopIteration
        return i

    p = Prefetcher(produce, depth=8, budget=budget, size=lambda item: size)
    for consumed in range(12):
        assert wait_until(lambda c=consumed: len(started) == min(c + ahead, 13))
        time.sleep(0.01)
        assert len(started) == min(consumed + ahead, 13)  # then it waits for bytes
        assert p.get() == consumed
    with pytest.raises(StopIteration):
        p.get()
    p.close()


def test_close_stops_a_thread_waiting_for_bytes():
    p = Prefetcher(counting(100), depth=4, budget=10, size=lambda item: 10, name="bytes")
    assert wait_until(lambda: len(live("bytes")) == 1)
    time.sleep(0.05)  # it made one item and waits for the budget
    p.close()
    assert wait_until(lambda: not live("bytes"))


def test_close_without_waiting_does_not_join_a_thread_blocked_in_the_source():
    """An abandoned epoch's finalizer closes with ``wait=False``: at exit after Ctrl-C it
    joined a thread blocked in a slow source for JOIN_SECONDS (10 s) per epoch."""
    release = threading.Event()

    def blocked(i):
        release.wait(30)
        raise StopIteration

    p = Prefetcher(blocked, depth=1, name="prefetch-blocked")
    t0 = time.perf_counter()
    p.close(wait=False)
    assert time.perf_counter() - t0 < 1.0
    assert len(live("prefetch-blocked")) == 1  # still inside the source
    release.set()
    wait_until(lambda: not live("prefetch-blocked"), timeout=10)


def test_close_does_not_wait_for_a_thread_inside_its_source(monkeypatch):
    """A thread inside its source (``Outside.call``: a slow dataset, stuck DataLoader workers)
    may stay there for ever. ``close()`` retired the run, then joined the thread for
    ``JOIN_SECONDS``, and again at every later ``close()`` (Ctrl-C, then ``close()``: 20 s).
    Now it returns at once and runs ``on_finish`` (once); the thread, on its way out of the
    source, makes nothing more. ``JOIN_SECONDS`` is an hour here: a wait hangs the test."""
    monkeypatch.setattr(prefetch, "JOIN_SECONDS", 3600.0)
    outside, entered, release = Outside(), threading.Event(), threading.Event()
    after, finished = [], []

    def produce(i):
        if i == 0:
            return 0
        x = outside.call(lambda: entered.set() or release.wait(60))
        after.append(i)  # never runs: the run was retired while the thread was inside
        return x

    p = Prefetcher(
        produce,
        depth=1,
        name="prefetch-inside",
        outside=outside,
        on_finish=lambda: finished.append(1),
    )
    assert p.get() == 0
    assert entered.wait(30)
    p.close()
    p.close()
    assert finished == [1] and p.in_source() is p._thread and p.life is Life.RETIRED
    with pytest.raises(StopIteration):
        p.get()
    release.set()
    assert wait_until(lambda: not p._thread.is_alive())
    assert after == [] and finished == [1] and p.life is Life.FINISHED and p.in_source() is None


def test_a_thread_outside_its_source_is_still_waited_for():
    """Anywhere else (placing a batch, an exchange) the thread is torchshard's own: ``close()``
    waits for it, so that nothing of torch's runs on after the close."""
    outside, busy, release = Outside(), threading.Event(), threading.Event()

    def produce(i):
        busy.set()
        release.wait(60)  # not through the outside: torchshard's own work
        return outside.call(lambda: i)

    p = Prefetcher(produce, depth=1, name="prefetch-busy", outside=outside)
    assert busy.wait(30)
    threading.Timer(0.3, release.set).start()
    p.close()
    assert release.is_set() and not p._thread.is_alive() and p.life is Life.FINISHED


def test_an_outside_stopped_before_the_read_does_not_read():
    outside, calls = Outside(), []
    assert outside.call(lambda: calls.append(0) or "read") == "read"
    assert outside.stop() is False  # not inside now
    with pytest.raises(Retired):
        outside.call(lambda: calls.append(1))
    assert calls == [0] and outside.stopped and not outside.inside


def test_an_outside_stopped_during_the_read_raises_on_the_way_out():
    outside, entered, release, out = Outside(), threading.Event(), threading.Event(), []

    def read():
        try:
            outside.call(lambda: entered.set() or release.wait(30) or "late")
        except Retired as e:
            out.append(e)

    t = threading.Thread(target=read)
    t.start()
    assert entered.wait(30)
    assert outside.inside and outside.stop() is True
    release.set()
    t.join(30)
    assert len(out) == 1 and not outside.inside


# -- the run's life: one state, moved only along the table's edges ------------------------------


def test_a_run_that_ends_by_itself_is_ended_then_finished_and_its_thread_parks():
    from torchshard.data._loader.threads import parked_threads

    p = Prefetcher(counting(2), depth=2, name="prefetch-life")
    assert p.get() == 0 and p.get() == 1
    assert wait_until(lambda: p.life in (Life.ENDED, Life.FINISHED))
    with pytest.raises(StopIteration):
        p.get()
    assert p.wait_finished(timeout=20) and p.life is Life.FINISHED and not p.alive
    p.close()  # an ended run: nothing to retire
    assert p.life is Life.FINISHED
    assert wait_until(lambda: p._thread in parked_threads() or not p._thread.is_alive())


def test_a_run_closed_mid_way_is_retired_then_finished_and_its_thread_ends():
    p = Prefetcher(lambda i: i, depth=1, name="prefetch-retire")
    assert p.get() == 0
    assert p.life is Life.RUNNING
    p.close()
    assert p.life is Life.FINISHED and not p._thread.is_alive()  # joined: it did not park
    with pytest.raises(StopIteration):
        p.get()


def test_the_life_moves_only_along_the_tables_edges():
    from torchshard.data._loader.prefetch import TRANSITIONS

    release = threading.Event()
    p = Prefetcher(lambda i: release.wait(30) and i, depth=1, name="prefetch-edges")
    moved = []
    for start in Life:
        for to in Life:
            with p._cond:
                p._life = start
                if p._move(to):
                    moved.append((start, to))
    assert (
        set(moved)
        == TRANSITIONS
        == {
            (Life.RUNNING, Life.ENDED),
            (Life.RUNNING, Life.RETIRED),
            (Life.ENDED, Life.FINISHED),
            (Life.RETIRED, Life.FINISHED),
        }
    )
    with p._cond:
        p._life = Life.RUNNING
    p.close(wait=False)
    release.set()
    assert p.wait_finished(timeout=20)


@pytest.mark.parametrize("how", ["ended", "failed", "retired"])
def test_on_finish_runs_on_the_thread_once_the_run_is_over_whichever_way(how):
    ran = []

    def produce(i):
        if how == "ended" and i == 1:
            raise StopIteration
        if how == "failed" and i == 1:
            raise OSError("bad record")
        return i

    p = Prefetcher(
        produce,
        depth=1,
        name="prefetch-finish",
        on_finish=lambda: ran.append((threading.current_thread().name, p.life)),
    )
    assert p.get() == 0
    if how == "retired":
        p.close()
    else:
        with pytest.raises(StopIteration if how == "ended" else OSError):
            p.get()
    assert p.wait_finished(timeout=20)
    expected = Life.RETIRED if how == "retired" else Life.ENDED
    assert ran == [(p.name, expected)]  # on the run's thread, before it counts as finished


def test_in_place_items_are_made_inside_get_with_a_note_on_an_error():
    from torchshard.data._loader.prefetch import InPlace

    calls = []

    def produce(i):
        calls.append(threading.current_thread().name)
        if i == 2:
            raise OSError("bad record")
        return i * 10

    here = InPlace(produce, note=lambda i: f"(raised by GlobalBatchLoader at batch {5 + i})")
    assert here.get() == 0 and here.get() == 10
    assert calls == [threading.current_thread().name] * 2 and not here.alive
    with pytest.raises(OSError) as info:
        here.get()
    assert str(info.value) == "bad record"
    assert info.value.__notes__ == ["(raised by GlobalBatchLoader at batch 7)"]


def test_in_place_ends_with_its_source_and_finishes_once_at_the_first_close():
    from torchshard.data._loader.prefetch import InPlace

    finished = []
    here = InPlace(counting(1), on_finish=lambda: finished.append(1))
    assert here.get() == 0
    with pytest.raises(StopIteration) as end:
        here.get()
    assert end.value.value == "the end"
    here.close()
    here.close(timeout=0)
    assert finished == [1] and here.wait_finished()
    with pytest.raises(StopIteration):
        here.get()
