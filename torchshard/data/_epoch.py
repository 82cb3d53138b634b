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
from torchshard._core.errors import ProcessDisagreementError
from torchshard._core.mesh import Mesh
from torchshard.data._ends import settle
from torchshard.data._position import Cursor
from torchshard.data._prefetch import Prefetcher
from torchshard.data._producer import OUTCOME, Ended, Made, Producer
from torchshard.data._sampler import HostSampler
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
        counters: the loader's counters (batches, wait seconds, dropped examples).
        cursor: this epoch's position, moved as the consumer takes batches.
        processes: the number of processes (each one's batch counts in the global position).
        share: ``(shards, hosts)``: the examples of a global batch are the processes' real rows
            times ``shards / hosts`` (``hosts``: the sources of every process; replicas that
            read the same shard count once); ``None``: the position is not kept.
        samplers: the sources' ``HostSampler``s (their pass restarts at 0 after the epoch).
        prefetch_bytes: the most bytes of batches made ahead (``None``: only ``prefetch``).
    """

    def __init__(
        self,
        producer: Producer,
        prefetch: int,
        *,
        counters: Counters,
        cursor: Cursor,
        processes: int = 1,
        share: tuple[int, int] | None = None,
        samplers: list[HostSampler] | None = None,
        prefetch_bytes: int | None = None,
    ) -> None:
        self._mesh = producer.mesh
        self._backend = producer.backend
        self._counters = counters
        self._cursor = cursor
        self._policy = producer.policy
        self._exchange = producer.exchange
        self._tally = producer.tally
        self._yielded = 0  # real examples of this process's sources yielded in this epoch
        self._processes = processes
        self._share = share
        self._samplers = samplers or []
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
                budget=prefetch_bytes,
                size=lambda made: made.nbytes if isinstance(made, Made) else 0,
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
            self._stop(ended.snapshot)
            raise StopIteration from None
        except Exception as e:
            self.close()
            self._agree(getattr(e, OUTCOME, None), None, e)
            raise
        except BaseException:
            self.close()
            raise
        try:
            settled = self._agree(made.outcome, made.where, None)
        except BaseException:
            self.close()
            raise
        if settled is not None and settled[0]:  # every process stops here (drop or pad)
            self.close()
            self._stop(made.snapshot if self._policy == "pad" else None)
            raise StopIteration
        try:
            if made.outcome is not None and value_check_enabled():
                what = f"GlobalBatchLoader: batch {self._next}"
                checks = self._backend.processes
                if checks is not None:
                    batch = made.batch[0] if self._policy == "pad" else made.batch
                    checks.check_values(self._mesh, batch, argname="batch", what=what)
        except BaseException:
            self.close()
            raise
        if made.ready is not None:  # this thread's stream waits for this batch's copies
            made.ready()
        self._counters.add(batches=1, wait_seconds=time.perf_counter() - t0)
        rows = sum(settled[1]) if settled is not None else self._processes * made.rows
        self._yielded += made.rows
        self._cursor.advance(made.snapshot, self._examples(rows))
        self._next += 1
        return made.batch

    def _examples(self, rows: int) -> int:
        """The global batch's examples of the epoch's order (``rows``: every process's)."""
        if self._share is None:
            return 0
        shards, hosts = self._share
        return rows * shards // hosts

    def _stop(self, snapshot: list[Any] | None) -> None:
        """The epoch ends (its sources' end, or every process stopping together): counts what
        the drop policy dropped, restarts the samplers' pass and moves the cursor to the next
        epoch."""
        if self._policy == "drop":
            dropped = self._tally.read - self._yielded
            if dropped:
                self._counters.add(dropped_examples=dropped)
        for sampler in self._samplers:
            sampler.resume(sampler.epoch, 0)
        self._cursor.end(snapshot)

    def _agree(
        self,
        outcome: list[str] | None,
        where: Callable[[int], str] | None,
        error: BaseException | None,
    ) -> tuple[bool, list[int]] | None:
        """The agreement step on batch ``self._next``'s outcome (a collective on every process,
        in program order): raises ``ProcessDisagreementError`` on every process whose outcome is
        a batch or the end when the outcomes differ; a process whose outcome is ``error`` gets
        a note on it instead (its caller re-raises it). With ``last_batch="drop"``/``"pad"`` on
        several processes it runs also with the agreement check off, and returns ``(stop, real
        rows per process)``: every process stops, or goes on, at the same batch."""
        if outcome is None:
            return None
        what = f"GlobalBatchLoader: batch {self._next}"
        checks = self._backend.processes
        if checks is None:
            return None
        every = checks.exchange(self._mesh, outcome, what=what, force=self._exchange)
        paths = where or (lambda i: f"GlobalBatchLoader: batch {self._next}: leaf {i}")
        if self._exchange:
            try:
                return settle(
                    self._policy,
                    every if every is not None else [outcome] * self._processes,
                    what=what,
                    where=paths,
                )
            except ProcessDisagreementError as differ:
                if error is None:
                    raise
                error.add_note(f"(the other processes' outcomes differ: {differ})")
                return None
        if every is None:
            return None
        problem = outcome_disagreement(what, every, paths)
        if error is not None:
            error.add_note(f"(the other processes' outcomes differ: {problem})")
            return None
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
