"""Process exit (torchshard.data._loader.exit): every loader run still going is retired and
every loader thread joined, boundedly, before the interpreter finalizes; the pool is closed (a
parked thread ends at once, none parks again) and a thread blocked in its source is given up
on after the timeout, named in a warning; a forked child forgets the parent's runs."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from data_helpers import run_script, wait_until

import torchshard as ts
from torchshard.data._loader import exit
from torchshard.data._loader import threads as _worker
from torchshard.data._loader.prefetch import Life, Outside, Prefetcher
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


_CTRL_C = """
import sys, threading
import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
import torchshard as ts
from torchshard.data._loader import exit, prefetch

prefetch.JOIN_SECONDS = exit.EXIT_SECONDS = 3600.0  # a wait for the thread outlasts the test

class Stuck(Dataset):  # a slow __getitem__: the read of the second batch never returns
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 4:
            threading.Event().wait(3600)
        return np.full(2, i, np.float32)

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
mesh = ts.create_device_mesh((1,), ("data",), backend="dtensor")
loader = ts.GlobalBatchLoader(DataLoader(Stuck(), batch_size=4), mesh=mesh)
try:
    for batch in loader:
        print("waiting", flush=True)  # in next() for the second batch when Ctrl-C comes
except KeyboardInterrupt as e:
    if sys.argv[1] == "uncaught":
        raise
    print("caught", repr(e), flush=True)
    loader.close()
    print("closed", flush=True)
"""


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("after", ["uncaught", "caught, then close()"])
def test_ctrl_c_with_the_source_blocked_exits_at_once(tmp_path, after):
    """A real SIGINT, to the process group as a terminal sends it, while ``next()`` waits on a
    source stuck in ``__getitem__``. The process exited 13-24 s later: ``next()`` closed the
    epoch joining the thread for ``JOIN_SECONDS`` (10 s) before the ``KeyboardInterrupt`` went
    on, ``close()`` joined it again, and the exit for ``EXIT_SECONDS`` (2 s). The child sets
    both to an hour, so that any such wait outlasts this test's bound (the figures, against
    the plain DataLoader loop: ``python -m benchmarks ctrl_c``)."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C)
    root = str(Path(ts.__file__).resolve().parents[1])
    child = subprocess.Popen(
        [sys.executable, str(script), after.split(",")[0]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=_default_sigint,  # (a job started by `cmd &` in a script ignores SIGINT)
    )
    guard = threading.Timer(120, os.killpg, (child.pid, signal.SIGKILL))  # the hang guard
    guard.start()
    try:
        for line in child.stdout:  # (gloo prints a line of its own first)
            if line == "waiting\n":
                break
        time.sleep(0.3)  # into next()'s wait
        os.killpg(child.pid, signal.SIGINT)
        out, err = child.communicate()  # a wait for the thread lasts an hour: SIGKILL at 120 s
    finally:
        guard.cancel()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    if after == "uncaught":
        assert child.returncode == -signal.SIGINT, err[-2000:]  # Python's exit by SIGINT
        assert err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]
    else:
        assert child.returncode == 0, err[-2000:]
        assert out == "caught KeyboardInterrupt()\nclosed\n", err[-2000:]
    assert "did not stop within" not in err, err[-2000:]


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


def test_at_exit_names_a_thread_still_busy_outside_its_source(monkeypatch, caplog):
    """A thread busy in torchshard's own work (here a ``produce`` that reads no source through
    an ``Outside``) is waited for, ``EXIT_SECONDS`` at most, then named."""
    monkeypatch.setattr(_worker, "_POOL", _worker._Pool())
    monkeypatch.setattr(exit, "EXIT_SECONDS", 0.2)
    release = threading.Event()

    def blocked(i):
        release.wait(60)
        raise StopIteration

    p = Prefetcher(blocked, depth=1, name="exit-blocked")
    with caplog.at_level("WARNING", logger="torchshard.data._loader.exit"):
        exit.at_exit()
    assert p.life is Life.RETIRED  # retired, but still busy
    (record,) = caplog.records
    assert "at exit, torchshard's threads ['exit-blocked-" in record.getMessage()
    assert "did not stop within 0.2 s (busy outside their source: " in record.getMessage()
    release.set()
    assert wait_until(lambda: p.life is Life.FINISHED)


def test_at_exit_does_not_wait_for_a_thread_inside_its_source(monkeypatch, caplog):
    """A thread blocked inside its source (a slow dataset, stuck DataLoader workers) is not
    waited for: it held every exit after Ctrl-C up by ``EXIT_SECONDS``. Retired, it leaves the
    source by ``Retired`` and makes nothing more (``produce`` is not called again, nothing
    after the read runs), and its ``on_finish`` ran at the exit."""
    monkeypatch.setattr(_worker, "_POOL", _worker._Pool())
    monkeypatch.setattr(exit, "EXIT_SECONDS", 60.0)  # a wait would show as a stuck test
    entered, release = threading.Event(), threading.Event()
    outside, after_read, finished, calls = Outside(), [], [], []

    def source():
        entered.set()
        release.wait(60)
        return "late"

    def produce(i):
        calls.append(i)
        x = outside.call(source)
        after_read.append(x)  # never runs: the run was retired meanwhile
        return x

    p = Prefetcher(
        produce, depth=1, name="exit-source", outside=outside, on_finish=lambda: finished.append(1)
    )
    assert entered.wait(30)
    with caplog.at_level("WARNING", logger="torchshard.data._loader.exit"):
        exit.at_exit()  # returns at once
    assert p.in_source() is p._thread and p._thread.is_alive()
    assert finished == [1] and caplog.records == []
    release.set()
    assert wait_until(lambda: p.life is Life.FINISHED and not p._thread.is_alive())
    assert calls == [0] and after_read == [] and finished == [1]  # on_finish ran once


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
