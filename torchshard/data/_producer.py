"""What a ``GlobalBatchLoader``'s background thread does for each batch (``Producer``).

Per batch: take one host batch from every source (one per host this process supplies), snapshot
the sources, check the batch against the first one, apply the dispatchers'
``logical_to_physical_batch``, and call the engine (``read``/``plan``/``place``) as
``host_to_global_array`` does, telling the backend it runs on a helper thread (``background``).
Then, when the processes compare (DTensor, agreement check on), it exchanges the batch's
*outcome* (its description, the end of the source, or a failure) on the epoch's ``Stream``:
one bounded store exchange per batch, named by the batch, on the thread that made it, so it
runs ahead of the consumer and off the step's path. Differing outcomes raise at that batch on
every process, before it is handed over: the failing process its own error (with a note), the
others ``ProcessDisagreementError``. It holds no consumer state.

On the loader's thread the exchange is pipelined (``pipeline``): batch ``n``'s exchange begins
when ``n`` is made, the thread makes ``n + 1`` and begins its exchange, and only then waits for
the other processes' outcomes of ``n`` and hands ``n`` over. Waiting at once (as ``prefetch=0``
and a byte budget do) ties every batch to the slowest process's making of that batch, so each
process's thread runs at the pace of the slowest one batch by batch, which a deeper prefetch
does not absorb. One batch later the others have almost always begun ``n``, and the wait is
gone. The batch made ahead is one more than ``prefetch`` in flight (figures: docs/design.md).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torchshard._backend.protocols import ProcessChecks
from torchshard._backend.registry import lookup
from torchshard._core.agreement import END as END_OF_SOURCE
from torchshard._core.agreement import describe, failure, outcome_disagreement
from torchshard._core.errors import (
    CollectiveError,
    IndivisibleError,
    ProcessDisagreementError,
    ShardingError,
)
from torchshard._core.mesh import Mesh
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.spec import DataPartitionType
from torchshard._core.tree import LazyPaths, flatten
from torchshard._mesh.context import current_topology
from torchshard._place.call import read
from torchshard._place.place import to_global
from torchshard.data._batch_check import (
    BatchChecker,
    check_dispatch_feeds,
    host_nbytes,
    indivisible_error,
)
from torchshard.data._ends import EMPTY, END, Template, mask_partition, rows_status, settle
from torchshard.data._prefetch import LOCATED  # the agreement's errors name their batch
from torchshard.data._state import capture, stateful
from torchshard.data._stats import Counters
from torchshard.data._stream import echo_error, stream_workers

__all__ = ["Ended", "Made", "Producer", "Stream", "Tally", "stateful"]


@dataclasses.dataclass(frozen=True)
class Made:
    """What the producer hands the consumer for one batch."""

    batch: Any  # the global batch; with last_batch="pad", ``(batch, mask)``
    snapshot: list[Any] | None
    ready: Callable[[], None] | None = None
    """The batch's hand-off (``DeviceThreads.fence``): the consumer calls it before using the batch,
    so that its stream waits for this batch's copies; ``None``: nothing to wait for."""
    compared: bool = False  # the processes agreed on this batch's outcome
    rows: int = 0  # the real examples of this process's sources in the batch
    nbytes: int = 0  # the host bytes transferred (the prefetch's byte budget counts them)
    settled: tuple[bool, list[int]] | None = None
    """``last_batch="drop"``/``"pad"`` on several processes: ``(stop, real rows per process)``,
    agreed by the processes' exchange of this batch's status (the same on every process)."""


@dataclasses.dataclass(frozen=True)
class _Begun:
    """A batch's outcome whose exchange has begun (pipelined): the batch made, the end of the
    sources, or the failure to make it."""

    n: int
    made: Made | None  # the batch; None: the end (``error is None``) or a failure
    end: Callable[[], list[list[str]] | None]  # waits for the others' outcomes
    snapshot: list[Any] | None = None  # at the end: the sources' states
    error: Exception | None = None
    where: Callable[[int], str] | None = None  # the paths of the batch's leaves


@dataclasses.dataclass(frozen=True)
class Ended:
    """The value of the producer's ``StopIteration``."""

    snapshot: list[Any] | None


class Stream:
    """An epoch's sequence of outcome exchanges (``ProcessChecks.open_stream``): the producer
    runs them, the consumer counts the batches it takes, and ``close`` ends the sequence once
    the producer is stopped (``finished``: the last exchange was the agreed end of the source).
    Holds no reference to the epoch, so an abandoned iterator's finaliser can close it."""

    def __init__(self, checks: ProcessChecks, mesh: Mesh, name: str) -> None:
        self.checks = checks
        self.mesh = mesh
        self.name = name
        self.taken = 0
        self.finished = False
        self.closed = False
        self._lock = threading.Lock()  # the loader and a finaliser's thread may both close it

    def close(self) -> None:
        """Ends the sequence (once): every process still to reach its next exchange, or waiting
        in it, raises naming this process, unless the source ended on every process."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.checks.close_stream(self.mesh, self.name, finished=self.finished, taken=self.taken)


class Tally:
    """The examples an epoch's producer read from its sources (the consumer reads it when the
    epoch stops early, to count what it dropped)."""

    __slots__ = ("read",)

    def __init__(self) -> None:
        self.read = 0


_END = object()


def _judge(
    what: str,
    every: Sequence[Sequence[str]] | None,
    paths: Callable[[int], str],
    error: BaseException | None,
) -> None:
    """The verdict on a batch's outcomes (``every``: each process's, ``None`` when they
    agree): raises their disagreement, or notes it on this process's own ``error`` (a failure
    of the source or the check, which the caller raises)."""
    if every is None:
        return
    problem = outcome_disagreement(what, every, paths)
    if error is not None:
        error.add_note(f"(the other processes' outcomes differ: {problem})")
        return
    setattr(problem, LOCATED, True)
    raise problem


class Producer:
    """Makes global batch ``first + i`` (``self(i)``), on the loader's thread or in ``next()``.

    Args:
        its: one iterator per source (per host this process supplies).
        sources: the sources (snapshotted when every one is stateful).
        dispatchers: one per source, or ``None``.
        spec: the partition (``feed_partition``'s result).
        mesh: the loader's mesh.
        counters: the loader's counters (bytes, transfer seconds).
        first: the index of the first batch (``> 0`` when resuming).
        per_host: the sources are a list of per-host sources (names the paths of errors).
        explicit_partition: ``partition=`` was given (names the fix of a feed mismatch).
        stream: the epoch's exchanges of each batch's outcome (``None``: no exchange).
        agree: the processes compare each batch's description (the agreement check).
        policy: ``last_batch`` (``"error"``, ``"drop"``, ``"pad"``).
        exchange: the processes exchange each batch's status (``"drop"``/``"pad"`` on several
            processes, on ``stream`` even with the agreement check off): after this process's
            end the producer reports it (``"drop"``) or makes padding batches (``"pad"``), and
            every process stops at the batch the exchange settles on.
        full: per source, the rows of a whole batch (its ``batch_size``), else ``None`` (the
            first batch's).
        processes: the number of processes (every process's rows count in the settled batch).
    """

    def __init__(
        self,
        its: list[Iterator[Any]],
        sources: Sequence[Any],
        dispatchers: Sequence[Any] | None,
        spec: Any,
        mesh: Mesh,
        counters: Counters,
        first: int,
        *,
        per_host: bool,
        explicit_partition: bool,
        stream: Stream | None,
        agree: bool = False,
        policy: str = "error",
        exchange: bool = False,
        full: Sequence[int | None] | None = None,
        processes: int = 1,
    ) -> None:
        self.its = its
        self.all_sources = list(sources)
        self.sources = sources if all(stateful(s) for s in sources) else None
        self.dispatchers = dispatchers
        self.per_host = per_host
        self.explicit_partition = explicit_partition
        self.stream = stream
        self.agree = agree and stream is not None
        self.policy = policy
        self.exchange = exchange and stream is not None
        self.stopped = False  # the exchange settled on the end: every process stopped
        self.processes = processes  # an exchange whose items agree returns None: all alike
        self.full = list(full) if full is not None else [None] * len(its)
        self.mask_spec: Any = None  # "pad": the mask's partition, from the first batch
        self.feeds_checked = False  # the layout check runs on the first batch (shapes fixed)
        self.background = False  # set when a thread runs it
        self.spec = spec
        self.mesh = mesh
        self.backend = lookup(mesh)
        self.threads = self.backend.threads
        self.counters = counters
        self.first = first
        self.check = BatchChecker()
        self.tally = Tally()
        n = len(its)
        self.templates: list[Template | None] = [None] * n
        self.ended = [False] * n
        self.pending: list[list[Any]] = [[] for _ in range(n)]
        self.echo_checked = [False] * n
        # Set by the epoch when a thread runs it, the processes compare each batch and nothing
        # but the agreement is exchanged: each batch's exchange ends after the next is made.
        self.pipeline = False
        self.begun: _Begun | None = None  # pipelined: the next batch, its exchange begun

    def snapshot(self) -> list[Any] | None:
        """The sources' states now, deep copies (``None`` unless every source is stateful)."""
        if self.sources is None:
            return None
        return [capture(s) for s in self.sources]

    # -- reading ---------------------------------------------------------------------------
    def _next_of(self, h: int, n: int) -> Any:
        """Host ``h``'s next batch, or ``_END``. A DataLoader whose workers read a stream is
        checked at its first batch: its first batches (one per worker) must differ."""
        if self.pending[h]:
            return self.pending[h].pop(0)
        it = self.its[h]
        if not self.echo_checked[h]:
            self.echo_checked[h] = True
            workers = stream_workers(self.all_sources[h])
            if workers:
                first = []
                for _ in range(workers):
                    x = next(it, _END)
                    if x is _END:
                        break
                    first.append(x)
                error = echo_error(first, workers, host=h if self.per_host else None, batch=n)
                if error is not None:
                    raise error
                self.pending[h] = first[1:]
                return first[0] if first else _END
        return next(it, _END)

    def _pull(self, n: int) -> list[Any]:
        """``last_batch="error"``: one batch per host, or the end of every host's source."""
        hosts = []
        for h in range(len(self.its)):
            x = self._next_of(h, n)
            if x is _END:
                if h:
                    raise ShardingError(
                        f"GlobalBatchLoader: batch {n}: host {h}'s source ended, but host 0's "
                        "did not; every host's source must yield the same number of batches."
                    )
                for other in range(1, len(self.its)):
                    if self._next_of(other, n) is not _END:
                        raise ShardingError(
                            f"GlobalBatchLoader: batch {n}: host 0's source ended, but host "
                            f"{other}'s did not; every host's source must yield the same number "
                            "of batches."
                        )
                raise StopIteration(self.snapshot())
            hosts.append(x)
        return hosts

    def _template(self, h: int, x: Any) -> Template:
        t = self.templates[h]
        if t is None:
            name = "batch" if not self.per_host else f"host_batches[{h}]"
            t = self.templates[h] = Template(x, self.full[h], name=name)
        return t

    def _pull_ends(self, n: int) -> tuple[list[Any], list[Any] | None, list[int], str]:
        """``last_batch="drop"``/``"pad"``: ``(batches, masks, real rows per host, status)``.

        Every host's source is read at every batch (none is read again once it ended). Drop:
        an ended or short host ends the batch (``StopIteration``, or the status ``END`` when
        the processes exchange). Pad: short batches padded, ended hosts padding only."""
        got: list[Any] = []
        rows: list[int] = []
        for h in range(len(self.its)):
            x = _END if self.ended[h] else self._next_of(h, n)
            if x is _END:
                self.ended[h] = True
                got.append(None)
                rows.append(0)
                continue
            t = self._template(h, x)
            short = t.short(x)
            got.append(x)
            rows.append(t.rows if short is None else short)
            if short is not None and self.policy == "drop":
                self.ended[h] = True
        self.tally.read += sum(rows)
        if self.policy == "drop":
            if all(x is not None and not self.ended[h] for h, x in enumerate(got)):
                return got, None, rows, rows_status(sum(rows))
            if not self.exchange:
                raise StopIteration(self.snapshot())
            return [], None, rows, END
        if all(self.ended) and not self.exchange:
            raise StopIteration(self.snapshot())
        known = next((t for t in self.templates if t is not None), None)
        if known is None:  # no host had a batch yet: nothing to pad with
            if not self.exchange:
                raise StopIteration(self.snapshot())
            return [], None, rows, EMPTY
        batches, masks = [], []
        for h, x in enumerate(got):
            t = self.templates[h] or known
            if x is None:
                batches.append(t.padding())
            else:
                batches.append(x if rows[h] == t.rows else t.pad(x, rows[h]))
            masks.append(t.mask(rows[h]))
        status = END if all(self.ended) else rows_status(sum(rows))
        return batches, masks, rows, status

    # -- one batch ------------------------------------------------------------------------
    def __call__(self, i: int) -> Made:
        if self.pipeline and self.stream is not None:
            begun = (
                self.begun if self.begun is not None else self._begin(self.stream, self.first + i)
            )
            self.begun = None
            if begun.made is not None:  # the next batch, and its exchange, before this one's end
                self.begun = self._begin(self.stream, begun.n + 1)
            return self._end(self.stream, begun)
        n = self.first + i
        stream = self.stream
        if self.stopped:  # every process stopped at the previous batch (drop or pad)
            raise StopIteration(Ended(self.snapshot()))
        try:
            out, snapshot, host, rows, status, nbytes = self._make(n)
        except StopIteration as end:
            if stream is not None:
                self._agree(stream, n, [END] if self.exchange else [END_OF_SOURCE])
                stream.finished = True
            raise StopIteration(Ended(end.value)) from None
        except Exception as e:
            if self.background and self.threads is not None:  # drop the failed batch's copies
                self.threads.fence()
            if stream is not None:
                self._agree(stream, n, failure(e), error=e)
            raise
        # The copies of a batch made on the loader's thread end with one fence for the batch.
        ready = self.threads.fence() if self.background and self.threads is not None else None
        if stream is None:
            return Made(out, snapshot, ready, rows=rows, nbytes=nbytes)
        outcome = [status] if self.exchange else []
        where = None
        if host is not None and self.agree:
            described, where = self._describe(n, host)
            outcome += described
        settled = self._agree(stream, n, outcome, where=where)
        if settled is not None and settled[0]:  # the last exchange of the epoch
            self.stopped = True
            stream.finished = True
        return Made(
            out,
            snapshot,
            ready,
            compared=self.agree,
            rows=rows,
            nbytes=nbytes,
            settled=settled,
        )

    def _describe(self, n: int, host: Any) -> tuple[list[str], Callable[[int], str]]:
        """Batch ``n``'s description (what the agreement compares) from this process's host
        batch, and the paths of its leaves for the errors."""
        leaves, treespec = flatten(host)
        paths = LazyPaths(treespec, "batch")
        where = lambda i: f"GlobalBatchLoader: batch {n}: {paths[i]}"  # noqa: E731
        return describe(treespec, leaves, self.spec), where

    def _begin(self, stream: Stream, n: int) -> _Begun:
        """Makes batch ``n`` (or meets the end, or fails to) and begins the exchange of its
        outcome; a failure of the exchange itself is raised by the end."""
        made: Made | None = None
        snapshot: list[Any] | None = None
        error: Exception | None = None
        where: Callable[[int], str] | None = None
        try:
            out, snap, host, rows, _, nbytes = self._make(n)
        except StopIteration as stop:
            outcome, snapshot = [END_OF_SOURCE], stop.value
        except Exception as e:  # noqa: BLE001 -- raised by the end, at its batch
            if self.threads is not None:  # drop the failed batch's copies
                self.threads.fence()
            outcome, error = failure(e), e
        else:
            ready = self.threads.fence() if self.threads is not None else None
            made = Made(out, snap, ready, compared=True, rows=rows, nbytes=nbytes)
            outcome = []
            if host is not None:
                outcome, where = self._describe(n, host)
        try:
            end = stream.checks.begin_exchange(
                self.mesh, outcome, what=f"GlobalBatchLoader: batch {n}", stream=stream.name
            )
        except (ProcessDisagreementError, CollectiveError) as e:
            setattr(e, LOCATED, True)
            failed = e

            def end() -> list[list[str]] | None:
                raise failed

        return _Begun(n, made, end, snapshot, error, where)

    def _end(self, stream: Stream, begun: _Begun) -> Made:
        """Waits for the others' outcomes of ``begun``'s batch: returns the batch, or raises as
        ``_agree`` does (the end of the sources: ``StopIteration``)."""
        what = f"GlobalBatchLoader: batch {begun.n}"
        try:
            every = begun.end()
        except (ProcessDisagreementError, CollectiveError) as e:  # out of step, timeout, early end
            setattr(e, LOCATED, True)
            raise
        _judge(what, every, begun.where or (lambda i: f"{what}: leaf {i}"), begun.error)
        if begun.error is not None:
            raise begun.error
        if begun.made is None:  # the end of every process's sources
            stream.finished = True
            raise StopIteration(Ended(begun.snapshot))
        return begun.made

    def _agree(
        self,
        stream: Stream,
        n: int,
        outcome: list[str],
        *,
        error: BaseException | None = None,
        where: Callable[[int], str] | None = None,
    ) -> tuple[bool, list[int]] | None:
        """The agreement step on batch ``n``'s outcome (an exchange on the epoch's stream):
        raises ``ProcessDisagreementError`` on every process whose outcome is a batch or the
        end when the outcomes differ; a process whose outcome is ``error`` gets a note on it
        instead (its caller re-raises it). With ``exchange`` (``last_batch="drop"``/``"pad"``
        on several processes) it returns ``(stop, real rows per process)``: every process
        stops, or goes on, at the same batch."""
        what = f"GlobalBatchLoader: batch {n}"
        paths = where or (lambda i: f"GlobalBatchLoader: batch {n}: leaf {i}")
        try:
            every = stream.checks.exchange(
                self.mesh, outcome, what=what, stream=stream.name, force=self.exchange
            )
            if self.exchange:
                try:
                    return settle(
                        self.policy,
                        every if every is not None else [outcome] * self.processes,
                        what=what,
                        where=paths,
                    )
                except ProcessDisagreementError as differ:
                    if error is None:
                        raise
                    error.add_note(f"(the other processes' outcomes differ: {differ})")
                    return None
        except (ProcessDisagreementError, CollectiveError) as e:  # out of step, timeout, early end
            setattr(e, LOCATED, True)
            raise
        _judge(what, every, paths, error)
        return None

    def _make(self, n: int) -> tuple[Any, list[Any] | None, Any, int, str, int]:
        masks = None
        status = ""
        if self.policy == "error":
            hosts = self._pull(n)
            rows = sum(_rows(b) for b in hosts)
        else:
            hosts, masks, per, status = self._pull_ends(n)
            rows = sum(per)
        snapshot = self.snapshot()
        if not hosts:  # this process's end, told to the others (the consumer decides)
            return None, snapshot, None, rows, status, 0
        per_host = len(hosts) > 1
        for h, b in enumerate(hosts):
            self.check(b, batch=n, host=h if per_host else None)
        if self.dispatchers is not None:
            hosts = [
                d.logical_to_physical_batch(b) for d, b in zip(self.dispatchers, hosts, strict=True)
            ]
            if masks is not None:
                masks = [
                    d.logical_to_physical_batch({"mask": m})["mask"]
                    for d, m in zip(self.dispatchers, masks, strict=True)
                ]
            if not self.feeds_checked:
                topology = current_topology(self.mesh)
                check_dispatch_feeds(
                    mesh=self.mesh,
                    spec_tree=self.spec,
                    physical_batches=hosts,
                    dispatchers=self.dispatchers,
                    hosts=topology.data_hosts,
                    explicit=self.explicit_partition,
                    batch=n,
                )
                self.feeds_checked = True
        nbytes = host_nbytes(hosts)
        t0 = time.perf_counter()
        try:
            if masks is None:
                out = self._to_global(hosts, self.spec)
            else:
                if self.mask_spec is None:
                    self.mask_spec = mask_partition(self.mesh, self.spec, hosts[0])
                # FULL (the default) checks the batch dim over the whole tree: its own call
                if self.spec is DEFAULT_PARTITION or isinstance(self.spec, DataPartitionType):
                    out = (
                        self._to_global(hosts, self.spec),
                        self._to_global(masks, self.mask_spec),
                    )
                else:  # one engine call for the batch and its mask (two cost a 1 MiB step ~20 %)
                    pairs = [(b, m) for b, m in zip(hosts, masks, strict=True)]
                    out = self._to_global(pairs, (self.spec, self.mask_spec))
        except IndivisibleError as e:
            raise indivisible_error(
                e,
                mesh=self.mesh,
                spec_tree=self.spec,
                host_batch=hosts[0],
                batch=n,
                dispatcher=self.dispatchers is not None,
            ) from None
        self.counters.add(bytes=nbytes, transfer_seconds=time.perf_counter() - t0)
        return out, snapshot, hosts[0], rows, status, nbytes

    def _to_global(self, hosts: list[Any], spec: Any) -> Any:
        """``host_to_global_array`` of the hosts' batches, without the agreement step."""
        mesh, backend = self.mesh, self.backend
        topology = current_topology(mesh)
        call = read(hosts, topology, spec, per_host=self.per_host)
        return to_global(mesh, backend, topology, call, background=self.background)


def _rows(tree: Any) -> int:
    """A host batch's examples: dim 0 of its first leaf (0 when it has none)."""
    leaves, _ = flatten(tree)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape is not None and len(shape) else 0
