"""What a ``GlobalBatchLoader``'s background thread does for each batch (``Producer``).

Per batch: take one host batch from every source (one per host this process supplies), snapshot
the sources, check the batch against the first one, apply the dispatchers'
``logical_to_physical_batch``, and call the engine (``read``/``plan``/``place``) as
``host_to_global_array`` does, telling the backend it runs on a helper thread (``background``).
It never runs the agreement step: the consumer does (``Epoch``), on the thread that runs the
program. It holds no consumer state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torchshard._backend.registry import lookup
from torchshard._core.agreement import END as END_OF_SOURCE
from torchshard._core.agreement import describe, failure
from torchshard._core.errors import IndivisibleError, ShardingError
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
from torchshard.data._ends import EMPTY, END, Template, mask_partition, rows_status
from torchshard.data._state import capture, stateful
from torchshard.data._stats import Counters
from torchshard.data._stream import echo_error, stream_workers

__all__ = ["OUTCOME", "Ended", "Made", "Producer", "Tally", "stateful"]

OUTCOME = "_torchshard_outcome"  # attribute of a producer's exception: its outcome description


@dataclasses.dataclass(frozen=True)
class Made:
    """What the producer hands the consumer for one batch."""

    batch: Any  # the global batch; with last_batch="pad", ``(batch, mask)``
    snapshot: list[Any] | None
    outcome: list[str] | None  # ``describe`` of the host batch, when the processes compare
    where: Callable[[int], str] | None  # leaf paths for the agreement error
    ready: Callable[[], None] | None = None
    """The batch's hand-off (``DeviceThreads.fence``): the consumer calls it before using the batch,
    so that its stream waits for this batch's copies; ``None``: nothing to wait for."""
    rows: int = 0  # the real examples of this process's sources in the batch
    nbytes: int = 0  # the host bytes transferred (the prefetch's byte budget counts them)


@dataclasses.dataclass(frozen=True)
class Ended:
    """The value of the producer's ``StopIteration``."""

    snapshot: list[Any] | None
    outcome: list[str] | None


class Tally:
    """The examples an epoch's producer read from its sources (the consumer reads it when the
    epoch stops early, to count what it dropped)."""

    __slots__ = ("read",)

    def __init__(self) -> None:
        self.read = 0


_END = object()


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
        agree: describe each batch's outcome for the consumer's agreement step.
        policy: ``last_batch`` (``"error"``, ``"drop"``, ``"pad"``).
        exchange: the processes exchange each batch's status (``"drop"``/``"pad"`` on several
            processes): the consumer decides where the epoch ends, so after this process's end
            the producer reports it (``"drop"``) or makes padding batches (``"pad"``).
        full: per source, the rows of a whole batch (its ``batch_size``), else ``None`` (the
            first batch's).
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
        agree: bool,
        policy: str = "error",
        exchange: bool = False,
        full: Sequence[int | None] | None = None,
    ) -> None:
        self.its = its
        self.all_sources = list(sources)
        self.sources = sources if all(stateful(s) for s in sources) else None
        self.dispatchers = dispatchers
        self.per_host = per_host
        self.explicit_partition = explicit_partition
        self.agree = agree
        self.policy = policy
        self.exchange = exchange
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
        n = self.first + i
        try:
            out, snapshot, host, rows, status, nbytes = self._make(n)
        except StopIteration as end:
            outcome = [END_OF_SOURCE] if self.agree and self.policy == "error" else None
            if self.exchange:
                outcome = [END]
            raise StopIteration(Ended(end.value, outcome)) from None
        except Exception as e:
            if self.background and self.threads is not None:  # drop the failed batch's copies
                self.threads.fence()
            if self.agree or self.exchange:
                setattr(e, OUTCOME, failure(e))
            raise
        # The copies of a batch made on the loader's thread end with one fence for the batch.
        ready = self.threads.fence() if self.background and self.threads is not None else None
        head = [status] if self.exchange else []
        if host is None or not self.agree:
            outcome = head or None
            return Made(out, snapshot, outcome, None, ready, rows, nbytes)
        leaves, treespec = flatten(host)
        paths = LazyPaths(treespec, "batch")
        return Made(
            out,
            snapshot,
            head + describe(treespec, leaves, self.spec),
            lambda i: f"GlobalBatchLoader: batch {n}: {paths[i]}",
            ready,
            rows,
            nbytes,
        )

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
