"""Process exit (torchshard.data._loader.exit): every loader run still going is retired and
every loader thread joined, boundedly, before the interpreter finalizes; the pool is closed (a
parked thread ends at once, none parks again) and a thread blocked in its source is given up
on after the timeout, named in a warning; a forked child forgets the parent's runs."""

from __future__ import annotations

import multiprocessing
import threading

from data_helpers import run_script, wait_until

from torchshard.data._loader import exit
from torchshard.data._loader import threads as _worker
from torchshard.data._loader.prefetch import Life, Prefetcher
from torchshard.data._loader.threads import parked_threads

_BUSY_AT_EXIT = """
import time
import torch
from torchshard.data._loader.prefetch import Prefetcher

def produce(i):
    a = torch.ones(32, 32)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        a = torch.mm(a, a) / 32.0  # releases the GIL inside torch's C++
    return a

p = Prefetcher(produce, depth=2, name="prefetch-busy")
p.get()
print("exiting", flush=True)
"""


def test_a_thread_inside_torch_at_exit_does_not_abort_the_process(tmp_path):
    """The interpreter exits while the thread is inside torch ops (the stream never closed).
    The daemon thread was killed as it took the GIL back inside torch's C++: "terminate called
    without an active exception", exit -6, in 6 runs of 6 (and the demo in about 1 of 8 on a
    loaded machine). Now the exit stops the stream and waits for the thread."""
    out = run_script(tmp_path / "busy_at_exit.py", _BUSY_AT_EXIT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "exiting\n" and "terminate called" not in out.stderr


def test_shutdown_ends_the_parked_threads_and_joins_the_running_ones(monkeypatch):
    """At exit (``shutdown``): a parked thread ends at once instead of waiting to be adopted,
    a running job is waited for, and afterwards no thread parks, while jobs still run."""
    monkeypatch.setattr(_worker, "_POOL", _worker._Pool())  # closing stays in this pool
    monkeypatch.setattr(_worker, "PARK_SECONDS", 60.0)  # only shutdown can end the parked one
    parked = _worker.run_job(lambda: True, name="worker-parks")
    assert wait_until(lambda: parked_threads() == [parked])
    release = threading.Event()
    busy = _worker.run_job(lambda: release.wait(0.3) or True, name="worker-busy")
    assert exit.shutdown(timeout=30.0) == []  # busy's job ended by itself after 0.3 s
    assert not parked.is_alive() and not busy.is_alive() and parked_threads() == []
    ran = threading.Event()
    late = _worker.run_job(lambda: ran.set() or True, name="worker-late")
    late.join(timeout=30.0)
    assert ran.is_set() and not late.is_alive()  # ran its job, then ended instead of parking


def test_shutdown_gives_up_on_a_blocked_job_after_its_timeout(monkeypatch):
    monkeypatch.setattr(_worker, "_POOL", _worker._Pool())
    release = threading.Event()
    blocked = _worker.run_job(lambda: release.wait(60) and False, name="worker-blocked")
    assert exit.shutdown(timeout=0.2) == [blocked]
    release.set()
    blocked.join(timeout=30.0)
    assert not blocked.is_alive()


def test_at_exit_retires_every_live_run_and_joins_its_thread(monkeypatch):
    """The hook itself, in this process: a run blocked waiting for a free slot (the consumer
    took nothing) is retired, its thread runs ``on_finish`` and ends, and the hook returns."""
    monkeypatch.setattr(_worker, "_POOL", _worker._Pool())  # closing stays in this pool
    finished = []
    p = Prefetcher(lambda i: i, depth=1, name="exit-live", on_finish=lambda: finished.append(1))
    assert wait_until(lambda: p._queue.qsize() == 1)  # one item made; the next waits for a slot
    exit.at_exit()
    assert p.life is Life.FINISHED and finished == [1]
    assert not p._thread.is_alive()


def test_at_exit_names_a_thread_still_blocked_in_its_source(monkeypatch, caplog):
    monkeypatch.setattr(_worker, "_POOL", _worker._Pool())
    monkeypatch.setattr(exit, "EXIT_SECONDS", 0.2)
    release = threading.Event()

    def blocked(i):
        release.wait(60)
        raise StopIteration

    p = Prefetcher(blocked, depth=1, name="exit-blocked")
    with caplog.at_level("WARNING", logger="torchshard.data._loader.exit"):
        exit.at_exit()
    assert p.life is Life.RETIRED  # retired, but still inside the source
    (record,) = caplog.records
    assert "at exit, torchshard's threads ['exit-blocked-" in record.getMessage()
    assert "did not stop within 0.2 s (blocked inside a source?)" in record.getMessage()
    release.set()
    assert wait_until(lambda: p.life is Life.FINISHED)


def _child_tracks(out):
    out.put(len(exit._LIVE))


def test_a_forked_child_forgets_the_parents_runs():
    release = threading.Event()
    p = Prefetcher(lambda i: release.wait(60) and i, depth=1, name="exit-fork")
    assert p in set(exit._LIVE)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_tracks, args=(out,))
    child.start()
    assert out.get(timeout=60) == 0
    child.join(timeout=60)
    assert child.exitcode == 0
    release.set()
    p.close()
