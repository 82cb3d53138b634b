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
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torchshard._backend.protocols import ProcessChecks
from torchshard._backend.registry import lookup
from torchshard._core.agreement import END, describe, failure, outcome_disagreement
from torchshard._core.errors import (
    CollectiveError,
    IndivisibleError,
    ProcessDisagreementError,
    ShardingError,
)
from torchshard._core.mesh import Mesh
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
from torchshard.data._prefetch import LOCATED  # the agreement's errors name their batch
from torchshard.data._stats import Counters


@dataclasses.dataclass(frozen=True)
class Made:
    """What the producer hands the consumer for one batch."""

    batch: Any
    snapshot: list[Any] | None
    ready: Callable[[], None] | None = None
    """The batch's hand-off (``DeviceThreads.fence``): the consumer calls it before using the batch,
    so that its stream waits for this batch's copies; ``None``: nothing to wait for."""
    compared: bool = False  # the processes agreed on this batch's outcome


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

    def close(self) -> None:
        """Ends the sequence (once): every process still to reach its next exchange, or waiting
        in it, raises naming this process, unless the source ended on every process."""
        if self.closed:
            return
        self.closed = True
        self.checks.close_stream(self.mesh, self.name, finished=self.finished, taken=self.taken)


def stateful(source: Any) -> bool:
    """Whether ``source`` can save and restore its position."""
    return callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None)
    )


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
        stream: the epoch's exchanges of each batch's outcome (``None``: no agreement step).
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
    ) -> None:
        self.its = its
        self.sources = sources if all(stateful(s) for s in sources) else None
        self.dispatchers = dispatchers
        self.per_host = per_host
        self.explicit_partition = explicit_partition
        self.stream = stream
        self.feeds_checked = False  # the layout check runs on the first batch (shapes fixed)
        self.background = False  # set when a thread runs it
        self.spec = spec
        self.mesh = mesh
        self.backend = lookup(mesh)
        self.threads = self.backend.threads
        self.counters = counters
        self.first = first
        self.check = BatchChecker()

    def snapshot(self) -> list[Any] | None:
        """The sources' states now (``None`` unless every source is stateful)."""
        return None if self.sources is None else [s.state_dict() for s in self.sources]

    def _pull(self, n: int) -> list[Any]:
        hosts = []
        for h, it in enumerate(self.its):
            try:
                hosts.append(next(it))
            except StopIteration:
                if h:
                    raise ShardingError(
                        f"GlobalBatchLoader: batch {n}: host {h}'s source ended, but host 0's "
                        "did not; every host's source must yield the same number of batches."
                    ) from None
                for other, rest in enumerate(self.its[1:], start=1):
                    if next(rest, _END) is not _END:
                        raise ShardingError(
                            f"GlobalBatchLoader: batch {n}: host 0's source ended, but host "
                            f"{other}'s did not; every host's source must yield the same number "
                            "of batches."
                        ) from None
                raise StopIteration(self.snapshot()) from None
        return hosts

    def __call__(self, i: int) -> Made:
        n = self.first + i
        stream = self.stream
        try:
            out, snapshot, host = self._make(n)
        except StopIteration as end:
            if stream is not None:
                self._agree(stream, n, [END])
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
            return Made(out, snapshot, ready)
        leaves, treespec = flatten(host)
        paths = LazyPaths(treespec, "batch")
        self._agree(
            stream,
            n,
            describe(treespec, leaves, self.spec),
            where=lambda i: f"GlobalBatchLoader: batch {n}: {paths[i]}",
        )
        return Made(out, snapshot, ready, compared=True)

    def _agree(
        self,
        stream: Stream,
        n: int,
        outcome: list[str],
        *,
        error: BaseException | None = None,
        where: Callable[[int], str] | None = None,
    ) -> None:
        """The agreement step on batch ``n``'s outcome (an exchange on the epoch's stream):
        raises ``ProcessDisagreementError`` on every process whose outcome is a batch or the
        end when the outcomes differ; a process whose outcome is ``error`` gets a note on it
        instead (its caller re-raises it)."""
        what = f"GlobalBatchLoader: batch {n}"
        try:
            every = stream.checks.exchange(self.mesh, outcome, what=what, stream=stream.name)
            if every is None:
                return
            problem = outcome_disagreement(
                what, every, where or (lambda i: f"GlobalBatchLoader: batch {n}: leaf {i}")
            )
        except (ProcessDisagreementError, CollectiveError) as e:  # out of step, timeout, early end
            setattr(e, LOCATED, True)
            raise
        if error is not None:
            error.add_note(f"(the other processes' outcomes differ: {problem})")
            return
        setattr(problem, LOCATED, True)
        raise problem

    def _make(self, n: int) -> tuple[Any, list[Any] | None, Any]:
        hosts = self._pull(n)
        snapshot = self.snapshot()
        per_host = len(hosts) > 1
        for h, b in enumerate(hosts):
            self.check(b, batch=n, host=h if per_host else None)
        if self.dispatchers is not None:
            hosts = [
                d.logical_to_physical_batch(b) for d, b in zip(self.dispatchers, hosts, strict=True)
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
            out = self._to_global(hosts)
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
        return out, snapshot, hosts[0]

    def _to_global(self, hosts: list[Any]) -> Any:
        """``host_to_global_array`` of the hosts' batches, without the agreement step."""
        mesh, backend = self.mesh, self.backend
        topology = current_topology(mesh)
        call = read(hosts, topology, self.spec, per_host=self.per_host)
        return to_global(mesh, backend, topology, call, background=self.background)
