"""The loader's daemon threads, reused from one prefetcher's run to the next (standard library
only).

A ``ReusedThread`` runs one job at a time (a ``Prefetcher``'s run, ``prefetch.py``). When a job
returns ``True`` (its run *ended* by itself: the source ran out, or failed), the thread is
*parked*: it waits up to ``PARK_SECONDS`` for the next job to adopt it (``run_job``), and exits
if none does. A job that returns ``False`` (its run was *retired*: closed from outside, by
``close()`` mid-epoch or an abandoned iterator's finaliser) ends its thread, so that ``close()``
can join it.

Why: glibc gives each thread a malloc arena, and once every arena exists (``8 x cores``, soon
reached next to torch_xla's threads) a new thread takes the next arena in turn. A new thread
per epoch therefore spread the loader's transfer buffers over every arena, each keeping its own
high-water mark, while the memory in use stayed flat: RSS grew by tens of MB more over 16
epochs than on one thread across epochs (the figures: docs/design.md, "Memory over epochs").

A parked worker holds nothing of the run it made (the job is dropped before parking; the first
job is not a ``Thread`` argument, which ``Thread`` would keep) and is named ``PARKED_NAME`` while
it waits.

The pool owns its state (the parked and the running workers); process exit (``exit.py``) closes
it (``close_pool``) and joins what still runs, and a forked child forgets it.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

PARK_SECONDS = 1.0  # how long a parked thread waits to be adopted by the next job
PARKED_NAME = "torchshard-parked"

# A job runs on the thread and returns whether the thread may park (False: it exits).
Job = Callable[[], bool]


class _Pool:
    """The parked threads, and the lock that orders adoption against a parked worker's expiry."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parked: list[ReusedThread] = []
        self.running: set[ReusedThread] = set()  # every worker started and not yet ended
        self.closing = False  # close_pool() ran (the process exits): no worker parks any more

    def forget(self) -> None:
        """In a forked child: none of the parent's threads exist (and the lock may be held)."""
        self.lock = threading.Lock()
        self.parked = []
        self.running = set()
        self.closing = False


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL.forget)


class ReusedThread:
    """One daemon thread; use ``run_job`` rather than making one directly."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # None: exit
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _loop(self) -> None:
        try:
            job = self.jobs.get_nowait()  # run_job puts it before starting the thread
            while job is not None:
                try:
                    park = job()
                except BaseException:  # noqa: BLE001 - thread boundary; jobs report their own
                    park = False
                job = None  # a parked worker keeps nothing of the run it made
                if park:
                    job = self._park()
        finally:
            with _POOL.lock:
                _POOL.running.discard(self)

    def _park(self) -> Job | None:
        self.thread.name = PARKED_NAME
        with _POOL.lock:
            if _POOL.closing:  # the interpreter is exiting: end instead
                return None
            _POOL.parked.append(self)
        try:
            return self.jobs.get(timeout=PARK_SECONDS)
        except queue.Empty:
            pass
        with _POOL.lock:
            if self in _POOL.parked:  # nobody adopted it: exit
                _POOL.parked.remove(self)
                return None
        # Adopted at the last moment: run_job put the job under the lock, so it is there.
        return self.jobs.get_nowait()


def run_job(job: Job, *, name: str) -> threading.Thread:
    """Runs ``job`` on a parked worker (renamed ``name``), or on a new one; returns its
    thread."""
    with _POOL.lock:
        while _POOL.parked:
            worker = _POOL.parked.pop()
            if worker.thread.is_alive():
                worker.thread.name = name
                worker.jobs.put(job)  # under the lock: the worker's expiry check sees it adopted
                return worker.thread
        worker = ReusedThread(name)
        _POOL.running.add(worker)
    worker.jobs.put(job)
    worker.thread.start()
    return worker.thread


def close_pool() -> list[threading.Thread]:
    """Ends the parked workers, lets no worker park from now on (new jobs still run, each on a
    thread that then ends), and returns the threads of the workers still running a job. For
    process exit (``exit.py``), which joins them."""
    with _POOL.lock:
        _POOL.closing = True
        for worker in _POOL.parked:
            worker.jobs.put(None)
        _POOL.parked.clear()
        return [w.thread for w in _POOL.running]


def parked_threads() -> list[threading.Thread]:
    """The threads parked now (for tests and the soak benchmark)."""
    with _POOL.lock:
        return [w.thread for w in _POOL.parked]
