"""``GlobalBatchLoader``: host batches from any iterable -> global sharded batches, prefetched.

Data flow of one epoch (``iter(loader)``), see ``docs/design.md``:

1. In the caller's thread: capture the mesh (``mesh=`` or the current one), resolve the
   partition to a spec once, run the backend's set-up collectives (``ProcessChecks.prepare``), open
   the source iterator(s) (DataLoader workers start here, in the caller's thread), and give the
   epoch a new ``Cursor`` at the sources' current state.
2. On the background thread (``_prefetch.Prefetcher``, mesh made current there with
   ``thread_mesh``), per batch: the ``Producer`` (``_producer.py``) takes a free slot, pulls a
   host batch, checks it, applies the dispatcher and calls the engine.
3. The consumer's ``next()`` (``Epoch``, ``_epoch.py``) takes the global batch and its snapshot,
   frees the slot, runs the agreement step on the batch's outcome when the backend compares the
   processes, and moves its cursor (batches consumed, the source's state after that batch), so
   ``state_dict()`` describes what the consumer has taken, not what was prefetched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torchshard._backend.registry import lookup
from torchshard._core.checks import nonnegative_int
from torchshard._core.context import current_mesh, thread_mesh
from torchshard._core.errors import NoMeshError, ShardingError, at
from torchshard._core.partition import DEFAULT_PARTITION, feed_partition
from torchshard._core.topology import Topology
from torchshard._mesh.context import current_topology
from torchshard._mesh.mesh import Mesh
from torchshard._step.protocol import Dispatcher, is_dispatcher
from torchshard.data._epoch import Epoch
from torchshard.data._local import LocalEpoch
from torchshard.data._position import Cursor
from torchshard.data._producer import Producer, stateful
from torchshard.data._source import forward_set_epoch, source_attribute
from torchshard.data._stats import Counters, LoaderStats


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
        local: yield ``torchshard.to_local(batch)`` (DTensor leaves as this process's local
            blocks, no copy) for steps that compute per process: FSDP2, DDP, torchtitan. The
            checks and the agreement between processes still run on the global batch. On
            torch_xla the batch is unchanged (its SPMD step takes global tensors).

    As a ``DataLoader`` does, the loader has ``sampler``, ``batch_sampler`` and ``dataset``
    (the source's, ``None`` where it has none) and ``set_epoch(epoch)`` (forwarded to the
    source's sampler, or to the source), so Lightning, accelerate and loops that call
    ``set_epoch`` reshuffle.

    Raises (at the consumer's ``next()`` for the batch concerned, as the original exception
    with a note naming the batch): the source's own errors; ``ShardingError`` (a
    ``ValueError``) for a batch whose structure, shapes or dtypes differ from the first
    batch's, naming the batch and the tree path; ``IndivisibleError`` for a batch that does
    not split over the devices, naming the dispatcher setting that fixes it. With several
    processes on the DTensor backend (agreement check on), every process raises at the same
    batch when their batches differ in structure, shape or dtype, or when one process's source
    ends or fails there: ``ProcessDisagreementError`` naming each process's outcome (a
    process whose source failed raises its own error, with a note).

    Example (mesh ``(4, 2)``; 8 rows per batch, one per device):
        >>> from torch.utils.data import DataLoader
        >>> dataset = torch.arange(32.0).reshape(16, 2)
        >>> source = DataLoader(dataset, batch_size=8, num_workers=2)
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> with mesh, torchshard.GlobalBatchLoader(source) as loader:
        ...     for batch in loader:
        ...         print(batch.shape, batch.device.type, batch.sum().item())
        torch.Size([8, 2]) xla 120.0
        torch.Size([8, 2]) xla 376.0
        >>> loader.stats.batches, loader.stats.bytes
        (2, 128)
    """

    def __init__(
        self,
        loader: Iterable[Any],
        /,
        *,
        partition: Any = DEFAULT_PARTITION,
        mesh: Mesh | None = None,
        dispatcher: Dispatcher | None = None,
        prefetch: int = 2,
        local: bool = False,
    ) -> None:
        self._setup(
            [loader],
            None if dispatcher is None else [dispatcher],
            partition=partition,
            mesh=mesh,
            prefetch=prefetch,
            per_host=False,
            local=local,
        )

    def _setup(
        self,
        sources: list[Any],
        dispatchers: list[Dispatcher] | None,
        *,
        partition: Any,
        mesh: Mesh | None,
        prefetch: int,
        per_host: bool,
        local: bool = False,
    ) -> None:
        for h, s in enumerate(sources):
            if not isinstance(s, Iterable):
                where = "loader" if len(sources) == 1 else f"loaders[{h}]"
                raise TypeError(
                    at(
                        where,
                        f"expected an iterable of host batches (a DataLoader, a list, a "
                        f"generator), but got {type(s).__name__}.",
                    )
                )
        for h, d in enumerate(dispatchers or ()):
            if not is_dispatcher(d):
                where = "dispatcher" if len(sources) == 1 else f"dispatchers[{h}]"
                raise TypeError(
                    at(
                        where,
                        f"expected an input dispatcher (e.g. torchshard.InputDispatcher, "
                        "with logical_to_physical_batch and physical_to_logical_batch), but got "
                        f"{type(d).__name__}.",
                    )
                )
        if dispatchers is not None and len(dispatchers) != len(sources):
            raise ValueError(
                f"dispatchers: expected one per source ({len(sources)}), but got "
                f"{len(dispatchers)}."
            )
        prefetch = nonnegative_int(prefetch, "prefetch")
        if not isinstance(local, bool):
            raise TypeError(f"local: expected a bool, but got {local!r}.")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected a torchshard.Mesh or None, but got {mesh!r}.")
        self._sources = sources
        self._dispatchers = dispatchers
        self._partition = partition
        self._mesh = mesh
        self._prefetch = prefetch
        self._per_host = per_host
        self._local = local
        self._counters = Counters()
        self._epoch: weakref.ref[Epoch] | None = None
        # The consumer's position: the sources' state after the batch it took last (None:
        # never iterated) and the index in its epoch of the batch it takes next.
        self._cursor = Cursor(None, 0)
        self._resume_at: int | None = None  # set by load_state_dict for the next iter()

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """Starts an epoch: a new iterator over the source (``local=True``: of the batches'
        local views).

        A loader runs one epoch at a time: an earlier epoch's iterator still in progress is
        ended here, and using it again raises ``RuntimeError`` (it does not end silently, nor
        share the source with the new one)."""
        self._close_epoch(by="a later iter()")
        mesh = self._mesh or current_mesh()
        if mesh is None:
            raise NoMeshError(
                "GlobalBatchLoader: iter() needs a mesh: call it inside `with mesh:` or pass "
                "GlobalBatchLoader(..., mesh=mesh)."
            )
        with thread_mesh(mesh):
            self._check_hosts(current_topology(mesh))
            dispatcher = None if self._dispatchers is None else self._dispatchers[0]
            spec = feed_partition(self._partition, dispatcher)
        backend = lookup(mesh)
        checks = backend.processes
        if checks is not None:  # its set-up collectives run here, never on the loader's thread
            checks.prepare(mesh)
        its = [iter(s) for s in self._sources]  # DataLoader workers start in this thread
        first = self._resume_at or 0
        self._resume_at = None
        producer = Producer(
            its,
            self._sources,
            self._dispatchers,
            spec,
            mesh,
            self._counters,
            first,
            per_host=self._per_host,
            explicit_partition=self._partition is not DEFAULT_PARTITION,
            agree=len(self._sources) == 1 and checks is not None and checks.compares(mesh),
        )
        # A new cursor per epoch: an earlier epoch's iterator can no longer move the position.
        self._cursor = Cursor(producer.snapshot(), first)
        epoch = Epoch(producer, self._prefetch, counters=self._counters, cursor=self._cursor)
        self._epoch = weakref.ref(epoch)
        return LocalEpoch(epoch) if self._local else epoch

    def _check_hosts(self, topology: Topology) -> None:
        count, n = len(topology.data_hosts), len(self._sources)
        if n > 1 and count != n:
            raise ShardingError(
                f"global_batch_loader_per_host: expected one source per host, {count} in all "
                f"(virtual_hosts({count}) is active), but got {n}."
            )
        if n == 1 and count > 1:
            raise ShardingError(
                f"GlobalBatchLoader inside virtual_hosts({count}) has only one host's source; "
                "use torchshard.testing.global_batch_loader_per_host with one source per host."
            )

    def _close_epoch(self, by: str | None = None) -> None:
        """Closes the current epoch; ``by``: what ends it, so that its iterator, if used again,
        raises naming it (``None``: ``close()``, after which it just stops)."""
        epoch = self._epoch() if self._epoch is not None else None
        if epoch is not None:
            if by is None:
                epoch.close()
            else:
                epoch.end(by)

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

    # -- the DataLoader protocol (_source.py) ------------------------------------------------
    @property
    def sampler(self) -> Any:
        """The source's ``sampler`` (``None`` when it has none)."""
        return source_attribute(self._sources, "sampler")

    @property
    def batch_sampler(self) -> Any:
        """The source's ``batch_sampler`` (``None`` when it has none)."""
        return source_attribute(self._sources, "batch_sampler")

    @property
    def dataset(self) -> Any:
        """The source's ``dataset`` (``None`` when it has none)."""
        return source_attribute(self._sources, "dataset")

    def set_epoch(self, epoch: int) -> None:
        """Forwards ``set_epoch(epoch)`` to the source (when it has one), else to its
        ``sampler`` and ``batch_sampler``: the next ``iter()`` reads the epoch's order.

        Raises:
            TypeError: ``epoch`` not an int >= 0; a source with nothing to set the epoch on.
        """
        forward_set_epoch(self._sources, epoch)

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
        snapshot = self._cursor.snapshot
        if snapshot is None:  # never iterated
            snapshot = [s.state_dict() for s in self._sources]
        value = snapshot[0] if len(self._sources) == 1 else list(snapshot)
        return {self._key(): value, "next_batch": self._cursor.next_batch}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restores a position from ``state_dict()``; the next ``iter()`` resumes there.

        Everything is checked before anything changes: the keys, ``next_batch`` (an int >= 0),
        one state per source, and each source state against the source's own (a dict state
        must have the keys the source's ``state_dict()`` has: a state saved from another kind
        of source, or from a ``StatefulDataLoader`` with another ``num_workers``, is refused).
        An epoch in progress is ended: its iterator, if used again, raises ``RuntimeError``.

        Raises:
            ValueError: wrong keys, a negative ``next_batch``, another number of sources, a
                source state that is not this source's kind.
            TypeError: a ``state_dict`` that is not a dict, a ``next_batch`` that is not an int.
        """
        self._require_stateful("load_state_dict")
        key = self._key()
        expected = {key, "next_batch"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            hint = ""
            other = "sources" if key == "source" else "source"
            if isinstance(state_dict, dict) and set(state_dict) == {other, "next_batch"}:
                kind = "one source per host" if other == "sources" else "one source"
                hint = (
                    f" It is the state of a loader with {kind}; this loader has "
                    f"{len(self._sources)}."
                )
            elif isinstance(state_dict, dict) and not {"next_batch", key, other} & set(state_dict):
                hint = (
                    " Pass what GlobalBatchLoader.state_dict() returned, not the source's own "
                    "state."
                )
            error = ValueError if isinstance(state_dict, dict) else TypeError
            raise error(
                f"state_dict: expected a dict with keys {sorted(expected)} (from "
                f"GlobalBatchLoader.state_dict()), but got {got}.{hint}"
            )
        next_batch = state_dict["next_batch"]
        if isinstance(next_batch, bool) or not isinstance(next_batch, int):
            raise TypeError(
                "state_dict['next_batch']: expected an int (the index of the next batch of the "
                f"epoch, >= 0), but got {next_batch!r} of type {type(next_batch).__name__}."
            )
        if next_batch < 0:
            raise ValueError(
                "state_dict['next_batch']: expected the index of the next batch of the epoch, "
                f">= 0, but got {next_batch}."
            )
        value = state_dict[key]
        if key == "sources" and not isinstance(value, (list, tuple)):
            raise TypeError(
                "state_dict['sources']: expected a list with one state per source "
                f"({len(self._sources)}), but got {type(value).__name__}."
            )
        states = [value] if key == "source" else list(value)
        if len(states) != len(self._sources):
            raise ValueError(
                f"state_dict['sources']: expected one state per source ({len(self._sources)}), "
                f"but got {len(states)}."
            )
        # What each source's state looks like: the consumer's last snapshot (a source that an
        # epoch's thread is reading is not asked from this thread), else the source's own.
        current = self._cursor.snapshot
        if current is None:
            current = [s.state_dict() for s in self._sources]
        for h, (source, state) in enumerate(zip(self._sources, states, strict=True)):
            where = "state_dict['source']" if key == "source" else f"state_dict['sources'][{h}]"
            _check_source_state(source, current[h], state, where)
        self._close_epoch(by="load_state_dict()")
        for h, (source, state) in enumerate(zip(self._sources, states, strict=True)):
            try:
                source.load_state_dict(state)
            except Exception as e:
                where = "state_dict['source']" if key == "source" else f"state_dict['sources'][{h}]"
                e.add_note(
                    f"(raised by {type(source).__name__}.load_state_dict, given {where}, in "
                    "GlobalBatchLoader.load_state_dict)"
                )
                raise
        self._resume_at = next_batch
        self._cursor = Cursor(states, next_batch)

    def _require_stateful(self, method: str) -> None:
        for s in self._sources:
            if not stateful(s):
                raise TypeError(
                    f"GlobalBatchLoader.{method}: the source ({type(s).__name__}) has no "
                    "state_dict()/load_state_dict(); use torchdata.stateful_dataloader."
                    "StatefulDataLoader to checkpoint the input position."
                )


def _check_source_state(source: Any, current: Any, state: Any, where: str) -> None:
    """When ``source``'s state (``current``) is a dict, ``state`` must be a dict with the same
    keys (else it was saved from another kind of source): ``TypeError``/``ValueError`` naming
    ``where``."""
    if not isinstance(current, dict):
        return
    if not isinstance(state, dict):
        raise TypeError(
            at(
                where,
                f"expected the state of this loader's source ({type(source).__name__}: a "
                f"dict with keys {sorted(current)}), but got {type(state).__name__} {state!r:.60}.",
            )
        )
    if set(state) != set(current):
        raise ValueError(
            at(
                where,
                f"expected the state of this loader's source ({type(source).__name__}: a "
                f"dict with keys {sorted(current)}), but got keys {sorted(state)}; it was saved "
                "from another kind of source (or one configured otherwise, e.g. another "
                "num_workers). Load the state that this loader's state_dict() saved.",
            )
        )


def per_host_loader(
    loaders: Sequence[Iterable[Any]],
    dispatchers: Sequence[Any] | None,
    *,
    partition: Any,
    mesh: Mesh | None,
    prefetch: int,
) -> GlobalBatchLoader:
    """A ``GlobalBatchLoader`` with one source (and dispatcher) per host this process supplies
    (``torchshard.testing.global_batch_loader_per_host``); everything else is the same."""
    loader = GlobalBatchLoader.__new__(GlobalBatchLoader)
    loader._setup(
        list(loaders),
        None if dispatchers is None else list(dispatchers),
        partition=partition,
        mesh=mesh,
        prefetch=prefetch,
        per_host=True,
    )
    return loader
