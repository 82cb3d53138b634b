"""One epoch of a ``GlobalBatchLoader`` (``Epoch``): the consumer's side of the prefetch.

``next()`` takes the next batch the ``Producer`` made (from the ``Prefetcher``'s thread, or
made in place with ``prefetch=0``), already agreed on by the processes when they compare (the
producer exchanges each batch's outcome on the epoch's ``Stream``, off the step's path), counts
it and moves the epoch's ``Cursor``. Closing the epoch ends its stream once the thread has
stopped. The epoch knows the loader only through what it was given (producer, counters,
cursor).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

from torchshard._backend.protocols import Backend
from torchshard._core.agreement import value_check_enabled, value_check_first_batch
from torchshard._core.context import thread_mesh
from torchshard._core.mesh import Mesh
from torchshard.data._position import Cursor
from torchshard.data._prefetch import Prefetcher
from torchshard.data._producer import LOCATED, Ended, Made, Producer, Stream
from torchshard.data._sampler import HostSampler
from torchshard.data._stats import Counters
from torchshard.data._threads import run_job


def _close(
    prefetcher: Prefetcher[Any] | None,
    stream: Stream | None,
    wait: bool = True,
    timeout: float | None = None,
) -> None:
    """Stops the thread, then ends the stream once the thread has stopped (its exchanges may
    still come until then). ``wait=False``: an abandoned epoch's finalizer, which does not join
    a thread blocked in the source; a daemon thread ends the stream when it stops. ``timeout``:
    the most seconds to wait for a thread blocked in the source (``Prefetcher.close``)."""
    if prefetcher is not None:
        prefetcher.close(wait=wait, timeout=timeout)
        if prefetcher.alive:
            if stream is not None:
                _end_later(prefetcher, stream)
            return
    if stream is not None:
        stream.close()


def _end_later(prefetcher: Prefetcher[Any], stream: Stream) -> None:
    """Ends ``stream`` when ``prefetcher``'s thread stops, on a worker of ``_threads`` (a
    daemon, joined for a bounded time at exit)."""

    def end() -> bool:
        prefetcher.wait_finished()
        stream.close()
        return True

    run_job(end, name="torchshard-stream-end")


class Ending:
    """What closing an epoch takes once its iterator may be gone (a ``break`` drops it): its
    thread's prefetcher (weakly: its running job holds it) and its stream. The loader keeps
    it, so that ``close()`` and the next ``iter()`` join an abandoned epoch's thread, whose
    finaliser only told it to stop."""

    def __init__(self, prefetcher: Prefetcher[Any] | None, stream: Stream | None) -> None:
        self._prefetcher = weakref.ref(prefetcher) if prefetcher is not None else None
        self._stream = stream

    def close(self, timeout: float | None = None) -> None:
        """Joins the thread (at most ``timeout`` s; see ``Prefetcher.close``), then ends the
        stream; idempotent."""
        prefetcher = self._prefetcher() if self._prefetcher is not None else None
        _close(prefetcher, self._stream, timeout=timeout)


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
        warmup: how many first batches are the warm-up (1; a DataLoader's worker count when it
            has workers: each worker's first batch waits for that worker's start).
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
        warmup: int = 1,
    ) -> None:
        self._warmup = warmup
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
        self._stream = producer.stream
        self._producer: Producer | None = producer
        self._prefetcher: Prefetcher[Any] | None = None
        self._closed = False
        self._ended_by: str | None = None  # what ended it mid-epoch (``end``), for next()
        self._handed: float | None = None  # when the last batch was handed over (perf_counter)
        self._taken = 0  # batches handed over in this epoch
        if prefetch:
            mesh, first = producer.mesh, producer.first
            producer.background = True
            backend = producer.backend
            # With the processes compared, each batch's outcome exchange ends after the next
            # batch is made (see _producer): one batch more than ``prefetch`` is in flight, so
            # that ``prefetch`` batches stay ready. Not under a byte budget (which would not
            # count it): there the exchange waits at once.
            producer.pipeline = (
                prefetch >= 1
                and prefetch_bytes is None
                and producer.agree
                and not producer.exchange
            )
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
        # Not joined when abandoned (a `break`, an exception, Ctrl-C): joining a thread blocked
        # in a slow source held the exit up 10 s per epoch (22-31 s seen). The stream ends once
        # the thread has stopped (``_close``), so no process is left waiting in an exchange.
        weakref.finalize(self, _close, self._prefetcher, self._stream, False)
        self.ending = Ending(self._prefetcher, self._stream)

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
            ended = end.value if isinstance(end.value, Ended) else Ended(None)
            self.close()
            self._stop(ended.snapshot)
            raise StopIteration from None
        except BaseException:
            self.close()
            raise
        settled = made.settled  # (stop, real rows per process), agreed by the producer
        if settled is not None and settled[0]:  # every process stops here (drop or pad)
            self.close()
            self._stop(made.snapshot if self._policy == "pad" else None)
            raise StopIteration
        try:
            # every batch with set_value_check(True); by default the first of each epoch, so
            # that a feed giving processes that share a block different examples is never
            # silent (a no-op on one process; bounded by the timeout like every exchange)
            first = self._taken == 0 and value_check_first_batch()
            if (made.compared and value_check_enabled()) or first:
                what = f"GlobalBatchLoader: batch {self._next}"
                checks = self._backend.processes
                if checks is not None:
                    batch = made.batch[0] if self._policy == "pad" else made.batch
                    checks.check_values(self._mesh, batch, argname="batch", what=what, force=first)
        except BaseException:
            self.close()
            raise
        if made.ready is not None:  # this thread's stream waits for this batch's copies
            made.ready()
        now = time.perf_counter()
        handed = self._handed
        if handed is None or self._taken < self._warmup:  # the epoch's warm-up batch(es)
            self._counters.add(
                batches=1, wait_seconds=now - t0, warmup_batches=1, warmup_wait_seconds=now - t0
            )
        else:  # a step: from the previous hand-over to this one
            self._counters.add(batches=1, wait_seconds=now - t0, step_seconds=now - handed)
        self._handed = now
        self._taken += 1
        rows = sum(settled[1]) if settled is not None else self._processes * made.rows
        self._yielded += made.rows
        self._cursor.advance(made.snapshot, self._examples(rows))
        self._next += 1
        if self._stream is not None:
            self._stream.taken += 1
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
                if not getattr(e, LOCATED, False):
                    e.add_note(f"(raised by GlobalBatchLoader at batch {self._next})")
                raise

    def end(self, by: str) -> None:
        """Closes the epoch because of ``by`` (``"a later iter()"``): unless it had already
        ended, its next ``next()`` raises ``RuntimeError`` naming ``by`` instead of ending the
        epoch silently mid-way."""
        if not self._closed:
            self._ended_by = by
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Stops the background thread, frees queued batches and ends the epoch's stream of
        exchanges (idempotent); ``timeout``: see ``GlobalBatchLoader.close``."""
        self._closed = True
        _close(self._prefetcher, self._stream, timeout=timeout)
        self._producer = None
