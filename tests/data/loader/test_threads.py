"""Prefetch threads reused across streams (epochs): a stream that ends by itself parks its
thread for the next one; a stream stopped from outside ends its thread; a parked thread
exits when nobody adopts it, and holds nothing of the stream it ran."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
import weakref

import pytest
from data_helpers import wait_until

from torchshard.data._loader import exit
from torchshard.data._loader import threads as _worker
from torchshard.data._loader.prefetch import Prefetcher
from torchshard.data._loader.threads import PARKED_NAME, parked_threads


def named(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def stream(n, seen=None):
    def produce(i):
        if seen is not None:
            seen.append(threading.get_ident())
        if i == n:
            raise StopIteration
        return i

    return produce


def drain(p):
    out = []
    while True:
        try:
            out.append(p.get())
        except StopIteration:
            return out


@pytest.fixture(autouse=True)
def _no_parked_thread_between_tests(monkeypatch):
    """Each test starts and ends with no parked thread (they would be adopted across tests)."""
    monkeypatch.setattr(_worker, "PARK_SECONDS", 0.5)
    assert wait_until(lambda: not parked_threads() and not named(PARKED_NAME))
    yield
    assert wait_until(lambda: not parked_threads() and not named(PARKED_NAME))


def test_consecutive_streams_run_on_one_thread():
    seen = []
    for _ in range(5):
        p = Prefetcher(stream(3, seen), depth=2, name="prefetch-reuse")
        assert drain(p) == [0, 1, 2]
        p.close()
    assert len(set(seen)) == 1  # every epoch on the same thread
    assert len(named("prefetch-reuse")) == 0
    assert [t.name for t in parked_threads()] == [PARKED_NAME]
    assert wait_until(lambda: not named(PARKED_NAME))  # nobody adopted it: it exits


def test_errors_also_park_the_thread():
    seen = []

    def failing(i):
        seen.append(threading.get_ident())
        raise KeyError("bad")

    p = Prefetcher(failing, depth=1)
    with pytest.raises(KeyError):
        p.get()
    q = Prefetcher(stream(1, seen), depth=1)
    assert drain(q) == [0]
    assert len(set(seen)) == 1


def test_a_stream_closed_mid_way_ends_its_thread_at_once():
    seen = []
    p = Prefetcher(stream(1000, seen), depth=2, name="prefetch-stop")
    assert p.get() == 0
    p.close()
    assert named("prefetch-stop") == [] and parked_threads() == []
    thread = [t for t in threading.enumerate() if t.ident == seen[0]]
    assert thread == []  # joined: gone, not parked


def test_concurrent_streams_get_their_own_threads():
    seen_a, seen_b = [], []
    a = Prefetcher(stream(50, seen_a), depth=1)
    b = Prefetcher(stream(50, seen_b), depth=1)
    assert drain(a) == drain(b) == list(range(50))
    assert set(seen_a).isdisjoint(seen_b)
    assert wait_until(lambda: len(parked_threads()) == 2)  # both parked, none lost
    c = Prefetcher(stream(1), depth=1)
    assert drain(c) == [0]


def test_a_parked_thread_holds_nothing_of_its_run(monkeypatch):
    # Long enough that a loaded machine cannot expire the parked thread before the check; a
    # pool of its own, closed at the end, so that nobody waits for that expiry.
    monkeypatch.setattr(_worker, "_POOL", _worker._Pool())
    monkeypatch.setattr(_worker, "PARK_SECONDS", 60.0)

    class Source:
        def __call__(self, i):
            if i == 2:
                raise StopIteration
            return [i]

    source = Source()
    ref = weakref.ref(source)
    p = Prefetcher(source, depth=2, name="prefetch-held")
    thread = p._thread
    assert drain(p) == [[0], [1]]
    p.close()
    del p, source
    gc.collect()
    # The thread leaves its run's name when it parks. (Not `parked_threads() > 0`: another
    # test's leftover run may adopt a parked thread at any moment; then it is renamed too.)
    assert wait_until(lambda: not thread.name.startswith("prefetch-held"))
    assert ref() is None  # the parked thread keeps no reference to the run's producer
    assert exit.shutdown(timeout=30.0) == []  # the parked thread ends at once


def test_adoption_racing_expiry_never_loses_a_stream(monkeypatch):
    """Streams started just as the parked thread gives up: every one runs to its end."""
    monkeypatch.setattr(_worker, "PARK_SECONDS", 0.002)
    for k in range(300):
        p = Prefetcher(stream(2), depth=1, name="prefetch-race")
        assert drain(p) == [0, 1], k
        p.close()
        time.sleep((k % 4) * 0.001)
    assert wait_until(lambda: not named("prefetch-race"))


def test_context_is_entered_on_the_reused_thread_under_each_streams_name():
    names = []

    def produce(i):
        names.append(threading.current_thread().name)
        raise StopIteration

    for _ in range(3):
        p = Prefetcher(produce, depth=1, name="prefetch-name")
        drain(p)
    assert len(names) == 3 and len(set(names)) == 3
    assert all(n.startswith("prefetch-name-") for n in names)


def _child_has_no_parked_thread(out):
    out.put(len(parked_threads()))


def test_a_forked_child_forgets_the_parked_threads():
    p = Prefetcher(stream(1), depth=1)
    drain(p)
    assert parked_threads()
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_has_no_parked_thread, args=(out,))
    child.start()
    assert out.get(timeout=60) == 0
    child.join(timeout=60)
    assert child.exitcode == 0
