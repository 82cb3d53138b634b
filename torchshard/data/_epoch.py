"""One epoch of a ``GlobalBatchLoader`` (``Epoch``): the consumer's side of the prefetch.

``next()`` takes the next batch the ``Producer`` made (from the ``Prefetcher``'s thread, or
made in place with ``prefetch=0``), runs the backend's agreement step on that batch's outcome
(a collective on every process, in program order: never on the loader's thread, whose progress
differs from process to process), counts it and moves the epoch's ``Cursor``. The epoch knows
the loader only through what it was given (producer, counters, cursor).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torchshard._backend.protocols import Backend
from torchshard._core.agreement import outcome_disagreement, value_check_enabled
from torchshard._core.context import thread_mesh
from torchshard._core.mesh import Mesh
from torchshard.data._position import Cursor
from torchshard.data._prefetch import Prefetcher
from torchshard.data._producer import OUTCOME, Ended, Made, Producer
from torchshard.data._stats import Counters


@contextlib.contextmanager
def _loader_thread(mesh: Mesh, backend: Backend) -> Iterator[None]:
    """The loader thread's set-up, before any copy: this process's device of the mesh made
    current (``DeviceThreads.bind_thread``; the current device is per thread), and the mesh."""
    if backend.threads is not None:
        backend.threads.bind_thread(mesh)
    with thread_mesh(mesh):
        yield


class Epoch(Iterator[Any]):
    """The iterator of one epoch; closing it (or dropping it) stops its thread.

    Args:
        producer: makes the epoch's batches (the thread owns it when ``prefetch > 0``).
        prefetch: the most batches made ahead of the consumer (0: made inside ``next()``).
        counters: the loader's counters (batches, wait seconds).
        cursor: this epoch's position, moved as the consumer takes batches.
    """

    def __init__(
        self, producer: Producer, prefetch: int, *, counters: Counters, cursor: Cursor
    ) -> None:
        self._mesh = producer.mesh
        self._backend = producer.backend
        self._counters = counters
        self._cursor = cursor
        self._next = producer.first
        self._producer: Producer | None = producer
        self._prefetcher: Prefetcher[Any] | None = None
        self._closed = False
        self._ended_by: str | None = None  # what ended it mid-epoch (``end``), for next()
        if prefetch:
            mesh, first = producer.mesh, producer.first
            producer.background = True
            backend = producer.backend
            self._prefetcher = Prefetcher(
                producer,
                depth=prefetch,
                name="torchshard-loader",
                context=lambda: _loader_thread(mesh, backend),
                where=lambda i: f"batch {first + i}",
            )
            self._producer = None  # the thread owns it now
            # Not joined when abandoned (collected, or at exit after Ctrl-C): joining a thread
            # blocked in a slow source held the exit up 10 s per epoch (22-31 s seen).
            weakref.finalize(self, functools.partial(self._prefetcher.close, wait=False))

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> Any:
        if self._closed:
            if self._ended_by is not None:
                raise RuntimeError(
                    f"GlobalBatchLoader: this iterator was ended before batch {self._next} by "
                    f"{self._ended_by} on the same loader; a loader runs one epoch at a time, "
                    "and each iter() starts a new one (the source's position moves with it). "
                    "Use the newest iterator, or make a second GlobalBatchLoader for a second "
                    "stream."
                )
            raise StopIteration
        t0 = time.perf_counter()
        try:
            if self._prefetcher is not None:
                made = self._prefetcher.get()
            else:
                made = self._produce_here()
        except StopIteration as end:
            ended = end.value if isinstance(end.value, Ended) else Ended(None, None)
            self.close()
            self._agree(ended.outcome, None, None)
            self._cursor.end(ended.snapshot)
            raise StopIteration from None
        except Exception as e:
            self.close()
            self._agree(getattr(e, OUTCOME, None), None, e)
            raise
        except BaseException:
            self.close()
            raise
        try:
            self._agree(made.outcome, made.where, None)
            if made.outcome is not None and value_check_enabled():
                what = f"GlobalBatchLoader: batch {self._next}"
                checks = self._backend.processes
                if checks is not None:
                    checks.check_values(self._mesh, made.batch, argname="batch", what=what)
        except BaseException:
            self.close()
            raise
        if made.ready is not None:  # this thread's stream waits for this batch's copies
            made.ready()
        self._counters.add(batches=1, wait_seconds=time.perf_counter() - t0)
        self._cursor.advance(made.snapshot)
        self._next += 1
        return made.batch

    def _agree(
        self,
        outcome: list[str] | None,
        where: Callable[[int], str] | None,
        error: BaseException | None,
    ) -> None:
        """The agreement step on batch ``self._next``'s outcome (a collective on every process,
        in program order): raises ``ProcessDisagreementError`` on every process whose outcome is
        a batch or the end when the outcomes differ; a process whose outcome is ``error`` gets
        a note on it instead (its caller re-raises it)."""
        if outcome is None:
            return
        what = f"GlobalBatchLoader: batch {self._next}"
        checks = self._backend.processes
        every = None if checks is None else checks.exchange(self._mesh, outcome, what=what)
        if every is None:
            return
        problem = outcome_disagreement(
            what,
            every,
            where or (lambda i: f"GlobalBatchLoader: batch {self._next}: leaf {i}"),
        )
        if error is not None:
            error.add_note(f"(the other processes' outcomes differ: {problem})")
            return
        raise problem

    def _produce_here(self) -> Made:
        producer = self._producer
        if producer is None:
            raise StopIteration
        with thread_mesh(self._mesh):
            try:
                return producer(self._next - producer.first)
            except StopIteration:
                raise
            except Exception as e:
                e.add_note(f"(raised by GlobalBatchLoader at batch {self._next})")
                raise

    def end(self, by: str) -> None:
        """Closes the epoch because of ``by`` (``"a later iter()"``): unless it had already
        ended, its next ``next()`` raises ``RuntimeError`` naming ``by`` instead of ending the
        epoch silently mid-way."""
        if not self._closed:
            self._ended_by = by
        self.close()

    def close(self) -> None:
        """Stops the background thread and frees queued batches (idempotent)."""
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._producer = None
