"""The consumer's position in a loader's sources (``Cursor``, one per epoch)."""

from __future__ import annotations

from typing import Any


class Cursor:
    """Where one epoch's consumer stands: the sources' state after the last batch it took
    (``snapshot``; ``None``: the sources are not stateful, or start a new pass), the index of
    the batch it takes next, and the examples of the epoch's global order the job has taken
    (``consumed``, from ``start``: where the epoch's pass began, 0 unless resumed), and which
    epoch that is (``epoch``: the samplers', else the last ``set_epoch``'s; ``None``: not
    known). The loader gives each epoch a new cursor and reads only its current one, so an
    epoch that was replaced can no longer move the loader's position."""

    __slots__ = ("consumed", "epoch", "next_batch", "snapshot")

    def __init__(
        self,
        snapshot: list[Any] | None,
        next_batch: int,
        consumed: int = 0,
        epoch: int | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.next_batch = next_batch
        self.consumed = consumed
        self.epoch = epoch

    def superseded(self, epoch: int | None) -> bool:
        """Whether the consumer left this epoch mid-way (a ``break``) and ``set_epoch`` has
        since named another (``epoch``): the position is then that epoch's start."""
        return (
            self.next_batch > 0
            and self.epoch is not None
            and epoch is not None
            and epoch != self.epoch
        )

    def advance(self, snapshot: list[Any] | None, examples: int = 0) -> None:
        """The consumer took a batch of ``examples`` examples of the global order, after which
        the sources were at ``snapshot``."""
        self.snapshot = snapshot
        self.next_batch += 1
        self.consumed += examples

    def end(self, snapshot: list[Any] | None) -> None:
        """The epoch ended: the next one starts at batch 0, from ``snapshot``."""
        self.snapshot = snapshot
        self.next_batch = 0
        self.consumed = 0
