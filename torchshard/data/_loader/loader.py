"""``GlobalBatchLoader``: host batches from any iterable -> global sharded batches, prefetched.

Data flow of one epoch (``iter(loader)``), see ``docs/design.md``:

1. In the caller's thread, ``iter()`` makes the epoch's plan (``plan.py``): it captures the mesh
   (``mesh=`` or the current one), resolves the partition to a spec once, runs the backend's
   set-up collectives and opens the epoch's channel of exchanges (in program order); then it
   opens the source iterator(s) (DataLoader workers start here, in the caller's thread) and
   gives the epoch a new ``Cursor`` at the sources' current state.
2. The plan's producer (``producer.py``) makes each batch, on the loader's thread
   (``prefetch.Prefetcher``, mesh made current there) or inside ``next()`` (``prefetch=0``):
   it pulls a host batch, checks it, applies the dispatcher, calls the engine and, when the
   processes compare, exchanges the batch's outcome (``exchanges.py``) before handing it over.
3. The consumer's ``next()`` (``Epoch``, ``epoch.py``) takes the global batch and its snapshot,
   frees the slot and moves its cursor (batches consumed, the source's state after that batch),
   so ``state_dict()`` describes what the consumer has taken, not what was prefetched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torchshard._backend.registry import default_name, lookup
from torchshard._core.checks import nonnegative_int, positive_int
from torchshard._core.context import current_mesh, thread_mesh
from torchshard._core.errors import NoMeshError, ShardingError, at
from torchshard._core.mesh import Mesh as MeshValue
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.topology import Topology
from torchshard._mesh.context import current_topology
from torchshard._mesh.mesh import Mesh
from torchshard._step.protocol import Dispatcher, is_dispatcher
from torchshard.data._loader import checkpoint, elastic, length
from torchshard.data._loader.cursor import Cursor
from torchshard.data._loader.epoch import Closer, Epoch, uncopyable
from torchshard.data._loader.exchanges import Exchanges
from torchshard.data._loader.last_batch import LeafPath, check_policy, leaf_path
from torchshard.data._loader.local import LocalEpoch
from torchshard.data._loader.plan import plan_epoch
from torchshard.data._loader.producer import producer_for
from torchshard.data._loader.replay import Replay, one_pass
from torchshard.data._loader.source import forward_set_epoch, source_attribute
from torchshard.data._loader.stats import Counters, LoaderStats
from torchshard.data._packer import refuse_packed_context_parallel
from torchshard.data._stream_shard import record_for_workers, workers_recorded


class GlobalBatchLoader(Iterable[Any]):
    """Wraps an iterable of host batches; yields global sharded batches, prefetched.

    For each host batch (a tree of numpy arrays or CPU tensors), on a background thread:
    ``dispatcher.logical_to_physical_batch`` if a dispatcher is given, then
    ``host_to_global_array``. Batches come out in order, structure and types kept.

    Args:
        loader: any iterable of host batches: a ``DataLoader`` (with worker processes),
            torchdata's ``StatefulDataLoader``, a list, a generator. A one-pass source (its
            own iterator: a generator) is read once over all epochs: each ``iter()`` goes on
            where the consumer left off, with the batches read ahead and not taken (after a
            ``break``, ``close()``, an error) first.
        partition: as for ``host_to_global_array``; a ``DataPartitionType`` is accepted here
            without a deprecation warning (it is converted to a spec once per epoch). Default:
            ``FULL``, or the dispatcher's ``partition_spec`` when a dispatcher is given.
        mesh: the mesh; default: the current mesh of the thread that calls ``iter()``.
        dispatcher: an ``InputDispatcher`` (anything with ``logical_to_physical_batch``).
        prefetch: the most batches transferred ahead of the consumer (the batch it holds is
            not counted; no transfer starts before a slot is free). ``0``: no thread, each
            batch is transferred inside ``next()``. When the processes compare each batch (the
            DTensor agreement check on several processes), one batch more is made ahead, whose
            outcome exchange is under way, so that no batch waits for the other processes'
            making of the same batch (not with ``prefetch_bytes``: there each batch's
            exchange waits at once).
        prefetch_bytes: the most host bytes of batches transferred ahead (``None``: no bound
            but ``prefetch``). A batch is read only while the batches ahead and one more of the
            last one's size fit; one batch always moves, even larger than the bound. Host
            memory then holds at most the consumer's batch and ``prefetch_bytes`` more.
        last_batch: what happens when the sources run out unevenly (a short last batch, or one
            process's source ending before another's):

            - ``"error"`` (the default): the batch where they disagree raises, on every process
              (``ProcessDisagreementError`` naming each one's outcome).
            - ``"drop"``: every process stops at the same batch, the first at which any
              process's source ends or gives a short batch (its ``batch_size``, else the first
              batch's rows, is a whole batch); what was read and not yielded is counted in
              ``stats.dropped_examples``.
            - ``"pad"``: every batch is ``(batch, mask)``: ``mask`` is a global bool tensor of
              shape ``(global_batch_size,)``, split along dim 0 like the batch, ``True`` for
              real examples; in each process's block the real rows come first. A short batch
              is padded with zero rows, and a process whose source ended contributes zero rows
              until every process's source has ended: every process runs the same number of
              steps on batches of the same shapes (no recompilation at the epoch's end), and a
              metric weighted by ``mask`` counts every example of the epoch once. With a
              dispatcher the mask has the physical batch's rows (the dispatcher's padding rows
              are ``False`` too).

            With ``"drop"``/``"pad"`` on several processes (DTensor), every ``next()``
            exchanges each process's status with the others (torchshard's exchange tree), also
            with the agreement check off (bounded by the group's timeout, like the check).
        local: yield ``torchshard.to_local(batch)`` (DTensor leaves as this process's local
            blocks, no copy) for steps that compute per process: FSDP2, DDP, torchtitan. The
            checks and the agreement between processes still run on the global batch. On
            torch_xla the batch is unchanged (its SPMD step takes global tensors).
        batch_leaf: the leaf whose dim 0 holds the batch's examples, which ``last_batch``
            counts, pads and masks and the position in the epoch counts: its key
            (``"input_ids"``) or a tuple of keys and indices for a nested leaf (``("inputs",
            "ids")``). Default: the first leaf (in tree order: a dict's sorted keys) whose dim 0
            the partition splits; name it when that is a per-batch table or another leaf
            without the batch's rows.
        allow_equal_batches: batches that are equal on purpose (synthetic data such as zeros,
            replicas meant to repeat): a DataLoader whose worker processes yield the same first
            batch from a stream is then not refused as workers that each read the whole
            stream.

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
        prefetch_bytes: int | None = None,
        last_batch: str = "error",
        local: bool = False,
        batch_leaf: Any = None,
        allow_equal_batches: bool = False,
    ) -> None:
        self._setup(
            [loader],
            None if dispatcher is None else [dispatcher],
            partition=partition,
            mesh=mesh,
            prefetch=prefetch,
            per_host=False,
            prefetch_bytes=prefetch_bytes,
            last_batch=last_batch,
            local=local,
            batch_leaf=batch_leaf,
            allow_equal_batches=allow_equal_batches,
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
        prefetch_bytes: int | None = None,
        last_batch: str = "error",
        local: bool = False,
        batch_leaf: Any = None,
        allow_equal_batches: bool = False,
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
        if prefetch_bytes is not None:
            prefetch_bytes = positive_int(prefetch_bytes, "prefetch_bytes")
        self._last_batch = check_policy(last_batch)
        self._prefetch_bytes = prefetch_bytes
        if not isinstance(local, bool):
            raise TypeError(f"local: expected a bool, but got {local!r}.")
        if not isinstance(allow_equal_batches, bool):
            raise TypeError(
                f"allow_equal_batches: expected a bool, but got {allow_equal_batches!r}."
            )
        self._batch_leaf: LeafPath | None = leaf_path(batch_leaf)
        self._equal_batches = allow_equal_batches
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
        self._closer: Closer | None = None  # the last epoch's, to close it once abandoned
        # The consumer's position: the sources' state after the batch it took last (None:
        # never iterated) and the index in its epoch of the batch it takes next.
        self._cursor = Cursor(None, 0)
        # Set by load_state_dict for the next iter(): its first batch and global position.
        self._resume_at: int | None = None
        self._resume_consumed = 0
        self._last_mesh: MeshValue | None = None
        # Loaded states of sources whose iterators hold them (grain's), for the next iter().
        self._pending: list[Any] = [None] * len(sources)
        self._epoch_set: int | None = None  # the last set_epoch(); a sampler's epoch wins
        # One-pass sources (generators): what was read ahead and not taken, for the next epoch.
        self._replays: list[Replay | None] = [None] * len(sources)

    def __copy__(self) -> GlobalBatchLoader:
        raise TypeError(uncopyable("copy.copy", "a GlobalBatchLoader"))

    def __deepcopy__(self, memo: dict[int, Any]) -> GlobalBatchLoader:
        raise TypeError(uncopyable("copy.deepcopy", "a GlobalBatchLoader"))

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(uncopyable("pickle.dumps", "a GlobalBatchLoader"))

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
            refuse_packed_context_parallel(self._sources, self._partition, self._dispatchers, mesh)
        samplers = checkpoint.samplers(self._sources)
        plan = plan_epoch(
            mesh,
            sources=self._sources,
            dispatchers=self._dispatchers,
            partition=self._partition,
            per_host=self._per_host,
            policy=self._last_batch,
            prefetch=self._prefetch,
            prefetch_bytes=self._prefetch_bytes,
            first=self._resume_at or 0,
            samplers=samplers,
            batch_leaf=self._batch_leaf,
            equal_batches=self._equal_batches,
        )
        checks = plan.backend.processes
        exchanges = None
        if plan.channel is not None and checks is not None:
            exchanges = Exchanges(checks, mesh, plan.channel)
        topology = current_topology(mesh)
        its: list[Any] = []
        with thread_mesh(mesh):  # DataLoader workers start here, in this thread
            for h, s in enumerate(self._sources):
                record_for_workers(mesh, topology, process_index=topology.data_hosts[h])
                with workers_recorded(s):  # forkserver workers: the record, not the server's
                    it = iter(s)
                state = self._pending[h]
                if state is not None:  # grain's: the state goes into the pass's iterator
                    self._pending[h] = None
                    _restore_iterator(it, state, h, self._per_host, self._where()[0])
                if one_pass(s, it):  # read on from the first batch no consumer took
                    replay = self._replays[h]
                    if replay is None:
                        replay = self._replays[h] = Replay(it)
                    its.append(replay)
                else:
                    its.append(it)
        consumed = self._resume_consumed if self._resume_at is not None else None
        self._resume_at, self._resume_consumed = None, 0
        if consumed is None:
            consumed = samplers[0].start if samplers else 0
        producer = producer_for(
            plan, its, self._sources, self._dispatchers, self._counters, exchanges
        )
        # A new cursor per epoch: an earlier epoch's iterator can no longer move the position.
        self._cursor = Cursor(producer.snapshot(), plan.first, consumed, self._present_epoch())
        self._last_mesh = mesh
        epoch = Epoch(
            plan,
            producer,
            counters=self._counters,
            cursor=self._cursor,
            exchanges=exchanges,
            samplers=samplers,
        )
        self._epoch = weakref.ref(epoch)
        self._closer = epoch.closer
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

    def _close_epoch(self, by: str | None = None, timeout: float | None = None) -> None:
        """Closes the current epoch; ``by``: what ends it, so that its iterator, if used again,
        raises naming it (``None``: ``close()``, after which it just stops)."""
        epoch = self._epoch() if self._epoch is not None else None
        if epoch is not None:
            epoch.close(timeout, by=by)
        elif self._closer is not None:  # abandoned: its finaliser only retired the thread
            self._closer.close(timeout)
        self._closer = None

    def close(self, *, timeout: float | None = None) -> None:
        """Stops the current epoch's thread and frees its queued batches (idempotent; also
        after a ``break`` out of the epoch). A one-pass source's batches read ahead are kept
        for the next ``iter()``.

        The thread is waited for while it places a batch or exchanges one with the other
        processes, at most ``timeout`` seconds (``None``: 10 s), then a warning is logged.
        A thread inside the source (a slow dataset, stuck DataLoader workers) is not waited
        for: ``close`` returns at once and the daemon thread ends when the source returns,
        making nothing more; it does not hold up the interpreter's exit. ``timeout=0`` does
        not wait at all (as after Ctrl-C: leaving a ``with GlobalBatchLoader(...)`` block by
        ``KeyboardInterrupt`` or ``SystemExit`` closes it so)."""
        self._close_epoch(timeout=timeout)

    def __enter__(self) -> GlobalBatchLoader:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        interrupted = isinstance(exc_type, type) and issubclass(
            exc_type, (KeyboardInterrupt, SystemExit)
        )
        self.close(timeout=0 if interrupted else None)

    def __len__(self) -> int:
        """The batches an epoch yields, the same on every process: with ``last_batch="pad"``
        the longest source's, with ``"drop"`` the fewest whole batches (those before the
        first short one) of any source, with ``"error"`` the sources' common length; from the
        sources' ``len()`` (and, for ``"drop"``, their ``batch_size`` and examples).

        On several processes (DTensor) the processes' counts are exchanged (one bounded
        exchange, on the calling thread: call ``len()`` on every process, as Lightning does).

        Raises:
            TypeError: a length that cannot be known (a source without ``len()``; with
                ``"drop"``, a source without ``batch_size``), on every process alike.
            ValueError: with ``"error"``, sources that yield different numbers of batches.
            NoMeshError: on several processes, outside any mesh (the counts are exchanged
                between the mesh's processes): call it inside ``with mesh:`` or pass ``mesh=``.
        """
        mesh = self._mesh or current_mesh() or self._last_mesh
        dispatcher = None if self._dispatchers is None else self._dispatchers[0]
        rows = length.batch_rows(mesh, self._partition, dispatcher, self._batch_leaf)
        drop = self._last_batch == "drop"
        size = length.whole_size(self._sources, rows) if drop else None
        counts = [length.count(s, rows, need_whole=drop, size=size) for s in self._sources]
        every, names = [counts], ["this process"]
        processes = 1
        if not self._per_host:
            if mesh is not None:
                processes = current_topology(mesh).process_count
            elif default_name() == "dtensor":  # (never starts torch_xla's runtime to ask)
                processes = current_topology(None).process_count
        if processes > 1:
            if mesh is None:
                raise NoMeshError(
                    f"len(GlobalBatchLoader) on {processes} processes exchanges their sources' "
                    "lengths between the mesh's processes, but there is no mesh: call len() "
                    "inside `with mesh:` or pass GlobalBatchLoader(..., mesh=mesh)."
                )
            checks = lookup(mesh).processes
            if checks is not None:
                every, names = length.exchange(checks, mesh, counts)

        def where(p: int, h: int) -> str:
            if len(every) > 1:
                return f"{names[p]}'s source"
            return f"host {h}'s source" if self._per_host else "the source"

        return length.epoch_length(self._last_batch, every, where=where)

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
        self._epoch_set = epoch

    def _present_epoch(self) -> int | None:
        """The epoch the next ``iter()`` reads: the samplers' (``host_sampler``), else the last
        ``set_epoch``'s (``None``: not known)."""
        samplers = checkpoint.samplers(self._sources)
        return samplers[0].epoch if samplers else self._epoch_set

    @property
    def stats(self) -> LoaderStats:
        """Counters since the loader was made: batches, bytes, wait and transfer seconds."""
        return self._counters.value

    # -- checkpointing --------------------------------------------------------------------
    def _where(self) -> tuple[int, int, int]:
        """``(process index, processes, data hosts)`` of this loader's state: one process
        feeding every host of a per-host loader; else the mesh's topology (the loader's, the
        current one, the last ``iter()``'s, else the default backend's)."""
        if self._per_host:
            return 0, 1, len(self._sources)
        mesh = self._mesh or current_mesh() or self._last_mesh
        topology = current_topology(mesh)
        return topology.process_index, topology.process_count, topology.process_count

    def _position(self, consumed: int) -> checkpoint.Position | None:
        samplers = checkpoint.samplers(self._sources)
        if samplers is None:
            return None
        s = samplers[0]
        return checkpoint.Position(
            epoch=s.epoch, consumed=consumed, shards=s.num_replicas, **s.identity()
        )

    def state_dict(self) -> dict[str, Any]:
        """The position of the consumer, taken now: a snapshot nothing changes afterwards.

        ``{"process_<i>": {"source": ..., "next_batch": k}, "common": {...}}``: this process's
        entry (``"sources"``, one per host, for ``global_batch_loader_per_host``) holds each
        source's state after the last batch the consumer took (a deep copy taken then, pickled:
        batches prefetched but not yet taken are not counted, so a resume yields them again);
        ``"common"``, the same on every process, holds how many processes and data hosts saved
        it and, for sources that read through ``torchshard.host_sampler``, the epoch, the
        examples of its global order consumed and the samplers' shard count: any number of
        hosts, or another layout of as many, resumes from that position. After a loop broken
        off mid-epoch and ``set_epoch(e)`` for another epoch, the state is epoch ``e`` from its
        start (what the next ``iter()`` reads).

        Sources: ``state_dict()``/``load_state_dict()`` (``StatefulDataLoader``,
        ``torchdata.nodes.Loader``), ``get_state()``/``set_state()`` (grain), or a
        ``DataLoader`` over ``torchshard.host_sampler`` (resumed by its position alone).
        Before the first ``iter()`` a source's state is ``None``: the source is not asked for
        one (a ``torchdata.nodes.Loader`` asked before ``iter()`` would ignore a state loaded
        later), and loading it starts the source's next pass afresh.

        With ``torch.distributed.checkpoint``, every process saves the loader as a
        ``Stateful`` (``dcp.save({"loader": loader}, ...)``): the per-process keys differ, and
        the common entry is equal everywhere, so the checkpoint keeps one of it.
        """
        self._require_checkpointable("state_dict")
        process, processes, hosts = self._where()
        cursor = self._cursor
        snapshot, next_batch, consumed = cursor.snapshot, cursor.next_batch, cursor.consumed
        if cursor.superseded(self._present_epoch()):
            # A loop broken off mid-epoch, then set_epoch(e) for another epoch: the next iter()
            # starts epoch e at its beginning (a new pass of every source), and so does a resume.
            samplers = checkpoint.samplers(self._sources)
            snapshot, next_batch, consumed = None, 0, samplers[0].start if samplers else 0
        states = list(snapshot) if snapshot is not None else [None] * len(self._sources)
        job = parts = None
        if all(elastic.elastic(s) for s in self._sources):
            mesh = self._mesh or current_mesh() or self._last_mesh
            checks = lookup(mesh).processes if mesh is not None else None
            count = 1 if self._per_host else processes
            job = elastic.gather(self._sources, states, mesh=mesh, processes=checks, count=count)
            parts = elastic.parts_of(self._sources, states) if job is None else None
        return checkpoint.build(
            process=process,
            per_host=self._per_host,
            sources=self._sources,
            states=states,
            next_batch=next_batch,
            processes=processes,
            hosts=hosts,
            position=self._position(consumed),
            job=job,
            parts=parts,
        )

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restores a position from ``state_dict()``; the next ``iter()`` resumes there.

        Takes the state this process saved, or the union of every process's states (the
        common entry is equal in all). Saved by as many processes and data hosts as this run
        has: each source loads its own state (``load_state_dict``/``set_state``). Saved by
        another number (``N`` processes resumed on ``M``): the sources must read through
        ``torchshard.host_sampler`` (same dataset length, seed and shuffle); each sampler then
        restarts the saved epoch at the next unconsumed example of its global order, split
        over the new hosts, and the sources start a new pass (their own saved states, which
        are per process, are not used). With ``torch.distributed.checkpoint`` on more
        processes than saved, load with ``DefaultLoadPlanner(allow_partial_load=True)`` (the
        new processes' keys are not in the checkpoint).

        Everything is checked before anything changes, and the sources are not asked for
        their state (a ``torchdata.nodes.Loader`` would then ignore the loaded one). An epoch
        in progress is ended: its iterator, if used again, raises ``RuntimeError``.

        Raises:
            ValueError: not a ``GlobalBatchLoader``'s state, wrong keys, a negative
                ``next_batch``, another number of sources, a source state saved from another
                kind of source (or another ``num_workers``), another number of hosts with
                sources whose state is per process (naming both counts and the fix), or
                samplers of another order.
            TypeError: a ``state_dict`` that is not a dict, a ``next_batch`` that is not an int.
        """
        self._require_checkpointable("load_state_dict")
        process, processes, hosts = self._where()
        samplers = checkpoint.samplers(self._sources)
        loaded = checkpoint.parse(
            state_dict,
            process=process,
            per_host=self._per_host,
            sources=self._sources,
            processes=processes,
            hosts=hosts,
            resizable=samplers is not None,
            shards=samplers[0].num_replicas if samplers else None,
            fix=(
                "Resume on the same number of processes, or feed map-style data through "
                "torchshard.host_sampler: its position in the epoch's global order resumes on "
                "any number of hosts."
            ),
        )
        key = checkpoint.process_key(process)
        name = "sources" if self._per_host else "source"
        # A state of the same kind as this loader's own last snapshot (never the source's own:
        # asking a fresh source for its state can disturb it).
        current = self._cursor.snapshot
        for h, (source, state) in enumerate(zip(self._sources, loaded.states, strict=True)):
            if current is not None and current[h] is not None and state is not None:
                where = f"state_dict[{key!r}][{name!r}]" + (f"[{h}]" if self._per_host else "")
                _check_source_state(source, current[h], state, where)
        position = loaded.position
        if position is not None and samplers is not None:
            for h, sampler in enumerate(samplers):
                mine, saved = sampler.identity(), position.identity()
                if mine != saved:
                    where = "" if not self._per_host else f" (host {h}'s)"
                    raise ValueError(
                        f"state_dict['common']: saved over an epoch order of {saved}, but this "
                        f"loader's sampler{where} has {mine}; a position in one order means "
                        "nothing in another. Resume with the same dataset, seed and shuffle."
                    )
        self._close_epoch(by="load_state_dict()")
        self._pending = [None] * len(self._sources)
        for h, (source, state) in enumerate(zip(self._sources, loaded.states, strict=True)):
            if state is None:  # a new pass, from the global position when there is one
                if position is not None and samplers is not None:
                    samplers[h].resume(position.epoch, position.consumed)
                if loaded.job is not None:  # elastic: this process's share of the job's
                    try:
                        source.load_elastic_state(loaded.job["position"])
                    except Exception as e:
                        e.add_note(
                            f"(raised by {type(source).__name__}.load_elastic_state, given "
                            "state_dict['common']['elastic']['position'], in "
                            "GlobalBatchLoader.load_state_dict)"
                        )
                        raise
                continue
            if checkpoint.iterator_stateful(source):  # loaded into the next iter()'s iterator
                self._pending[h] = state
                continue
            try:
                checkpoint.restore(source, state)
            except Exception as e:
                where = f"state_dict[{key!r}][{name!r}]" + (f"[{h}]" if self._per_host else "")
                e.add_note(
                    f"(raised by {checkpoint.method_name(source, 1)}, given {where}, in "
                    "GlobalBatchLoader.load_state_dict)"
                )
                raise
        self._resume_at = loaded.next_batch
        self._resume_consumed = position.consumed if position is not None else 0
        self._cursor = Cursor(
            list(loaded.states),
            loaded.next_batch,
            self._resume_consumed,
            position.epoch if position is not None else None,
        )

    def _require_checkpointable(self, method: str) -> None:
        for s in self._sources:
            if not checkpoint.checkpointable(s):
                raise TypeError(
                    f"GlobalBatchLoader.{method}: the source ({type(s).__name__}) has no "
                    "state_dict()/load_state_dict() (nor get_state()/set_state()) and reads no "
                    "torchshard.host_sampler; use torchdata.stateful_dataloader.StatefulDataLoader "
                    "to checkpoint the input position."
                )


def _restore_iterator(it: Any, state: Any, h: int, per_host: bool, process: int) -> None:
    """Loads a saved state into the iterator of a source whose iterators hold it (grain's);
    the error notes which entry of the state it was."""
    try:
        checkpoint.restore(it, state)
    except Exception as e:
        key = checkpoint.process_key(process)
        where = f"state_dict[{key!r}]" + (f"['sources'][{h}]" if per_host else "['source']")
        e.add_note(
            f"(raised by {checkpoint.method_name(it, 1)} of the iterator iter() made, given "
            f"{where}, loaded by GlobalBatchLoader.load_state_dict)"
        )
        raise


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
    prefetch_bytes: int | None = None,
    last_batch: str = "error",
    batch_leaf: Any = None,
    allow_equal_batches: bool = False,
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
        prefetch_bytes=prefetch_bytes,
        last_batch=last_batch,
        batch_leaf=batch_leaf,
        allow_equal_batches=allow_equal_batches,
    )
    return loader
