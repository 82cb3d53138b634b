"""A bounded, ordered prefetcher on one named background thread (standard library only).

``Prefetcher(produce, depth=n)`` calls ``produce(0)``, ``produce(1)``, ... on its thread and
hands the results to the consumer in order. At most ``depth`` results are in flight (being
produced or waiting in the queue); the item the consumer holds is not counted, and ``produce``
is not called before a slot is free; with a byte ``budget``, nor while the items in flight
(produced, not yet taken) and one more of the last item's size would exceed it, unless none
is in flight (an item larger than the budget still moves, alone). Design, after
torchdata.nodes' ``_SingleThreadedMapper``:

- A ``BoundedSemaphore(depth)``: the thread acquires a slot before producing, the consumer
  releases it when it takes the item. The queue is unbounded (the semaphore bounds it), so
  ``put`` never blocks.
- A stop ``Event``; every blocking call has a timeout (``POLL_SECONDS``) and re-checks it. The
  consumer's wait also notices a thread that died.
- The end (``produce`` raised ``StopIteration``) and errors travel through the queue in order.
  An error is re-raised at the consumer's ``get()`` for that item as the *original* exception
  object (same type, original traceback), with a note naming the thread and ``where``.
- ``close()`` is idempotent: it sets the stop event, drops queued items and, when the stream
  had not ended, waits for the thread to exit. It runs at the end of the stream, on error, and
  from the owner's ``close``/finaliser.
- The thread comes from ``_worker``: when the stream ends by itself (the end, or an error) the
  thread is parked and the next ``Prefetcher`` (the next epoch) reuses it; it exits when none
  comes within ``_worker.PARK_SECONDS``. A stream stopped from outside (``close()`` mid-stream,
  an abandoned iterator) ends its thread, and ``close()`` joins it.

The thread holds no reference to the consumer-facing object, so an abandoned iterator is
garbage collected and its finaliser stops the thread.

At interpreter exit (before ``atexit``'s hooks, which tear down torch_xla's runtime and
torch.distributed's stores), every stream still running is stopped and the threads are joined
for at most ``EXIT_SECONDS`` in all (``_threads.shutdown``): a daemon thread left running into
the interpreter's finalization aborts the process when it is inside torch's C++.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from torchshard._core.checks import positive_int
from torchshard.data._threads import run_job, shutdown

T = TypeVar("T")
# An exception with this attribute set names where it happened itself: no note is added.
LOCATED = "_torchshard_located"

POLL_SECONDS = 0.05  # every blocking call wakes up this often to check the stop event
JOIN_SECONDS = 10.0  # how long close() waits for a thread that is inside produce()
EXIT_SECONDS = 2.0  # how long the interpreter's exit waits for all threads, in all

_log = logging.getLogger(__name__)
_ids = itertools.count()


class _End:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Failure:
    """An exception raised by ``produce``, with where it happened."""

    __slots__ = ("error", "where")

    def __init__(self, error: BaseException, where: str) -> None:
        self.error = error
        self.where = where


def _closed(i: int) -> Any:
    raise StopIteration


class Prefetcher(Generic[T]):
    """Runs ``produce(i)`` for ``i = 0, 1, ...`` on a named thread, ``depth`` items ahead.

    Args:
        produce: called with the item index on the background thread; returns the item, or
            raises ``StopIteration`` (its ``value`` is handed to the consumer's
            ``StopIteration``) at the end. Any other exception ends the stream and is re-raised
            at the consumer's ``get()`` for that index.
        depth: the most items in flight (>= 1).
        name: the thread's name prefix.
        context: entered on the thread around all calls to ``produce`` (e.g. a mesh context).
        where: formats the index for error notes (default ``"item 7"``).
        budget: the most bytes in flight (``None``: no bound but ``depth``); ``size(item)``
            gives an item's bytes.

    Example:
        >>> def squares(i):
        ...     if i == 3:
        ...         raise StopIteration
        ...     return i * i
        >>> p = Prefetcher(squares, depth=2)
        >>> [p.get(), p.get(), p.get()]
        [0, 1, 4]
        >>> p.close()
    """

    def __init__(
        self,
        produce: Callable[[int], T],
        *,
        depth: int,
        name: str = "prefetch",
        context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        where: Callable[[int], str] = lambda i: f"item {i}",
        budget: int | None = None,
        size: Callable[[Any], int] = lambda item: 0,
    ) -> None:
        depth = positive_int(depth, "depth")
        self._budget = budget
        self._size = size
        self._bytes = threading.Condition()
        self._held = 0  # bytes of the items produced and not yet taken
        self._last = 0  # the last item's bytes: the estimate of the next one
        self._produce = produce
        self._context = context
        self._where = where
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(depth)
        self._stop = threading.Event()
        self._done = False
        # The job's end: `_ended` (the stream ended by itself: the thread may park) and
        # `_retire` (close() came first: the thread exits and close() joins it) are decided
        # under `_lock`; `_finished` is set when the job has returned.
        self._lock = threading.Lock()
        self._ended = False
        self._retire = False
        self._finished = threading.Event()
        self.name = f"{name}-{next(_ids)}"
        self._thread = run_job(self._job, name=self.name)
        _LIVE.add(self)

    # -- background thread -----------------------------------------------------------------
    def _job(self) -> bool:
        try:
            self._run()
        finally:
            with self._lock:
                park = self._ended and not self._retire
            self._finished.set()
        return park

    def _run(self) -> None:
        try:
            with self._context() if self._context is not None else contextlib.nullcontext():
                self._loop()
        except BaseException as e:  # noqa: BLE001 - thread boundary: hand it to the consumer
            self._finish(_Failure(e, "the thread's set-up"))

    def _finish(self, entry: Any) -> None:
        with self._lock:
            self._ended = True
        self._queue.put(entry)

    def _loop(self) -> None:
        for i in itertools.count():
            while not self._slots.acquire(timeout=POLL_SECONDS):
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            if self._budget is not None and not self._wait_for_bytes():
                return
            try:
                item = self._produce(i)
            except StopIteration as end:
                self._finish(_End(end.value))
                return
            except BaseException as e:  # noqa: BLE001 - thread boundary: travels in order
                self._finish(_Failure(e, self._where(i)))
                return
            if self._budget is not None:
                n = self._size(item)
                with self._bytes:
                    self._held += n
                    self._last = n
            self._queue.put(item)

    def _wait_for_bytes(self) -> bool:
        """Waits until one more item fits the byte budget; ``False``: stopped meanwhile."""
        assert self._budget is not None
        with self._bytes:
            while self._held and self._held + self._last > self._budget:
                self._bytes.wait(timeout=POLL_SECONDS)
                if self._stop.is_set():
                    return False
        return True

    # -- consumer ----------------------------------------------------------------------------
    def get(self) -> T:
        """The next item; raises ``StopIteration`` at the end, or the producer's exception."""
        if self._done:
            raise StopIteration
        while True:
            try:
                entry = self._queue.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if self._stop.is_set():
                    self._done = True
                    raise StopIteration from None
                if self._finished.is_set() and self._queue.empty():
                    self._done = True
                    raise RuntimeError(
                        f"the prefetch thread {self.name!r} ended without a result."
                    ) from None
        if isinstance(entry, _End):
            self.close()
            raise StopIteration(entry.value)
        if isinstance(entry, _Failure):
            self.close()
            error = entry.error
            if not getattr(error, LOCATED, False):  # an error whose message names its batch
                error.add_note(f"(raised in torchshard's thread {self.name!r} at {entry.where})")
            raise error
        if self._budget is not None:
            with self._bytes:
                self._held -= self._size(entry)
                self._bytes.notify()
        self._slots.release()
        return entry

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Waits until the thread's job has returned (``True``), or ``timeout`` seconds."""
        return self._finished.wait(timeout=timeout)

    @property
    def alive(self) -> bool:
        """Whether the background thread is still running this stream."""
        return not self._finished.is_set()

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stops the stream, drops queued items and, if it had not ended, joins the thread
        (idempotent), for at most ``timeout`` seconds (``None``: ``JOIN_SECONDS``). ``wait=False``
        (an abandoned iterator's finalizer, which may run at interpreter exit after Ctrl-C;
        ``close(timeout=0)``) does not wait for a thread blocked inside the source: it exits
        when the source returns, and a daemon thread does not hold up the exit."""
        if timeout is None:
            timeout = JOIN_SECONDS
        elif timeout <= 0:
            wait = False
        self._done = True
        with self._lock:
            if not self._ended:
                self._retire = True  # the thread exits instead of parking
            join = self._retire
        self._stop.set()
        self._drain()
        if not wait:
            self._drain()
            return
        if self._thread is not threading.current_thread():
            if join:
                self._thread.join(timeout=timeout)
                stopped = not self._thread.is_alive()
            else:  # ended by itself: the job returns at once, and the thread parks
                stopped = self._finished.wait(timeout=timeout)
            if stopped:
                self._produce = _closed  # frees what produce holds (e.g. source iterators)
            else:
                _log.warning(
                    "thread %r did not stop within %g s: it is blocked inside the source; it "
                    "exits when the source returns.",
                    self.name,
                    timeout,
                )
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


# Every Prefetcher whose thread may still run (its job holds it until the job returns).
_LIVE: weakref.WeakSet[Prefetcher[Any]] = weakref.WeakSet()


def _stop_at_exit() -> None:
    """Stops every stream and waits for the threads (bounded): none runs into finalization."""
    for prefetcher in list(_LIVE):
        prefetcher.close(wait=False)
    left = shutdown(EXIT_SECONDS)
    if left:
        _log.warning(
            "at exit, torchshard's threads %s did not stop within %g s (blocked inside a "
            "source?); the interpreter may abort if one is inside torch when it finalizes.",
            [t.name for t in left],
            EXIT_SECONDS,
        )


# threading's exit hooks run before atexit's (and before non-daemon threads are joined), so
# the threads stop while torch_xla's runtime and torch.distributed's stores still exist.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_stop_at_exit)
else:  # pragma: no cover - every supported Python has it
    import atexit

    atexit.register(_stop_at_exit)
