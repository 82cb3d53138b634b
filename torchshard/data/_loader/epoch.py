"""One epoch of a ``GlobalBatchLoader`` (``Epoch``): the consumer's side.

``next()`` takes the next batch the ``Producer`` made: on the loader's thread (a ``Prefetcher``,
when the plan's ``background``) or in place (``InPlace``, ``prefetch=0``), chosen once when the
epoch is made. The batch was already agreed on by the processes when they compare (the
producer exchanges each batch's outcome on the epoch's ``Exchanges``, off the step's path);
``next()`` counts it and moves the epoch's ``Cursor``. Whoever makes the batches closes the
exchanges when it makes no more (``on_finish``). Closing the epoch (or dropping it) closes its
maker; the loader keeps a ``Closer`` to join an abandoned epoch's thread. The epoch knows the
loader only through what it was given (plan, producer, counters, cursor).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from torchshard._backend.protocols import Backend
from torchshard._core.agreement import value_check_enabled, value_check_first_batch
from torchshard._core.context import thread_mesh
from torchshard._core.mesh import Mesh
from torchshard._core.topology import Provider, providers
from torchshard.data._loader.cursor import Cursor
from torchshard.data._loader.exchanges import Exchanges
from torchshard.data._loader.plan import EpochPlan
from torchshard.data._loader.prefetch import InPlace, Prefetcher
from torchshard.data._loader.producer import EndOfData, Made, Producer
from torchshard.data._loader.stats import Counters
from torchshard.data._sampler import HostSampler


def uncopyable(how: str, what: str) -> str:
    """The error of ``how`` (``copy.deepcopy``, ...) applied to ``what`` (the loader or one of
    its epochs): neither a thread nor a source's iterator (DataLoader workers) can be copied,
    and a copy sharing them would share or lose the position in the source."""
    return (
        f"{how} of {what} is not supported: it holds the source's iterator (DataLoader "
        "workers), a thread and locks, which a copy would share or lose, and with them the "
        "position in the source. To clone the position, take loader.state_dict() and load it "
        "into a new GlobalBatchLoader over a new source (load_state_dict()); for a second "
        "stream over the same data, make a second GlobalBatchLoader."
    )


class Maker(Protocol):
    """Where an epoch's batches are made: a ``Prefetcher`` or ``InPlace``."""

    def get(self) -> Any: ...

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None: ...


class Closer:
    """What closing an epoch takes once its iterator may be gone (a ``break`` drops it): its
    maker, weakly (a running thread's job holds a ``Prefetcher``). The loader keeps it, so that
    ``close()`` and the next ``iter()`` join an abandoned epoch's thread, whose finaliser only
    retired it."""

    def __init__(self, maker: Maker) -> None:
        self._maker = weakref.ref(maker)

    def close(self, timeout: float | None = None) -> None:
        """Closes the maker and joins its thread (at most ``timeout`` s; see
        ``Prefetcher.close``); idempotent."""
        maker = self._maker()
        if maker is not None:
            maker.close(timeout=timeout)


@contextlib.contextmanager
def _loader_thread(mesh: Mesh, backend: Backend, lent: tuple[Provider, ...]) -> Iterator[None]:
    """The loader thread's set-up, before any copy: this process's device of the mesh made
    current (``DeviceThreads.bind_thread``; the current device is per thread), the mesh and
    the topology providers (``virtual_hosts``) of the thread that started the epoch."""
    if backend.threads is not None:
        backend.threads.bind_thread(mesh)
    with thread_mesh(mesh, providers=lent):
        yield


def _maker(plan: EpochPlan, producer: Producer, exchanges: Exchanges | None) -> Maker:
    """The plan's maker of ``producer``'s batches: a thread ``prefetch`` batches ahead (which
    nobody waits for while it is inside the source: the producer's ``outside``), or each batch
    made inside ``next()``; either closes ``exchanges`` when it makes no more."""
    on_finish = exchanges.close if exchanges is not None else None
    first = plan.first
    lent = providers()  # this (the epoch's) thread's virtual_hosts, for whoever makes batches
    if plan.background:
        mesh, backend = plan.mesh, plan.backend
        return Prefetcher(
            producer,
            depth=plan.prefetch,
            name="torchshard-loader",
            context=lambda: _loader_thread(mesh, backend, lent),
            where=lambda i: f"batch {first + i}",
            budget=plan.prefetch_bytes,
            size=lambda made: made.nbytes if isinstance(made, Made) else 0,
            on_finish=on_finish,
            outside=producer.outside,
        )
    return InPlace(
        producer,
        context=lambda: thread_mesh(plan.mesh, providers=lent),
        note=lambda i: f"(raised by GlobalBatchLoader at batch {first + i})",
        on_finish=on_finish,
    )


class Epoch(Iterator[Any]):
    """The iterator of one epoch; closing it (or dropping it) stops its maker.

    Args:
        plan: the epoch's plan.
        producer: makes the epoch's batches (``producer_for(plan, ...)``).
        counters: the loader's counters (batches, wait seconds, dropped examples).
        cursor: this epoch's position, moved as the consumer takes batches.
        exchanges: the epoch's exchanges (``None`` exactly when the plan has no channel).
        samplers: the sources' ``HostSampler``s (their pass restarts at 0 after the epoch).
    """

    def __init__(
        self,
        plan: EpochPlan,
        producer: Producer,
        *,
        counters: Counters,
        cursor: Cursor,
        exchanges: Exchanges | None = None,
        samplers: list[HostSampler] | None = None,
    ) -> None:
        self._plan = plan
        self._counters = counters
        self._cursor = cursor
        self._exchanges = exchanges
        self._tally = producer.tally
        self._readers = producer.readers  # one-pass sources: the consumer marks what it took
        self._samplers = samplers or []
        self._yielded = 0  # real examples of this process's sources yielded in this epoch
        self._next = plan.first
        self._closed = False
        self._closed_by: str | None = None  # what closed it mid-epoch (``close(by=)``)
        self._handed: float | None = None  # when the last batch was handed over (perf_counter)
        self._taken = 0  # batches handed over in this epoch
        self._maker = _maker(plan, producer, exchanges)
        # Not joined when abandoned (a `break`, an exception, Ctrl-C): joining a thread blocked
        # in a slow source held the exit up 10 s per epoch (22-31 s seen). The maker closes the
        # exchanges once it makes no more, so no process is left waiting in an exchange.
        weakref.finalize(self, self._maker.close, wait=False)
        self.closer = Closer(self._maker)

    def __iter__(self) -> Epoch:
        return self

    def __copy__(self) -> Epoch:
        raise TypeError(uncopyable("copy.copy", "an iterator of a GlobalBatchLoader"))

    def __deepcopy__(self, memo: dict[int, Any]) -> Epoch:
        raise TypeError(uncopyable("copy.deepcopy", "an iterator of a GlobalBatchLoader"))

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(uncopyable("pickle.dumps", "an iterator of a GlobalBatchLoader"))

    def __next__(self) -> Any:
        if self._closed:
            if self._closed_by is not None:
                raise RuntimeError(
                    f"GlobalBatchLoader: this iterator was ended before batch {self._next} by "
                    f"{self._closed_by} on the same loader; a loader runs one epoch at a time, "
                    "and each iter() starts a new one (the source's position moves with it). "
                    "Use the newest iterator, or make a second GlobalBatchLoader for a second "
                    "stream."
                )
            raise StopIteration
        plan = self._plan
        t0 = time.perf_counter()
        try:
            made = self._maker.get()
        except StopIteration as end:
            self.close()
            if isinstance(end.value, EndOfData):  # the end of the epoch (else: closed meanwhile)
                self._stop(end.value.snapshot)
            raise StopIteration from None
        except Exception:
            self.close()
            raise
        except BaseException:  # Ctrl-C in the wait: the thread is not waited for
            self.close(timeout=0)
            raise
        for reader, position in zip(self._readers, made.reads, strict=True):
            reader.taken(position)
        settled = made.settled  # (stop, real rows over the processes), agreed by the producer
        if settled is not None and settled[0]:  # every process stops here (drop or pad)
            self.close()
            self._stop(made.snapshot if plan.policy == "pad" else None)
            raise StopIteration
        try:
            # every batch with set_value_check(True); by default the first of each epoch, so
            # that a feed giving processes that share a block different examples is never
            # silent (a no-op on one process; bounded by the timeout like every exchange)
            first = self._taken == 0 and value_check_first_batch()
            if (made.compared and value_check_enabled()) or first:
                what = f"GlobalBatchLoader: batch {self._next}"
                checks = plan.backend.processes
                if checks is not None:
                    batch = made.batch[0] if plan.policy == "pad" else made.batch
                    checks.check_values(plan.mesh, batch, argname="batch", what=what, force=first)
        except BaseException:
            self.close()
            raise
        if made.ready is not None:  # this thread's device stream waits for this batch's copies
            made.ready()
        now = time.perf_counter()
        handed = self._handed
        if handed is None or self._taken < plan.warmup:  # the epoch's warm-up batch(es)
            self._counters.add(
                batches=1, wait_seconds=now - t0, warmup_batches=1, warmup_wait_seconds=now - t0
            )
        else:  # a step: from the previous hand-over to this one
            self._counters.add(batches=1, wait_seconds=now - t0, step_seconds=now - handed)
        self._handed = now
        self._taken += 1
        rows = settled[1] if settled is not None else plan.processes * made.rows
        self._yielded += made.rows
        self._cursor.advance(made.snapshot, self._examples(rows))
        self._next += 1
        if self._exchanges is not None:
            self._exchanges.count_taken()
        return made.batch

    def _examples(self, rows: int) -> int:
        """The global batch's examples of the epoch's order (``rows``: every process's)."""
        share = self._plan.share
        if share is None:
            return 0
        shards, hosts = share
        return rows * shards // hosts

    def _stop(self, snapshot: list[Any] | None) -> None:
        """The epoch ends (its sources' end, or every process stopping together): counts what
        the drop policy dropped, restarts the samplers' pass and moves the cursor to the next
        epoch."""
        if self._plan.policy == "drop":
            dropped = self._tally.read - self._yielded
            if dropped:
                self._counters.add(dropped_examples=dropped)
        for reader in self._readers:  # what was read and not yielded was dropped by the policy
            reader.taken(reader.position)
        for sampler in self._samplers:
            sampler.resume(sampler.epoch, 0)
        self._cursor.end(snapshot)

    def close(self, timeout: float | None = None, *, by: str | None = None) -> None:
        """Closes the epoch: stops its maker (the thread, or nothing more made in place), frees
        queued batches (idempotent); ``timeout``: see ``GlobalBatchLoader.close``. ``by``: what
        closes it mid-epoch (``"a later iter()"``): unless it had already ended, its next
        ``next()`` raises ``RuntimeError`` naming ``by`` instead of ending the epoch silently
        mid-way."""
        if by is not None and not self._closed:
            self._closed_by = by
        self._closed = True
        self._maker.close(timeout=timeout)
