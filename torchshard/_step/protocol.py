"""The dispatchers' protocol: what ``GlobalBatchLoader``, ``sharded_collate`` and
``host_sampler`` ask of an input dispatcher (``InputDispatcher``, ``SpmdInputDispatcher``, or a
user's own)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torchshard._core.spec import PartitionSpec


@runtime_checkable
class Dispatcher(Protocol):
    """A host -> step batch conversion: each feed reads the shard ``feed_read_config()`` names,
    converts its logical batch with ``logical_to_physical_batch`` on the host, the batch is
    assembled with ``partition_spec``, and the step calls ``physical_to_logical_batch``."""

    @property
    def partition_spec(self) -> PartitionSpec:
        """The spec to assemble the physical batch with."""
        ...

    def feed_read_config(self) -> dict[str, int]:
        """Which shard of the source this feed reads: ``{"num_shards", "shard_index"}``."""
        ...

    def logical_to_physical_batch(self, logical_feed_batch: Any, /) -> Any:
        """This feed's physical batch (on the host)."""
        ...

    def physical_to_logical_batch(self, global_physical_batch: Any, /) -> Any:
        """The global logical batch (in the step)."""
        ...


def is_dispatcher(x: Any) -> bool:
    """Whether ``x`` can convert host batches (a loader needs only that part of the protocol)."""
    return callable(getattr(x, "logical_to_physical_batch", None))
