"""``GlobalBatchLoader``: host batches from any iterable -> global sharded batches, prefetched.

Data flow of one epoch (``iter(loader)``), see ``docs/design.md``:

1. In the caller's thread: capture the mesh (``mesh=`` or the current one), resolve the
   partition to a spec once, open the source iterator(s) (DataLoader workers start here, in
   the caller's thread), and snapshot a stateful source.
2. On the background thread (``_prefetch.Prefetcher``, mesh made current there with
   ``thread_mesh``), per batch: take a free slot, ``next(source)``, snapshot the source, check
   the batch against the first one, apply ``dispatcher.logical_to_physical_batch``, and
   ``host_to_global_array``.
3. The consumer's ``next()`` takes the global batch and its snapshot, frees the slot, runs
   the cross-process agreement check on the batch's outcome when the backend compares the
   processes (DTensor: a collective, so never on the background thread, whose progress differs
   from process to process; see ``_agreement``), and records the position (batches consumed,
   the source's state after that batch), so ``state_dict()`` describes what the consumer has
   taken, not what was prefetched.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torchshard._agreement import END, describe, failure, outcome_disagreement
from torchshard._assemble import DEFAULT_PARTITION, _assemble
from torchshard._backend import get_backend
from torchshard._errors import IndivisibleError, NoMeshError, ShardingError
from torchshard._mesh import Mesh, current_mesh, thread_mesh
from torchshard._partition import data_partition_type_to_spec
from torchshard._spec import DataPartitionType
from torchshard._topology import Topology, current_topology
from torchshard._tree import LazyPaths, flatten
from torchshard.data._batch_check import (
    BatchChecker,
    check_dispatch_feeds,
    host_nbytes,
    indivisible_error,
)
from torchshard.data._prefetch import Prefetcher

# (one batch per host, the spec tree, background) -> the global batch. ``background``: it runs
# on the loader's thread next to the step (see ``Backend.make_global``), not inside ``next()``.
# It must not run the agreement check: the consumer runs it (``_Epoch._agree``).
Assemble = Callable[[list[Any], Any, bool], Any]

_OUTCOME = "_torchshard_outcome"  # attribute of a producer's exception: its outcome description


@dataclasses.dataclass(frozen=True)
class _Made:
    """What the producer hands the consumer for one batch."""

    batch: Any
    snapshot: list[Any] | None
    outcome: list[str] | None  # ``describe`` of the host batch, when the processes compare
    where: Callable[[int], str] | None  # leaf paths for the agreement error


@dataclasses.dataclass(frozen=True)
class _Ended:
    """The value of the producer's ``StopIteration``."""

    snapshot: list[Any] | None
    outcome: list[str] | None


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """Counters of a ``GlobalBatchLoader`` since it was made (all epochs).

    Attributes:
        batches: global batches handed to the consumer.
        bytes: host bytes transferred to the devices (every host's, under the emulation).
        wait_seconds: time the consumer spent inside ``next()`` waiting for input.
        transfer_seconds: time spent in ``host_to_global_array`` (on the background thread).
    """

    batches: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0
    transfer_seconds: float = 0.0


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value = LoaderStats()

    def add(self, **delta: float) -> None:
        with self.lock:
            v = self.value
            self.value = dataclasses.replace(v, **{k: getattr(v, k) + d for k, d in delta.items()})


def _stateful(source: Any) -> bool:
    return callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None)
    )


def _assemble_one(hosts: list[Any], spec: Any, background: bool) -> Any:
    # host_to_global_array; on the loader's thread the backend is told so (torch_xla: a
    # transfer that releases the GIL, so the step's Python keeps running; docs/design.md).
    return _assemble(
        None,
        hosts[0],
        spec,
        caller="host_to_global_array",
        argname="host_arrays",
        background=background,
        check=False,
    )


class _Producer:
    """Makes global batch ``first + i`` on the background thread (holds no consumer state)."""

    def __init__(
        self,
        its: list[Iterator[Any]],
        sources: Sequence[Any],
        dispatchers: Sequence[Any] | None,
        spec: Any,
        mesh: Mesh,
        assemble: Assemble,
        counters: _Counters,
        first: int,
        *,
        explicit_partition: bool = False,
        agree: bool = False,
    ) -> None:
        self.its = its
        self.sources = sources if all(_stateful(s) for s in sources) else None
        self.dispatchers = dispatchers
        self.explicit_partition = explicit_partition
        self.agree = agree  # describe each batch's outcome for the consumer's agreement check
        self.feeds_checked = False  # the layout check runs on the first batch (shapes fixed)
        self.background = False  # set when a thread runs it
        self.spec = spec
        self.mesh = mesh
        self.assemble = assemble
        self.counters = counters
        self.first = first
        self.check = BatchChecker()

    def snapshot(self) -> list[Any] | None:
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

    def __call__(self, i: int) -> _Made:
        n = self.first + i
        try:
            out, snapshot, host = self._make(n)
        except StopIteration as end:
            raise StopIteration(_Ended(end.value, [END] if self.agree else None)) from None
        except Exception as e:
            if self.agree:
                setattr(e, _OUTCOME, failure(e))
            raise
        if not self.agree:
            return _Made(out, snapshot, None, None)
        leaves, treespec = flatten(host)
        paths = LazyPaths(treespec, "batch")
        return _Made(
            out,
            snapshot,
            describe(treespec, leaves, self.spec),
            lambda i: f"GlobalBatchLoader: batch {n}: {paths[i]}",
        )

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
                here = current_topology(self.mesh).process_index
                check_dispatch_feeds(
                    mesh=self.mesh,
                    spec_tree=self.spec,
                    physical_batches=hosts,
                    dispatchers=self.dispatchers,
                    hosts=range(len(hosts)) if per_host else [here],
                    explicit=self.explicit_partition,
                    batch=n,
                )
                self.feeds_checked = True
        nbytes = host_nbytes(hosts)
        t0 = time.perf_counter()
        try:
            out = self.assemble(hosts, self.spec, self.background)
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


_END = object()


class _Epoch(Iterator[Any]):
    """The iterator of one epoch; closing it (or dropping it) stops its thread."""

    def __init__(self, owner: GlobalBatchLoader, producer: _Producer, prefetch: int) -> None:
        self._owner = owner
        self._mesh = producer.mesh
        self._backend = get_backend(producer.mesh)
        self._next = producer.first
        self._producer: _Producer | None = producer
        self._prefetcher: Prefetcher[Any] | None = None
        self._closed = False
        if prefetch:
            mesh, first = producer.mesh, producer.first
            producer.background = True
            self._prefetcher = Prefetcher(
                producer,
                depth=prefetch,
                name="torchshard-loader",
                context=lambda: thread_mesh(mesh),
                where=lambda i: f"batch {first + i}",
            )
            self._producer = None  # the thread owns it now
            weakref.finalize(self, self._prefetcher.close)

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            if self._prefetcher is not None:
                made = self._prefetcher.get()
            else:
                made = self._produce_here()
        except StopIteration as end:
            ended = end.value if isinstance(end.value, _Ended) else _Ended(None, None)
            self.close()
            self._agree(ended.outcome, None, None)
            self._owner._record_end(self, ended.snapshot)
            raise StopIteration from None
        except Exception as e:
            self.close()
            self._agree(getattr(e, _OUTCOME, None), None, e)
            raise
        except BaseException:
            self.close()
            raise
        try:
            self._agree(made.outcome, made.where, None)
        except BaseException:
            self.close()
            raise
        self._owner._record(self, made.snapshot, time.perf_counter() - t0)
        self._next += 1
        return made.batch

    def _agree(
        self,
        outcome: list[str] | None,
        where: Callable[[int], str] | None,
        error: BaseException | None,
    ) -> None:
        """The agreement check of batch ``self._next``'s outcome (a collective on every process,
        in program order): raises ``ProcessDisagreementError`` on every process whose outcome is
        a batch or the end when the outcomes differ; a process whose outcome is ``error`` gets
        a note on it instead (its caller re-raises it)."""
        if outcome is None:
            return
        every = self._backend.exchange_agreement(self._mesh, outcome)
        if every is None:
            return
        problem = outcome_disagreement(
            f"GlobalBatchLoader: batch {self._next}",
            every,
            where or (lambda i: f"GlobalBatchLoader: batch {self._next}: leaf {i}"),
        )
        if error is not None:
            error.add_note(f"(the other processes' outcomes differ: {problem})")
            return
        raise problem

    def _produce_here(self) -> _Made:
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

    def close(self) -> None:
        """Stops the background thread and frees queued batches (idempotent)."""
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._producer = None


class GlobalBatchLoader(Iterable[Any]):
    """Wraps an iterable of host batches; yields global sharded batches, prefetched.

    For each host batch (a tree of numpy arrays or CPU tensors), on a background thread:
    ``dispatcher.logical_to_physical_batch`` if a dispatcher is given, then
    ``host_to_global_array``. Batches come out in order, structure and types kept.

    Args:
        loader: any iterable of host batches: a ``DataLoader`` (with worker processes),
            torchdata's ``StatefulDataLoader``, a list, a generator (one epoch only).
        partition: as for ``host_to_global_array``; a ``DataPartitionType`` is accepted here
            without a deprecation warning (it is converted to a spec once per epoch). Default:
            ``FULL``, or the dispatcher's ``partition_spec`` when a dispatcher is given.
        mesh: the mesh; default: the current mesh of the thread that calls ``iter()``.
        dispatcher: an ``InputDispatcher`` (anything with ``logical_to_physical_batch``).
        prefetch: the most batches transferred ahead of the consumer (the batch it holds is
            not counted; no transfer starts before a slot is free). ``0``: no thread, each
            batch is transferred inside ``next()``.

    Raises (at the consumer's ``next()`` for the batch concerned, as the original exception
    with a note naming the batch): the source's own errors; ``ShardingError`` (a
    ``ValueError``) for a batch whose structure, shapes or dtypes differ from the first
    batch's, naming the batch and the tree path; ``IndivisibleError`` for a batch that does
    not split over the devices, naming the dispatcher setting that fixes it. With several
    processes on the DTensor backend (agreement check on), every process raises at the same
    batch when their batches differ in structure, shape or dtype, or when one process's source
    ends or fails there: ``ProcessDisagreementError`` naming each process's outcome (a
    process whose source failed raises its own error, with a note).

    Example (mesh ``(4, 2)``; 8 rows per batch, one per device)::

        >>> source = DataLoader(dataset, batch_size=8, num_workers=2)
        >>> with mesh, GlobalBatchLoader(source) as loader:
        ...     for batch in loader:
        ...         loss = step(batch)
        >>> loader.stats.wait_seconds
        0.012
    """

    def __init__(
        self,
        loader: Iterable[Any],
        /,
        *,
        partition: Any = DEFAULT_PARTITION,
        mesh: Mesh | None = None,
        dispatcher: Any = None,
        prefetch: int = 2,
    ) -> None:
        self._setup(
            [loader],
            None if dispatcher is None else [dispatcher],
            partition=partition,
            mesh=mesh,
            prefetch=prefetch,
            assemble=_assemble_one,
        )

    @classmethod
    def _from_hosts(
        cls,
        loaders: Sequence[Iterable[Any]],
        dispatchers: Sequence[Any] | None,
        *,
        partition: Any,
        mesh: Mesh | None,
        prefetch: int,
        assemble: Assemble,
    ) -> GlobalBatchLoader:
        """A loader with one source per (virtual) host and its own assembly function."""
        self = cls.__new__(cls)
        self._setup(
            list(loaders),
            None if dispatchers is None else list(dispatchers),
            partition=partition,
            mesh=mesh,
            prefetch=prefetch,
            assemble=assemble,
        )
        return self

    def _setup(
        self,
        sources: list[Any],
        dispatchers: list[Any] | None,
        *,
        partition: Any,
        mesh: Mesh | None,
        prefetch: int,
        assemble: Assemble,
    ) -> None:
        for h, s in enumerate(sources):
            if not isinstance(s, Iterable):
                where = "loader" if len(sources) == 1 else f"loaders[{h}]"
                raise TypeError(
                    f"{where}: expected an iterable of host batches (a DataLoader, a list, a "
                    f"generator), but got {type(s).__name__}."
                )
        for h, d in enumerate(dispatchers or ()):
            if not callable(getattr(d, "logical_to_physical_batch", None)):
                where = "dispatcher" if len(sources) == 1 else f"dispatchers[{h}]"
                raise TypeError(
                    f"{where}: expected an input dispatcher (e.g. torchshard.InputDispatcher, "
                    "with logical_to_physical_batch and physical_to_logical_batch), but got "
                    f"{type(d).__name__}."
                )
        if dispatchers is not None and len(dispatchers) != len(sources):
            raise ValueError(
                f"dispatchers: expected one per source ({len(sources)}), but got "
                f"{len(dispatchers)}."
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch: expected an int >= 0, but got {prefetch!r}.")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected a torchshard.Mesh or None, but got {mesh!r}.")
        self._sources = sources
        self._dispatchers = dispatchers
        self._partition = partition
        self._mesh = mesh
        self._prefetch = prefetch
        self._assemble = assemble
        self._counters = _Counters()
        self._epoch: weakref.ref[_Epoch] | None = None
        self._snapshot: list[Any] | None = None  # the sources' state after the consumed batch
        self._next_batch = 0  # the index in its epoch of the batch the consumer takes next
        self._resume_at: int | None = None  # set by load_state_dict for the next iter()

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """Starts an epoch (closing the previous one): a new iterator over the source."""
        self._close_epoch()
        mesh = self._mesh or current_mesh()
        if mesh is None:
            raise NoMeshError(
                "GlobalBatchLoader: iter() needs a mesh: call it inside `with mesh:` or pass "
                "GlobalBatchLoader(..., mesh=mesh)."
            )
        with thread_mesh(mesh):
            self._check_hosts(current_topology(mesh))
            spec = self._spec()
        backend = get_backend(mesh)
        backend.prepare(mesh)  # its set-up collectives run here, never on the loader's thread
        its = [iter(s) for s in self._sources]  # DataLoader workers start in this thread
        first = self._resume_at or 0
        self._resume_at = None
        producer = _Producer(
            its,
            self._sources,
            self._dispatchers,
            spec,
            mesh,
            self._assemble,
            self._counters,
            first,
            explicit_partition=self._partition is not DEFAULT_PARTITION,
            agree=len(self._sources) == 1 and backend.agreement_active(mesh),
        )
        self._snapshot = producer.snapshot()
        self._next_batch = first
        epoch = _Epoch(self, producer, self._prefetch)
        self._epoch = weakref.ref(epoch)
        return epoch

    def _check_hosts(self, topology: Topology) -> None:
        count, n = topology.process_count, len(self._sources)
        if n > 1 and count != n:
            raise ShardingError(
                f"global_batch_loader_per_host: expected one source per host, {count} in all "
                f"(virtual_hosts({count}) is active), but got {n}."
            )
        if n == 1 and topology.virtual and count > 1:
            raise ShardingError(
                f"GlobalBatchLoader inside virtual_hosts({count}) has only one host's source; "
                "use torchshard.testing.global_batch_loader_per_host with one source per host."
            )

    def _spec(self) -> Any:
        partition = self._partition
        if partition is DEFAULT_PARTITION and self._dispatchers is not None:
            return self._dispatchers[0].partition_spec
        if partition is DEFAULT_PARTITION or partition is DataPartitionType.FULL:
            return DEFAULT_PARTITION  # FULL, without the deprecation warning
        return data_partition_type_to_spec(partition)

    def _current(self, epoch: _Epoch) -> bool:
        return self._epoch is not None and self._epoch() is epoch

    def _record(self, epoch: _Epoch, snapshot: list[Any] | None, wait: float) -> None:
        self._counters.add(batches=1, wait_seconds=wait)
        if self._current(epoch):
            self._snapshot = snapshot
            self._next_batch += 1

    def _record_end(self, epoch: _Epoch, snapshot: list[Any] | None) -> None:
        if self._current(epoch):
            self._snapshot = snapshot
            self._next_batch = 0  # a finished source starts its next epoch at batch 0

    def _close_epoch(self) -> None:
        epoch = self._epoch() if self._epoch is not None else None
        if epoch is not None:
            epoch.close()

    def close(self) -> None:
        """Stops the current epoch's thread and frees its queued batches (idempotent)."""
        self._close_epoch()

    def __enter__(self) -> GlobalBatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        lens = []
        for s in self._sources:
            if not hasattr(s, "__len__"):
                raise TypeError(f"GlobalBatchLoader: the source ({type(s).__name__}) has no len().")
            lens.append(len(s))
        if len(set(lens)) > 1:
            raise ValueError(f"GlobalBatchLoader: the hosts' sources differ in length: {lens}.")
        return lens[0]

    @property
    def stats(self) -> LoaderStats:
        """Counters since the loader was made: batches, bytes, wait and transfer seconds."""
        return self._counters.value

    # -- checkpointing --------------------------------------------------------------------
    def _key(self) -> str:
        return "source" if len(self._sources) == 1 else "sources"

    def state_dict(self) -> dict[str, Any]:
        """The position of the consumer: the source's state after the last batch it took.

        Batches prefetched but not yet taken are not counted, so resuming from this state
        yields them again. Requires a stateful source (``state_dict``/``load_state_dict``,
        e.g. ``torchdata.stateful_dataloader.StatefulDataLoader``).
        """
        self._require_stateful("state_dict")
        snapshot = self._snapshot
        if snapshot is None:  # never iterated
            snapshot = [s.state_dict() for s in self._sources]
        value = snapshot[0] if len(self._sources) == 1 else list(snapshot)
        return {self._key(): value, "next_batch": self._next_batch}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restores a position from ``state_dict()``; the next ``iter()`` resumes there."""
        self._require_stateful("load_state_dict")
        key = self._key()
        expected = {key, "next_batch"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"state_dict: expected a dict with keys {sorted(expected)} (from "
                f"GlobalBatchLoader.state_dict()), but got {got}."
            )
        states = [state_dict[key]] if key == "source" else list(state_dict[key])
        if len(states) != len(self._sources):
            raise ValueError(
                f"state_dict['sources']: expected one state per source ({len(self._sources)}), "
                f"but got {len(states)}."
            )
        self._close_epoch()
        for source, state in zip(self._sources, states, strict=True):
            source.load_state_dict(state)
        self._snapshot = states
        self._next_batch = self._resume_at = int(state_dict["next_batch"])

    def _require_stateful(self, method: str) -> None:
        for s in self._sources:
            if not _stateful(s):
                raise TypeError(
                    f"GlobalBatchLoader.{method}: the source ({type(s).__name__}) has no "
                    "state_dict()/load_state_dict(); use torchdata.stateful_dataloader."
                    "StatefulDataLoader to checkpoint the input position."
                )
