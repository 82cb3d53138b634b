"""The prefetch engine (standard library only): order, bound, errors, shutdown."""

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
from data_helpers import wait_until

import torchshard
from torchshard.data._prefetch import Prefetcher


def live(prefix="prefetch"):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def run_script(path, text):
    """Runs ``text`` as the script ``path`` in a fresh interpreter that imports this
    checkout's torchshard."""
    path.write_text(text)
    root = str(Path(torchshard.__file__).resolve().parents[1])
    return subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": root},
    )


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


def test_ctrl_c_with_the_source_blocked_exits_at_once(tmp_path):
    """Ctrl-C (KeyboardInterrupt) in a loop over a GlobalBatchLoader whose source is blocked:
    the process took JOIN_SECONDS more to exit per open epoch (the finalizer joined the thread).
    The child sets JOIN_SECONDS to 60 s so that a loaded machine cannot blur the two outcomes."""
    pytest.importorskip("torch_xla", reason="the child process places on torch_xla")
    out = run_script(
        tmp_path / "interrupted.py",
        "import threading, time, numpy as np, torchshard as ts\n"
        "import torchshard.data._prefetch as prefetch\n"
        "prefetch.JOIN_SECONDS = 60.0\n"
        "ts.setup_cpu_emulation(8)\n"
        "class Slow:\n"
        "    def __iter__(self):\n"
        "        yield {'x': np.zeros((8, 2), np.float32)}\n"
        "        threading.Event().wait(60)\n"
        "with ts.Mesh(np.arange(8), ('data',)):\n"
        "    for batch in ts.GlobalBatchLoader(Slow()):\n"
        "        time.sleep(0.3)\n"
        "        print(time.time(), flush=True)\n"
        "        raise KeyboardInterrupt\n",
    )
    end = time.time()
    assert out.returncode == -2 and "KeyboardInterrupt" in out.stderr, out.stderr[-2000:]  # SIGINT
    interrupted = float(out.stdout.split()[-1])
    assert end - interrupted < 30.0  # before: >= JOIN_SECONDS (60 s)


_BUSY_AT_EXIT = """
import time
import torch
from torchshard.data._prefetch import Prefetcher

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
