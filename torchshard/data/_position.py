"""The consumer's position in a loader's sources (``Cursor``, one per epoch)."""

from __future__ import annotations

from typing import Any


class Cursor:
    """Where one epoch's consumer stands: the sources' state after the last batch it took
    (``snapshot``; ``None``: the sources are not stateful) and the index of the batch it takes
    next. The loader gives each epoch a new cursor and reads only its current one, so an epoch
    that was replaced can no longer move the loader's position."""

    __slots__ = ("next_batch", "snapshot")

    def __init__(self, snapshot: list[Any] | None, next_batch: int) -> None:
        self.snapshot = snapshot
        self.next_batch = next_batch

    def advance(self, snapshot: list[Any] | None) -> None:
        """The consumer took a batch, after which the sources were at ``snapshot``."""
        self.snapshot = snapshot
        self.next_batch += 1

    def end(self, snapshot: list[Any] | None) -> None:
        """The sources ended: the next epoch starts at batch 0, from ``snapshot``."""
        self.snapshot = snapshot
        self.next_batch = 0
