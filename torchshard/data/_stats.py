"""A loader's counters: ``LoaderStats`` (the value) and ``Counters`` (added to from two threads)."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """Counters of a ``GlobalBatchLoader`` since it was made (all epochs).

    Attributes:
        batches: global batches handed to the consumer.
        bytes: host bytes transferred to the devices (every host's, under the emulation).
        wait_seconds: time the consumer spent inside ``next()`` waiting for input.
        transfer_seconds: time spent in ``host_to_global_array`` (on the background thread).
        dropped_examples: with ``last_batch="drop"``, the examples this process's sources gave
            that were not yielded because the epoch stopped (its short last batch, a batch
            when another process's source ended first, and any batch read ahead past it).
    """

    batches: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0
    transfer_seconds: float = 0.0
    dropped_examples: int = 0


class Counters:
    """``LoaderStats``, added to from the loader's thread and its consumer's (under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = LoaderStats()

    @property
    def value(self) -> LoaderStats:
        """The counters now."""
        return self._value

    def add(self, **delta: float) -> None:
        """Adds ``delta`` (``batches=1, wait_seconds=...``) to the counters."""
        with self._lock:
            v = self._value
            self._value = dataclasses.replace(v, **{k: getattr(v, k) + d for k, d in delta.items()})
