"""What makes each batch of an epoch (``Producer``): on the loader's thread, or inside
``next()`` with ``prefetch=0``.

Per batch: take one host batch from every source (one per host this process supplies), snapshot
the sources, check the batch against the first one, apply the dispatchers'
``logical_to_physical_batch``, and call the engine (``read``/``plan``/``place``) as
``host_to_global_array`` does, telling the backend whether it runs on a helper thread (the
plan's ``background``). Then, when the processes compare (the plan's ``agree``: DTensor,
agreement check on) or settle the end of data together (its ``exchange``), it exchanges the
batch's *outcome* (its description, the end of the source, or a failure) on the epoch's
``Exchanges``: one bounded exchange per batch, named by the batch, on the thread that made it, so
it runs ahead of the consumer and off the step's path. Differing outcomes raise at that batch on
every process, before it is handed over: the failing process its own error (with a note), the
others ``ProcessDisagreementError``. It holds no consumer state.

The plan fixes the mode (``producer_for``): ``Producer`` exchanges each batch's outcome as soon
as it is made; ``PipelinedProducer`` (the plan's ``pipeline``) begins batch ``n``'s exchange when
``n`` is made, makes ``n + 1`` and begins its exchange, and only then waits for the other
processes' outcomes of ``n`` and hands ``n`` over. Waiting at once ties every batch to the
slowest process's making of that batch, so each process's thread runs at the pace of the slowest
one batch by batch, which a deeper prefetch does not absorb. One batch later the others have
almost always begun ``n``, and the wait is gone. The batch made ahead is one more than
``prefetch`` in flight (figures: docs/design.md).

Every read of a source goes through the run's ``Outside`` (``prefetch.py``), so that closing the
run never waits for a thread inside its source; a one-pass source comes as its ``Replay``
(``replay.py``), read through a ``Reader`` whose position after each batch travels with it
(``Made.reads``). A ``KeyboardInterrupt`` or ``SystemExit`` raised while making batch ``n``
(a source's) is not exchanged, which could wait on the other processes: it reaches the consumer
at batch ``n``, after every batch before it, and the others learn at their next exchange that
this process ended (the channel's close).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torchshard._core.agreement import END_OF_DATA, describe, failure
from torchshard._core.errors import (
    CollectiveError,
    IndivisibleError,
    ProcessDisagreementError,
    ShardingError,
)
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.spec import DataPartitionType
from torchshard._core.tree import LazyPaths, flatten
from torchshard._core.verdict import Verdict
from torchshard._mesh.context import current_topology
from torchshard._place.call import read
from torchshard._place.place import to_global
from torchshard.data._loader.batch_check import (
    BatchChecker,
    check_dispatch_feeds,
    host_nbytes,
    indivisible_error,
)
from torchshard.data._loader.checkpoint import capture, holder
from torchshard.data._loader.echo import (
    echo_error,
    feed_echo_error,
    feed_items,
    is_stream,
    stream_workers,
)
from torchshard.data._loader.exchanges import Exchanges, judge
from torchshard.data._loader.last_batch import (
    ENDED,
    ENDED_EMPTY,
    LeafPath,
    Template,
    batch_leaf,
    ended_status,
    mask_partition,
    rows_status,
    settle,
    specs_of,
    status_counts,
    status_items,
)
from torchshard.data._loader.plan import EpochPlan
from torchshard.data._loader.prefetch import (  # LOCATED: the agreement's errors name their batch
    LOCATED,
    Outside,
    Retired,
)
from torchshard.data._loader.replay import Reader, Replay
from torchshard.data._loader.stats import Counters

__all__ = ["EndOfData", "Made", "PipelinedProducer", "Producer", "Tally", "producer_for"]


@dataclasses.dataclass(frozen=True)
class Made:
    """What the producer hands the consumer for one batch."""

    batch: Any  # the global batch; with last_batch="pad", ``(batch, mask)``
    snapshot: list[Any] | None
    ready: Callable[[], None] | None = None
    """The batch's hand-off (``DeviceThreads.fence``): the consumer calls it before using the batch,
    so that its device stream waits for this batch's copies; ``None``: nothing to wait for."""
    compared: bool = False  # the processes agreed on this batch's outcome
    rows: int = 0  # the real examples of this process's sources in the batch
    nbytes: int = 0  # the host bytes transferred (the prefetch's byte budget counts them)
    settled: tuple[bool, int] | None = None
    """``last_batch="drop"``/``"pad"`` on several processes: ``(stop, real rows per process)``,
    agreed by the processes' exchange of this batch's status (the same on every process)."""
    reads: tuple[int, ...] = ()
    """The producer's ``readers``' positions after this batch (one-pass sources): taking the
    batch takes their batches before these."""


@dataclasses.dataclass(frozen=True)
class _Begun:
    """A batch's outcome whose exchange has begun (pipelined): the batch made, the end of the
    sources, or the failure to make it."""

    n: int
    made: Made | None  # the batch; None: the end (``error is None``) or a failure
    end: Callable[[], Verdict | None]  # waits for the others' outcomes
    snapshot: list[Any] | None = None  # at the end: the sources' states
    error: BaseException | None = None
    where: Callable[[int], str] | None = None  # the paths of the batch's leaves


@dataclasses.dataclass(frozen=True)
class EndOfData:
    """The value of the producer's ``StopIteration``: the sources' states at their end."""

    snapshot: list[Any] | None


class Tally:
    """The examples an epoch's producer read from its sources (the consumer reads it when the
    epoch stops early, to count what it dropped)."""

    __slots__ = ("read",)

    def __init__(self) -> None:
        self.read = 0


_END = object()


# How errors name a part of a host's tree, per host (``global_batch_loader_per_host``).
_PER_HOST = {"batch": "host_batches", "mask": "host_masks"}


class Producer:
    """Makes global batch ``plan.first + i`` (``self(i)``), exchanging each batch's outcome at
    once when the plan has a channel (the mode of a plan without ``pipeline``).

    Args:
        plan: the epoch's plan (mesh, spec, policy, what the processes exchange, whether a
            thread runs this producer).
        its: one iterator per source (per host this process supplies); a one-pass source's
            ``Replay``, read from its first batch not taken.
        sources: the sources (snapshotted when every one is stateful).
        dispatchers: one per source, or ``None``.
        counters: the loader's counters (bytes, transfer seconds).
        exchanges: the epoch's exchanges (``None`` exactly when the plan has no channel). With
            the plan's ``exchange`` (``"drop"``/``"pad"`` on several processes, also with the
            agreement check off), after this process's end the producer reports it
            (``"drop"``) or makes padding batches (``"pad"``), and every process stops at the
            batch the exchange settles on.
    """

    def __init__(
        self,
        plan: EpochPlan,
        its: list[Iterator[Any]],
        sources: Sequence[Any],
        dispatchers: Sequence[Any] | None,
        counters: Counters,
        exchanges: Exchanges | None = None,
    ) -> None:
        if (exchanges is None) != (plan.channel is None):
            raise ValueError(
                f"Producer: exchanges are needed exactly when the plan has a channel (channel="
                f"{plan.channel!r}), but got {exchanges!r}."
            )
        self.plan = plan
        self.outside = Outside()  # every read of a source goes through it (the run's close)
        self.its: list[Iterator[Any]] = [
            it.reader(self.outside) if isinstance(it, Replay) else it for it in its
        ]
        self.readers = [it for it in self.its if isinstance(it, Reader)]
        self.all_sources = list(sources)
        held = [holder(s, it) for s, it in zip(sources, its, strict=True)]
        self.sources = held if all(h is not None for h in held) else None
        self.dispatchers = dispatchers
        self.exchanges = exchanges
        self.threads = plan.backend.threads
        self.counters = counters
        self.check = BatchChecker()
        self.tally = Tally()
        self.stopped = False  # the exchange settled on the end: every process stopped
        self.mask_spec: Any = None  # "pad": the mask's partition, from the first batch
        self.feeds_checked = False  # the layout check runs on the first batch (shapes fixed)
        n = len(its)
        self.full = list(plan.full) if len(plan.full) == n else [None] * n
        self.templates: list[Template | None] = [None] * n
        self.ended = [False] * n
        self.pending: list[list[Any]] = [[] for _ in range(n)]
        self.echo_checked = [False] * n
        # The feeds' first batches (echo.py): 0 to digest, 1 digested (``echo_items``: this
        # process's), 2 compared.
        self.streams = [is_stream(s) for s in sources]
        # (only streams are compared: a sampler splits map-style data; the same code on every
        # process, so every process or none makes the exchange)
        self.echo_state = 0 if not plan.equal_batches and any(self.streams) else 2
        self.echo_items: list[tuple[str, int]] = []
        self.echo_spec: Any = plan.spec  # the batch leaf's, once known (for the error)
        # The leaf whose dim 0 counts a batch's examples, learnt from the first batch:
        # (its index, its path in the errors, its keys), ``batch_leaf``.
        self.leaf: tuple[int, str, LeafPath] | None = None

    def snapshot(self) -> list[Any] | None:
        """The sources' states now, deep copies (``None`` unless every source is stateful)."""
        if self.sources is None:
            return None
        return [capture(s) for s in self.sources]

    def positions(self) -> tuple[int, ...]:
        """The ``readers``' positions now (``Made.reads``)."""
        return tuple(r.position for r in self.readers)

    # -- reading ---------------------------------------------------------------------------
    def _next_of(self, h: int, n: int) -> Any:
        """Host ``h``'s next batch, or ``_END``. A DataLoader whose workers read a stream is
        checked at its first batch: its first batches (one per worker) must differ."""
        if self.pending[h]:
            return self.pending[h].pop(0)
        it = self.its[h]
        read = self.outside.call
        if not self.echo_checked[h]:
            self.echo_checked[h] = True
            workers = stream_workers(self.all_sources[h])
            if workers:
                first = []
                for _ in range(workers):
                    x = read(next, it, _END)
                    if x is _END:
                        break
                    first.append(x)
                host = h if self.plan.per_host else None
                if not self.plan.equal_batches:
                    error = echo_error(first, workers, host=host, batch=n)
                    if error is not None:
                        raise error
                self.pending[h] = first[1:]
                return first[0] if first else _END
        return read(next, it, _END)

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

    def _leaf(self, h: int, x: Any) -> tuple[int, str, LeafPath]:
        """The leaf of host batch ``x`` that carries the batch dimension (``batch_leaf``),
        learnt from the first batch (the later ones have its structure: ``BatchChecker``)."""
        if self.leaf is None:
            plan = self.plan
            name = "batch" if not plan.per_host else f"host_batches[{h}]"
            specs = None if plan.batch_leaf is not None else specs_of(plan.mesh, plan.spec, x)
            try:
                index, path = batch_leaf(x, named=plan.batch_leaf, specs=specs, name=name)
            except ShardingError:
                if plan.policy != "error" or plan.batch_leaf is not None:
                    raise
                self.leaf = (-1, "", ())  # no leaf has a dim 0: the batch counts no examples
                return self.leaf
            keys = tuple(flatten(x)[1].paths()[index])
            self.leaf = (index, path, keys)
        return self.leaf

    def _rows(self, h: int, x: Any) -> int:
        """Host batch ``x``'s examples: dim 0 of its leaf that carries the batch dimension."""
        index = self._leaf(h, x)[0]
        leaves, _ = flatten(x)
        shape = getattr(leaves[index], "shape", None) if 0 <= index < len(leaves) else None
        return int(shape[0]) if shape is not None and len(shape) else 0

    def _templates(self, got: list[Any]) -> None:
        """Every host's template, from its first batch (``got[h]``, ``None`` for a host whose
        source is empty), all with one whole size: a source's ``batch_size``, else the largest
        first batch (a host whose first batch is already its short last one is padded)."""
        rows = [self._rows(h, x) for h, x in enumerate(got) if x is not None]
        known = [f for f in self.full if f is not None]
        whole = max(known + rows) if known or rows else None
        index = self.leaf[0] if self.leaf is not None else None
        for h, x in enumerate(got):
            if x is None or self.templates[h] is not None:
                continue
            name = "batch" if not self.plan.per_host else f"host_batches[{h}]"
            specs = specs_of(self.plan.mesh, self.plan.spec, x)
            full = self.full[h] if self.full[h] is not None else whole
            self.templates[h] = Template(x, full, name=name, index=index, specs=specs)

    def _pull_ends(self, n: int) -> tuple[list[Any], list[Any] | None, list[int], str]:
        """``last_batch="drop"``/``"pad"``: ``(batches, masks, real rows per host, status)``.

        Every host's source is read at every batch (none is read again once it ended). Drop:
        an ended or short host ends the batch (``StopIteration``, or the status ``ENDED`` when
        the processes exchange). Pad: short batches padded, ended hosts padding only."""
        policy, exchange = self.plan.policy, self.plan.exchange
        got: list[Any] = []
        for h in range(len(self.its)):
            x = _END if self.ended[h] else self._next_of(h, n)
            if x is _END:
                self.ended[h] = True
                got.append(None)
            else:
                got.append(x)
        if all(t is None for t in self.templates) and any(x is not None for x in got):
            self._templates(got)
        rows: list[int] = []
        for h, x in enumerate(got):
            if x is None:
                rows.append(0)
                continue
            t = self.templates[h]
            assert t is not None
            short = t.short(x)
            rows.append(t.rows if short is None else short)
            if short is not None and policy == "drop":
                self.ended[h] = True
        self.tally.read += sum(rows)
        known = next((t for t in self.templates if t is not None), None)
        whole = None if known is None else sum((t or known).rows for t in self.templates)
        if policy == "drop":
            if all(x is not None and not self.ended[h] for h, x in enumerate(got)):
                return got, None, rows, rows_status(sum(rows), whole)
            if not exchange:
                raise StopIteration(self.snapshot())
            return [], None, rows, ENDED
        if all(self.ended) and not exchange:
            raise StopIteration(self.snapshot())
        if known is None:  # no host had a batch yet: nothing to pad with
            if not exchange:
                raise StopIteration(self.snapshot())
            return [], None, rows, ENDED_EMPTY
        batches, masks = [], []
        for h, x in enumerate(got):
            t = self.templates[h] or known
            if x is None:
                batches.append(t.padding())
            else:
                batches.append(x if rows[h] == t.rows else t.pad(x, rows[h]))
            masks.append(t.mask(rows[h]))
        status = ended_status(whole) if all(self.ended) else rows_status(sum(rows), whole)
        return batches, masks, rows, status

    # -- one batch ------------------------------------------------------------------------
    def _fence(self) -> Callable[[], None] | None:
        """The hand-off of the copies this thread started for a batch (made on the loader's
        thread: one fence per batch); ``None`` in place, where the copies need none."""
        if self.plan.background and self.threads is not None:
            return self.threads.fence()
        return None

    def __call__(self, i: int) -> Made:
        n = self.plan.first + i
        exchanges = self.exchanges
        if self.stopped:  # every process stopped at the previous batch (drop or pad)
            raise StopIteration(EndOfData(self.snapshot()))
        try:
            out, snapshot, host, rows, status, nbytes = self._make(n)
        except StopIteration as end:
            if exchanges is not None:
                if self.plan.exchange:
                    self._agree(exchanges, n, [ENDED], counts=status_counts(ENDED))
                else:
                    self._agree(exchanges, n, [END_OF_DATA])
                exchanges.agreed_end()
            raise StopIteration(EndOfData(end.value)) from None
        except Retired:  # the run was closed while this thread was inside the source
            raise
        except Exception as e:
            self._fence()  # drop the failed batch's copies
            if exchanges is not None:
                self._agree(exchanges, n, failure(e), error=e)
            raise
        except BaseException:  # KeyboardInterrupt, SystemExit: at this batch, not exchanged
            self._fence()
            raise
        ready = self._fence()
        reads = self.positions()
        if exchanges is None:
            self._feed_echo(n)
            return Made(out, snapshot, ready, rows=rows, nbytes=nbytes, reads=reads)
        outcome = status_items(status, host is not None) if self.plan.exchange else []
        where = None
        if host is not None and self.plan.agree:
            described, where = self._describe(n, host)
            outcome += described
        counts = status_counts(status) if self.plan.exchange else []
        settled = self._agree(exchanges, n, outcome, where=where, counts=counts)
        if settled is not None and settled[0]:  # the last exchange of the epoch
            self.stopped = True
            exchanges.agreed_end()
        else:
            self._feed_echo(n)
        return Made(
            out,
            snapshot,
            ready,
            compared=self.plan.agree,
            rows=rows,
            nbytes=nbytes,
            settled=settled,
            reads=reads,
        )

    def _feed_items(self, hosts: list[Any], real: list[int] | None) -> list[tuple[str, int]]:
        """This process's first host batches of streams with real rows, each digested with its feed
        (``echo.feed_items``); none where no leaf carries the batch dimension."""
        plan = self.plan
        keep = [h for h in range(len(hosts)) if self.streams[h] and (real is None or real[h] > 0)]
        if not keep:
            return []
        first = hosts[keep[0]]
        try:
            index = self._leaf(keep[0], first)[0]
        except ShardingError:
            return []
        specs = specs_of(plan.mesh, plan.spec, first)
        if specs is None or not 0 <= index < len(specs):
            return []
        self.echo_spec = specs[index]
        topology = current_topology(plan.mesh)
        processes = [
            topology.data_hosts[h] if plan.per_host else topology.process_index for h in keep
        ]
        return feed_items(
            plan.mesh, specs[index], [hosts[h] for h in keep], processes, topology.device_process
        )

    def _feed_echo(self, n: int) -> None:
        """At the epoch's first batch, after the processes agreed on it: the feeds' first
        batches compared (one exchange on several processes, every process the same verdict);
        a first batch equal under two feeds raises ``ShardingError``."""
        if self.echo_state != 1:
            return
        self.echo_state = 2
        mine = self.echo_items
        items: dict[str, list[int]] = {}
        for item, process in mine:
            items.setdefault(item, []).append(process)
        if self.exchanges is not None:
            verdict = self.exchanges.exchange(
                sorted(items) or ["-"],
                what=f"GlobalBatchLoader: batch {n}: the feeds' first batches",
                force=True,
            )
            if verdict is not None:
                items = {}
                for group in verdict.groups:
                    for item in group.items:
                        if item != "-":
                            items.setdefault(item, []).extend(group.ranks)
        error = feed_echo_error(sorted(items.items()), spec=self.echo_spec, batch=n)
        if error is not None:
            raise error

    def _describe(self, n: int, host: Any) -> tuple[list[str], Callable[[int], str]]:
        """Batch ``n``'s description (what the agreement compares) from this process's host
        batch, and the paths of its leaves for the errors."""
        leaves, treespec = flatten(host)
        paths = LazyPaths(treespec, "batch")
        where = lambda i: f"GlobalBatchLoader: batch {n}: {paths[i]}"  # noqa: E731
        return describe(treespec, leaves, self.plan.spec), where

    def _agree(
        self,
        exchanges: Exchanges,
        n: int,
        outcome: list[str],
        *,
        error: BaseException | None = None,
        where: Callable[[int], str] | None = None,
        counts: Sequence[int] = (),
    ) -> tuple[bool, int] | None:
        """The agreement step on batch ``n``'s outcome (an exchange on the epoch's channel):
        raises ``ProcessDisagreementError`` on every process whose outcome is a batch or the
        end when the outcomes differ; a process whose outcome is ``error`` gets a note on it
        instead (its caller re-raises it). With the plan's ``exchange`` (``last_batch="drop"``/
        ``"pad"`` on several processes) it returns ``(stop, real rows over the processes)``:
        every process stops, or goes on, at the same batch (``counts``: this process's
        ``status_counts``)."""
        what = f"GlobalBatchLoader: batch {n}"
        paths = where or (lambda i: f"GlobalBatchLoader: batch {n}: leaf {i}")
        exchange = self.plan.exchange
        try:
            verdict = exchanges.exchange(outcome, what=what, force=exchange, counts=counts)
            if exchange:
                try:
                    return settle(
                        self.plan.policy,
                        verdict if verdict is not None else Verdict.alone(outcome, counts),
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
        judge(what, verdict, paths, error)
        return None

    def _make(self, n: int) -> tuple[Any, list[Any] | None, Any, int, str, int]:
        plan = self.plan
        masks = None
        status = ""
        per: list[int] | None = None
        if plan.policy == "error":
            hosts = self._pull(n)
            rows = sum(self._rows(h, b) for h, b in enumerate(hosts))
        else:
            hosts, masks, per, status = self._pull_ends(n)
            rows = sum(per)
        snapshot = self.snapshot()
        if self.echo_state == 0:
            self.echo_items = self._feed_items(hosts, per) if hosts else []
            self.echo_state = 1
        if not hosts:  # this process's end, told to the others (the consumer decides)
            return None, snapshot, None, rows, status, 0
        per_host = len(hosts) > 1
        for h, b in enumerate(hosts):
            try:
                self.check(b, batch=n, host=h if per_host else None)
            except ShardingError as e:
                if plan.policy != "error" and self.leaf is not None:
                    e.add_note(
                        f"(last_batch={plan.policy!r} counts a batch's rows on "
                        f"{self.leaf[1]}, the leaf that carries the batch dimension; if "
                        "another leaf does, name it: GlobalBatchLoader(..., batch_leaf=...))"
                    )
                raise
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
                topology = current_topology(plan.mesh)
                check_dispatch_feeds(
                    mesh=plan.mesh,
                    spec_tree=plan.spec,
                    physical_batches=hosts,
                    dispatchers=self.dispatchers,
                    hosts=topology.data_hosts,
                    explicit=plan.explicit_partition,
                    batch=n,
                )
                self.feeds_checked = True
        nbytes = host_nbytes(hosts)
        t0 = time.perf_counter()
        try:
            if masks is None:
                out = self._to_global(hosts, plan.spec)
            else:
                if self.mask_spec is None:
                    keys = self.leaf[2] if self.leaf is not None else None
                    self.mask_spec = mask_partition(plan.mesh, plan.spec, hosts[0], keys)
                # FULL (the default) checks the batch dim over the whole tree: its own call
                if plan.spec is DEFAULT_PARTITION or isinstance(plan.spec, DataPartitionType):
                    out = (
                        self._to_global(hosts, plan.spec),
                        self._to_global(masks, self.mask_spec, ("mask",)),
                    )
                else:  # one engine call for the batch and its mask (two cost a 1 MiB step ~20 %)
                    pairs = [(b, m) for b, m in zip(hosts, masks, strict=True)]
                    out = self._to_global(pairs, (plan.spec, self.mask_spec), ("batch", "mask"))
        except IndivisibleError as e:
            raise indivisible_error(
                e,
                mesh=plan.mesh,
                spec_tree=plan.spec,
                host_batch=hosts[0],
                batch=n,
                dispatcher=self.dispatchers is not None,
            ) from None
        self.counters.add(bytes=nbytes, transfer_seconds=time.perf_counter() - t0)
        return out, snapshot, hosts[0], rows, status, nbytes

    def _to_global(self, hosts: list[Any], spec: Any, parts: tuple[str, ...] = ("batch",)) -> Any:
        """``host_to_global_array`` of the hosts' batches, without the agreement step; errors
        name the leaves as the batch's (``batch['x']``, ``host_batches[1]['x']``; ``parts``:
        the names of what each host's tree holds, a tuple of them when there are several)."""
        plan = self.plan
        topology = current_topology(plan.mesh)
        names = tuple(_PER_HOST[p] for p in parts) if plan.per_host else parts
        call = read(
            hosts,
            topology,
            spec,
            per_host=plan.per_host,
            name=names[0],
            parts=names if len(names) > 1 else None,
        )
        return to_global(plan.mesh, plan.backend, topology, call, background=plan.background)


class PipelinedProducer(Producer):
    """The plan's ``pipeline`` mode: batch ``n``'s outcome exchange ends after batch ``n + 1``
    is made and its exchange begun (the loader's thread, agreement check on, no status
    exchanged, no byte budget)."""

    def __init__(
        self,
        plan: EpochPlan,
        its: list[Iterator[Any]],
        sources: Sequence[Any],
        dispatchers: Sequence[Any] | None,
        counters: Counters,
        exchanges: Exchanges | None = None,
    ) -> None:
        super().__init__(plan, its, sources, dispatchers, counters, exchanges)
        if not plan.pipeline or exchanges is None:
            raise ValueError(
                "PipelinedProducer: needs a plan whose pipeline is on (a thread, the agreement "
                "check, no status exchange, no byte budget), but got prefetch="
                f"{plan.prefetch}, agree={plan.agree}, exchange={plan.exchange}, "
                f"prefetch_bytes={plan.prefetch_bytes}."
            )
        self.pipelined = exchanges
        self.begun: _Begun | None = None  # the next batch, its exchange begun

    def __call__(self, i: int) -> Made:
        exchanges = self.pipelined
        begun = (
            self.begun if self.begun is not None else self._begin(exchanges, self.plan.first + i)
        )
        self.begun = None
        if begun.made is not None:  # the next batch, and its exchange, before this one's end
            self.begun = self._begin(exchanges, begun.n + 1)
        return self._end(exchanges, begun)

    def _begin(self, exchanges: Exchanges, n: int) -> _Begun:
        """Makes batch ``n`` (or meets the end, or fails to) and begins the exchange of its
        outcome; a failure of the exchange itself is raised by the end."""
        made: Made | None = None
        snapshot: list[Any] | None = None
        error: Exception | None = None
        where: Callable[[int], str] | None = None
        try:
            out, snap, host, rows, _, nbytes = self._make(n)
        except StopIteration as stop:
            outcome, snapshot = [END_OF_DATA], stop.value
        except Retired:  # the run was closed while this thread was inside the source
            raise
        except Exception as e:  # noqa: BLE001 -- raised by the end, at its batch
            self._fence()  # drop the failed batch's copies
            outcome, error = failure(e), e
        except BaseException as e:  # noqa: BLE001 -- KeyboardInterrupt: at its batch, unexchanged
            self._fence()
            return _Begun(n, None, _not_exchanged, error=e)
        else:
            made = Made(
                out,
                snap,
                self._fence(),
                compared=True,
                rows=rows,
                nbytes=nbytes,
                reads=self.positions(),
            )
            outcome = []
            if host is not None:
                outcome, where = self._describe(n, host)
        try:
            end = exchanges.begin(outcome, what=f"GlobalBatchLoader: batch {n}")
        except (ProcessDisagreementError, CollectiveError) as e:
            setattr(e, LOCATED, True)
            failed = e

            def end() -> Verdict | None:
                raise failed

        return _Begun(n, made, end, snapshot, error, where)

    def _end(self, exchanges: Exchanges, begun: _Begun) -> Made:
        """Waits for the others' outcomes of ``begun``'s batch: returns the batch, or raises as
        ``_agree`` does (the end of the sources: ``StopIteration``)."""
        what = f"GlobalBatchLoader: batch {begun.n}"
        try:
            verdict = begun.end()
        except (ProcessDisagreementError, CollectiveError) as e:  # out of step, timeout, early end
            setattr(e, LOCATED, True)
            raise
        judge(what, verdict, begun.where or (lambda i: f"{what}: leaf {i}"), begun.error)
        if begun.error is not None:
            raise begun.error
        if begun.made is None:  # the end of every process's sources
            exchanges.agreed_end()
            raise StopIteration(EndOfData(begun.snapshot))
        self._feed_echo(begun.n)
        return begun.made


def _not_exchanged() -> None:
    """The end of an exchange that was not begun (a ``KeyboardInterrupt`` raised at its batch)."""
    return None


def producer_for(
    plan: EpochPlan,
    its: list[Iterator[Any]],
    sources: Sequence[Any],
    dispatchers: Sequence[Any] | None,
    counters: Counters,
    exchanges: Exchanges | None = None,
) -> Producer:
    """The producer of ``plan``'s mode: ``PipelinedProducer`` when its ``pipeline`` is on, else
    ``Producer``."""
    kind = PipelinedProducer if plan.pipeline else Producer
    return kind(plan, its, sources, dispatchers, counters, exchanges)
