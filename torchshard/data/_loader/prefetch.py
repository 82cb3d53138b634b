"""Where an epoch's items are made: ahead of the consumer on one named thread (``Prefetcher``),
or inside the consumer's ``get()`` (``InPlace``, ``prefetch=0``). Standard library only.

``Prefetcher(produce, depth=n)`` calls ``produce(0)``, ``produce(1)``, ... on its thread and
hands the results to the consumer in order. At most ``depth`` results are in flight (being
produced or waiting in the queue); the item the consumer holds is not counted, and ``produce``
is not called before a slot is free; with a byte ``budget``, nor while the items in flight
(produced, not yet taken) and one more of the last item's size would exceed it, unless none
is in flight (an item larger than the budget still moves, alone). Design, after
torchdata.nodes' ``_SingleThreadedMapper``:

- A ``BoundedSemaphore(depth)``: the thread acquires a slot before producing, the consumer
  releases it when it takes the item. The queue is unbounded (the semaphore bounds it), so
  ``put`` never blocks. Every blocking call has a timeout (``POLL_SECONDS``) and re-checks the
  run's life; the consumer's wait also notices a thread that finished without a result.
- The end of the items (``produce`` raised ``StopIteration``) and errors travel through the
  queue in order. An error is re-raised at the consumer's ``get()`` for that item as the
  *original* exception object (same type, original traceback), with a note naming the thread
  and ``where``.
- The thread comes from the pool (``threads.py``), and the prefetcher is tracked for process
  exit (``exit.py``). It holds no reference to the consumer-facing object, so an abandoned
  iterator is garbage collected and its finaliser closes the prefetcher.
- **Nobody waits for a thread inside its source.** ``produce`` reads its source through an
  ``Outside`` (``Outside.call``), which knows when the thread is in there: a slow dataset or
  stuck DataLoader workers may keep it there for ever, and there is nothing of torchshard's to
  finish. ``close()`` retires such a run and returns at once (Ctrl-C waited 10 s per epoch
  for it, and ``close()`` after catching it 10 s more); the thread leaves the source by
  raising ``Retired``, so it makes nothing more (no device copy, no exchange: a daemon thread
  inside torch's C++ when the interpreter finalizes aborts the process), and ``on_finish``
  runs at the close instead. A thread anywhere else (placing a batch, in an exchange) is
  waited for, at most ``timeout``.

**The run's life** is one state (``Life``), changed only under the prefetcher's condition and
only along these edges:

========  ========  ==============================================================  ==========
from      to        when                                                            by
========  ========  ==============================================================  ==========
RUNNING   ENDED     the run ended by itself: the end of the items or a failure,    the thread
                    queued for the consumer
RUNNING   RETIRED   ``close()`` came first (mid-epoch, an abandoned iterator's      the closer
                    finaliser, process exit): the thread stops at its next check
ENDED     FINISHED  the job returned (``on_finish`` ran); the thread parks for the  the thread
                    next epoch
RETIRED   FINISHED  the job returned (``on_finish`` ran); the thread ends, and      the thread
                    ``close()`` joins it (unless it is inside its source)
========  ========  ==============================================================  ==========

``close()`` of an ended run changes nothing (the thread parks, as it would have), and
``close()`` is idempotent. ``on_finish`` (the epoch's exchanges closed, ``epoch.py``) runs once,
on the thread once its run is over, whichever way it ended, or at ``close()`` when the thread is
left inside its source: the processes still waiting in an exchange learn of it as soon as this
process makes no more batches.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from torchshard._core.checks import positive_int
from torchshard.data._loader import exit, threads

T = TypeVar("T")
# An exception with this attribute set names where it happened itself: no note is added.
LOCATED = "_torchshard_located"

POLL_SECONDS = 0.05  # every blocking call wakes up this often to check the run's life
JOIN_SECONDS = 10.0  # how long close() waits for a thread that is inside produce()

_log = logging.getLogger(__name__)
_ids = itertools.count()


class Life(enum.Enum):
    """The life of a prefetcher's run (the table in the module's docstring)."""

    RUNNING = "running"
    ENDED = "ended"
    RETIRED = "retired"
    FINISHED = "finished"


#: The only moves ``Life`` makes; ``_move`` refuses any other.
TRANSITIONS: frozenset[tuple[Life, Life]] = frozenset(
    {
        (Life.RUNNING, Life.ENDED),
        (Life.RUNNING, Life.RETIRED),
        (Life.ENDED, Life.FINISHED),
        (Life.RETIRED, Life.FINISHED),
    }
)


class _EndOfItems:
    """``produce`` raised ``StopIteration(value)``: the last entry of the queue."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Failure:
    """An exception raised by ``produce``, with where it happened."""

    __slots__ = ("error", "where")

    def __init__(self, error: BaseException, where: str) -> None:
        self.error = error
        self.where = where


class Retired(BaseException):
    """Raised on a run's thread as it comes back from its source (``Outside.call``) once the
    run was retired: the thread makes nothing more and ends. A ``BaseException``, so that no
    ``except Exception`` on the way (the producer's failure exchange) takes it for a failure."""


class Outside:
    """Where a run's thread is inside its source, outside torchshard (one per run).

    ``produce`` calls its source through ``call``; ``close()`` (``stop``) learns whether the
    thread is in there now, under one lock, so that either the closer sees the thread inside
    (and need not wait: the thread will raise ``Retired`` on its way out) or the thread sees
    the run stopped before it goes in, or when it comes out."""

    __slots__ = ("_inside", "_lock", "_stopped")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = False
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether the run was retired (a source that waits itself polls it)."""
        return self._stopped

    @property
    def inside(self) -> bool:
        """Whether the thread is inside its source now."""
        return self._inside

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a read of the source), marked as outside torchshard; raises
        ``Retired`` instead when the run is retired before or meanwhile."""
        with self._lock:
            if self._stopped:
                raise Retired
            self._inside = True
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._inside = False
                stopped = self._stopped
            if stopped:
                raise Retired  # (the source's own exception, if any, is its context)

    def stop(self) -> bool:
        """Marks the run retired; returns whether the thread is inside its source now (it
        then ends on its way out, whenever the source returns)."""
        with self._lock:
            self._stopped = True
            return self._inside


def _closed(i: int) -> Any:
    raise StopIteration


def _nothing() -> None:
    return None


class Prefetcher(Generic[T]):
    """Runs ``produce(i)`` for ``i = 0, 1, ...`` on a named thread, ``depth`` items ahead.

    Args:
        produce: called with the item index on the background thread; returns the item, or
            raises ``StopIteration`` (its ``value`` is handed to the consumer's
            ``StopIteration``) at the end. Any other exception ends the run and is re-raised
            at the consumer's ``get()`` for that index.
        depth: the most items in flight (>= 1).
        name: the thread's name prefix.
        context: entered on the thread around all calls to ``produce`` (e.g. a mesh context).
        where: formats the index for error notes (default ``"item 7"``).
        budget: the most bytes in flight (``None``: no bound but ``depth``); ``size(item)``
            gives an item's bytes.
        on_finish: called once the run is over (ended or retired), before it counts as
            finished: on the thread, or by ``close()`` when it leaves the thread inside its
            source; its errors are logged, not raised.
        outside: where ``produce`` marks its reads of the source (``Outside.call``); by
            default none is marked, and ``close()`` waits for the thread wherever it is.

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
        on_finish: Callable[[], None] | None = None,
        outside: Outside | None = None,
    ) -> None:
        depth = positive_int(depth, "depth")
        self._produce = produce
        self._context = context
        self._where = where
        self._on_finish = on_finish or _nothing
        self._finished = False  # on_finish ran (or runs): once, on the thread or at close()
        self._outside = outside if outside is not None else Outside()
        self._budget = budget
        self._size = size
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(depth)
        # Guards the run's life and the byte budget's counts; notified on every change.
        self._cond = threading.Condition()
        self._life = Life.RUNNING
        self._held = 0  # bytes of the items produced and not yet taken
        self._last = 0  # the last item's bytes: the estimate of the next one
        self._closed = False  # the consumer's side: no item is handed out after close()
        self.name = f"{name}-{next(_ids)}"
        self._thread = threads.run_job(self._job, name=self.name)
        exit.track(self)

    @property
    def life(self) -> Life:
        """The run's life now."""
        return self._life

    def _move(self, to: Life) -> bool:
        """Moves the run's life to ``to`` if the table allows it from where it is (under the
        condition); returns whether it moved."""
        with self._cond:
            if (self._life, to) not in TRANSITIONS:
                return False
            self._life = to
            self._cond.notify_all()
            return True

    # -- background thread -----------------------------------------------------------------
    def _job(self) -> bool:
        try:
            self._run()
        finally:
            self._finish()
            with self._cond:
                park = self._life is Life.ENDED
                self._move(Life.FINISHED)
        return park

    def _finish(self) -> None:
        """Runs ``on_finish`` once (the thread at the run's end, or ``close()`` for a thread
        it leaves inside the source)."""
        with self._cond:
            if self._finished:
                return
            self._finished = True
        try:
            self._on_finish()
        except Exception:  # noqa: BLE001 - the run's end must not fail
            _log.exception("torchshard's thread %r: closing its epoch failed", self.name)

    def _run(self) -> None:
        try:
            with self._context() if self._context is not None else contextlib.nullcontext():
                self._loop()
        except BaseException as e:  # noqa: BLE001 - thread boundary: hand it to the consumer
            self._end(_Failure(e, "the thread's set-up"))

    def _end(self, entry: _EndOfItems | _Failure) -> None:
        """The run ends by itself with ``entry`` (unless it was retired meanwhile)."""
        self._move(Life.ENDED)
        self._queue.put(entry)

    def _retired(self) -> bool:
        return self._life is Life.RETIRED

    def _loop(self) -> None:
        for i in itertools.count():
            while not self._slots.acquire(timeout=POLL_SECONDS):
                if self._retired():
                    return
            if self._retired():
                return
            if self._budget is not None and not self._wait_for_bytes():
                return
            try:
                item = self._produce(i)
            except StopIteration as end:
                self._end(_EndOfItems(end.value))
                return
            except Retired:  # came back from the source after close(): nothing more
                return
            except BaseException as e:  # noqa: BLE001 - thread boundary: travels in order
                self._end(_Failure(e, self._where(i)))
                return
            if self._budget is not None:
                n = self._size(item)
                with self._cond:
                    self._held += n
                    self._last = n
            self._queue.put(item)

    def _wait_for_bytes(self) -> bool:
        """Waits until one more item fits the byte budget; ``False``: retired meanwhile."""
        assert self._budget is not None
        with self._cond:
            while self._held and self._held + self._last > self._budget:
                self._cond.wait(timeout=POLL_SECONDS)
                if self._life is Life.RETIRED:
                    return False
        return True

    # -- consumer ----------------------------------------------------------------------------
    def get(self) -> T:
        """The next item; raises ``StopIteration`` at the end, or the producer's exception."""
        if self._closed:
            raise StopIteration
        while True:
            try:
                entry = self._queue.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if self._closed:
                    raise StopIteration from None
                if self._life is Life.FINISHED and self._queue.empty():
                    self._closed = True
                    raise RuntimeError(
                        f"the prefetch thread {self.name!r} ended without a result."
                    ) from None
        if isinstance(entry, _EndOfItems):
            self.close()
            raise StopIteration(entry.value)
        if isinstance(entry, _Failure):
            self.close()
            error = entry.error
            if not getattr(error, LOCATED, False):  # an error whose message names its batch
                error.add_note(f"(raised in torchshard's thread {self.name!r} at {entry.where})")
            raise error
        if self._budget is not None:
            with self._cond:
                self._held -= self._size(entry)
                self._cond.notify_all()
        self._slots.release()
        return entry

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Waits until the run is ``FINISHED`` (``True``), or ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._life is Life.FINISHED, timeout=timeout)

    @property
    def alive(self) -> bool:
        """Whether the run is not finished yet (its thread still runs it)."""
        return self._life is not Life.FINISHED

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Closes the run (idempotent): a running one is retired; queued items are dropped; and
        the thread is waited for, at most ``timeout`` seconds (``None``: ``JOIN_SECONDS``),
        unless it is inside its source (``Outside``): it is left there, to end when the source
        returns, making nothing more, and ``on_finish`` runs now. ``wait=False`` or ``timeout
        <= 0`` (an abandoned iterator's finaliser, Ctrl-C, process exit) does not wait at all:
        a retired thread stops at its next check, and a daemon thread does not hold up the
        exit."""
        if timeout is None:
            timeout = JOIN_SECONDS
        elif timeout <= 0:
            wait = False
        self._closed = True
        with self._cond:
            self._move(Life.RETIRED)
            retired = self._life is Life.RETIRED  # its thread ends (an ended run's parks)
        self._drain()
        if retired and self._outside.stop():  # inside its source: nothing to wait for
            self._finish()
            return
        if not wait or self._thread is threading.current_thread():
            return
        if retired:
            self._thread.join(timeout=timeout)
            stopped = not self._thread.is_alive()
        else:
            stopped = self.wait_finished(timeout=timeout)
        if stopped:
            self._produce = _closed  # frees what produce holds (e.g. source iterators)
        else:
            _log.warning(
                "thread %r did not stop within %g s (busy outside its source: placing a batch, or "
                "in an exchange with the other processes); it stops at its next check.",
                self.name,
                timeout,
            )
        self._drain()

    def in_source(self) -> threading.Thread | None:
        """The thread of a retired run that is inside its source now (it ends on its way out
        and makes nothing more: nobody need wait for it), else ``None``."""
        if self._life is Life.RETIRED and self._outside.inside:
            return self._thread
        return None

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


class InPlace(Generic[T]):
    """``prefetch=0``: each item made inside the consumer's ``get()``, with the same interface
    as ``Prefetcher`` (no thread: nothing to join; ``on_finish`` runs at the first ``close()``).

    Args:
        produce: as ``Prefetcher``'s, called on the consumer's thread.
        context: entered around each call to ``produce``.
        note: the note added to an error of ``produce`` (for item ``i``), unless the error
            names where it happened itself (``LOCATED``).
        on_finish: called once, at the first ``close()``.
    """

    def __init__(
        self,
        produce: Callable[[int], T],
        *,
        context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        note: Callable[[int], str] = lambda i: f"(raised at item {i})",
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self._produce: Callable[[int], T] | None = produce
        self._context = context
        self._note = note
        self._on_finish = on_finish or _nothing
        self._i = 0
        self.alive = False

    def get(self) -> T:
        """The next item, made now; raises ``StopIteration`` at the end (and after
        ``close()``), or the producer's exception."""
        produce = self._produce
        if produce is None:
            raise StopIteration
        with self._context() if self._context is not None else contextlib.nullcontext():
            try:
                item = produce(self._i)
            except StopIteration:
                raise
            except BaseException as e:  # KeyboardInterrupt too: it names its batch
                if not getattr(e, LOCATED, False):
                    e.add_note(self._note(self._i))
                raise
        self._i += 1
        return item

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Always ``True``: nothing runs after ``get()`` returns."""
        return True

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Makes no more items and runs ``on_finish`` (once); idempotent."""
        if self._produce is None:
            return
        self._produce = None
        self._on_finish()
