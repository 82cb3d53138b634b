"""One epoch's plan (``EpochPlan``): everything an epoch runs on, decided once by the loader's
``iter()`` on the caller's thread (``plan_epoch``) and read, never written, by the producer and
the epoch.

The plan holds the mesh and its backend, the partition resolved to a spec, the processes whose
batches count, the ``last_batch`` policy, whether the processes compare each batch (the
agreement check) or exchange its status (``last_batch`` on several processes) and on which
channel (opened here: one exchange, in program order, so that processes in different calls
raise at once), and how the batches are made: ahead on a thread (``background``, with
``prefetch``/``prefetch_bytes``), and with each batch's exchange ending after the next batch is
made (``pipeline``). Which producer makes the batches follows from the plan alone
(``producer.producer_for``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torchshard._backend.protocols import Backend
from torchshard._backend.registry import lookup
from torchshard._core.context import thread_mesh
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.partition import DEFAULT_PARTITION, feed_partition
from torchshard._mesh.context import current_topology
from torchshard._step.protocol import Dispatcher
from torchshard.data._loader.last_batch import LeafPath, full_rows
from torchshard.data._loader.stats import warmup_batches
from torchshard.data._sampler import HostSampler


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """What one epoch runs on (frozen: nothing changes it once ``iter()`` made it).

    Attributes:
        mesh: the loader's mesh; ``backend``: its backend.
        spec: the partition, resolved once (``feed_partition``).
        first: the index of the epoch's first batch (``> 0`` when resuming).
        processes: the processes whose sources make each global batch (1 for a per-host
            loader, which plays every host itself).
        per_host: one source per host this process supplies (names the errors' paths).
        explicit_partition: ``partition=`` was given (names the fix of a feed mismatch).
        policy: ``last_batch`` (``"error"``, ``"drop"``, ``"pad"``).
        agree: the processes compare each batch's outcome (the agreement check).
        exchange: the processes exchange each batch's status (``"drop"``/``"pad"`` on several
            processes, also with the agreement check off).
        channel: the name of the epoch's channel of exchanges (``None``: no exchange); there is
            one exactly when ``agree`` or ``exchange``.
        prefetch: the most batches made ahead (0: each made inside ``next()``).
        prefetch_bytes: the most host bytes made ahead (``None``: only ``prefetch``).
        full: per source, the rows of a whole batch (its ``batch_size``), else ``None``.
        warmup: how many first batches are the epoch's warm-up (``stats.warmup_batches``).
        share: ``(shards, hosts)``: the examples of a global batch are the processes' real rows
            times ``shards / hosts`` (``None``: no global position is kept).
        batch_leaf: the path of the leaf whose dim 0 counts a batch's examples (``None``: the
            first leaf whose dim 0 the partition splits).
        equal_batches: batches that are equal on purpose: a DataLoader's workers yielding the
            same first batch are not taken for copies of one stream.
    """

    mesh: Mesh
    backend: Backend
    spec: Any
    first: int = 0
    processes: int = 1
    per_host: bool = False
    explicit_partition: bool = False
    policy: str = "error"
    agree: bool = False
    exchange: bool = False
    channel: str | None = None
    prefetch: int = 2
    prefetch_bytes: int | None = None
    full: tuple[int | None, ...] = (None,)
    warmup: int = 1
    share: tuple[int, int] | None = None
    batch_leaf: LeafPath | None = None
    equal_batches: bool = False

    def __post_init__(self) -> None:
        if (self.agree or self.exchange) != (self.channel is not None):
            raise ValueError(
                f"EpochPlan: a channel is needed exactly when the processes compare or exchange "
                f"(agree={self.agree}, exchange={self.exchange}), but got channel="
                f"{self.channel!r}."
            )

    @property
    def background(self) -> bool:
        """The batches are made ahead, on the loader's thread (``prefetch > 0``)."""
        return self.prefetch > 0

    @property
    def pipeline(self) -> bool:
        """On the loader's thread, each batch's agreement exchange ends after the next batch is
        made (one batch more than ``prefetch`` in flight, so that no batch waits for the other
        processes' making of it). Not under a byte budget (which would not count that batch)
        nor when the statuses are exchanged (the next batch depends on the settled one)."""
        return self.background and self.prefetch_bytes is None and self.agree and not self.exchange


def plan_epoch(
    mesh: Any,
    *,
    sources: Sequence[Any],
    dispatchers: Sequence[Dispatcher] | None,
    partition: Any,
    per_host: bool,
    policy: str,
    prefetch: int,
    prefetch_bytes: int | None,
    first: int,
    samplers: Sequence[HostSampler] | None,
    batch_leaf: LeafPath | None = None,
    equal_batches: bool = False,
) -> EpochPlan:
    """The plan of an epoch of ``sources`` on ``mesh``; runs the backend's set-up collectives
    and opens the epoch's channel, so it is called on the thread that runs the program, in
    program order (a loader's ``iter()``). Raises ``ShardingError`` for a ``last_batch``
    policy the backend cannot settle between its processes."""
    with thread_mesh(mesh):
        dispatcher = None if dispatchers is None else dispatchers[0]
        spec = feed_partition(partition, dispatcher)
    backend = lookup(mesh)
    checks = backend.processes
    if checks is not None:  # its set-up collectives run here, never on the loader's thread
        checks.prepare(mesh)
    topology = current_topology(mesh)
    processes = 1 if per_host else topology.process_count
    exchange = policy != "error" and processes > 1
    if exchange and checks is None:
        raise ShardingError(
            f"GlobalBatchLoader(last_batch={policy!r}): every process must know where the "
            f"others' sources end, but the {backend.name!r} backend has no exchange between its "
            f"{processes} processes outside a step. Use last_batch='error' with sources that end "
            "together (torchshard.host_sampler with drop_last=True), or the DTensor backend."
        )
    agree = len(sources) == 1 and checks is not None and checks.compares(mesh)
    channel = None
    if checks is not None and (agree or exchange):
        # The epoch's exchanges of each batch's outcome, named in program order; one exchange
        # here, on this thread, finds processes that are out of step at once.
        channel = checks.open_channel(
            mesh, what=f"GlobalBatchLoader: iter() from batch {first}", force=exchange
        )
    share = None
    if samplers:
        share = (samplers[0].num_replicas, processes * len(sources))
    return EpochPlan(
        mesh=mesh,
        backend=backend,
        spec=spec,
        first=first,
        processes=processes,
        per_host=per_host,
        explicit_partition=partition is not DEFAULT_PARTITION,
        policy=policy,
        agree=agree,
        exchange=exchange,
        channel=channel,
        prefetch=prefetch,
        prefetch_bytes=prefetch_bytes,
        full=tuple(full_rows(s) for s in sources),
        warmup=warmup_batches(sources),
        share=share,
        batch_leaf=batch_leaf,
        equal_batches=equal_batches,
    )
