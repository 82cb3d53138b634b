"""A loader's counters: ``LoaderStats`` (the value) and ``Counters`` (added to from two threads)."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """Counters of a ``GlobalBatchLoader`` since it was made (all epochs).

    The question they answer is ``input_wait_fraction``: the share of the step time the
    training loop spent waiting for input, after each epoch's warm-up. The warm-up is the
    epoch's first batch, or its first ``num_workers`` batches for a ``DataLoader`` with worker
    processes (``iter()`` starts the workers, each with its own first batch), counted apart:
    ``wait_seconds / wall time`` mixes it in, and over a short run the warm-up dominates.

    Attributes:
        batches: global batches handed to the consumer.
        bytes: host bytes transferred to the devices (every host's, under the emulation).
        wait_seconds: time the consumer spent inside ``next()`` waiting for input (every
            batch, the warm-up included).
        transfer_seconds: time spent in ``host_to_global_array`` (on the background thread).
        dropped_examples: with ``last_batch="drop"``, the examples this process's sources gave
            that were not yielded because the epoch stopped (its short last batch, a batch
            when another process's source ended first, and any batch read ahead past it).
        warmup_batches: the batches counted as warm-up (the first of each epoch, or its first
            ``num_workers``).
        warmup_wait_seconds: the time the consumer waited for them.
        step_seconds: the step time after the warm-up: for every other batch, the time from
            the hand-over of the batch before it to its own (the step on the previous batch
            plus the wait for this one).

    Example:
        >>> stats = torchshard.data.LoaderStats(
        ...     batches=4, wait_seconds=2.1, warmup_batches=1, warmup_wait_seconds=2.0,
        ...     step_seconds=1.0,
        ... )
        >>> round(stats.input_wait_fraction, 3)
        0.1
        >>> print(str(stats).replace("; ", ";\\n"))
        4 batches, 0 bytes;
        input wait 10.0% of step time (3 batches after the warm-up);
        warm-up: 1 batch(es), 2.00 s waited;
        0.00 s transferring
    """

    batches: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0
    transfer_seconds: float = 0.0
    dropped_examples: int = 0
    warmup_batches: int = 0
    warmup_wait_seconds: float = 0.0
    step_seconds: float = 0.0

    @property
    def input_wait_fraction(self) -> float:
        """The share of the step time spent waiting for input, after the warm-up (``nan``
        before an epoch's second batch): ``(wait_seconds - warmup_wait_seconds) /
        step_seconds``."""
        if self.step_seconds <= 0:
            return math.nan
        return (self.wait_seconds - self.warmup_wait_seconds) / self.step_seconds

    def __str__(self) -> str:
        steady = self.batches - self.warmup_batches
        wait = (
            f"input wait {self.input_wait_fraction:.1%} of step time ({steady} batches after "
            "the warm-up)"
            if steady > 0 and self.step_seconds > 0
            else "input wait not measured yet (it needs an epoch's second batch)"
        )
        return (
            f"{self.batches} batches, {self.bytes:,} bytes; {wait}; warm-up: "
            f"{self.warmup_batches} batch(es), {self.warmup_wait_seconds:.2f} s waited; "
            f"{self.transfer_seconds:.2f} s transferring"
            + (f"; {self.dropped_examples} example(s) dropped" if self.dropped_examples else "")
        )


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


def warmup_batches(sources: Sequence[Any]) -> int:
    """How many first batches of an epoch are its warm-up: 1, or the most worker processes of
    a source that has them (a ``DataLoader``'s ``num_workers``: it takes batch ``i`` from worker
    ``i % num_workers``, so each of the first ``num_workers`` batches waits for a worker's
    start; with several processes one process's slower start shows on every process)."""
    workers = [getattr(s, "num_workers", 0) for s in sources]
    return max([1, *(w for w in workers if isinstance(w, int) and not isinstance(w, bool))])
