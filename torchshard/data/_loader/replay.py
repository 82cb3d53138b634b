"""A one-pass source read ahead of the consumer (``Replay``): what the loader's thread read and
the consumer did not take is kept, and the next epoch yields it first, then reads on.

A one-pass source is its own iterator (``iter(source) is source``: a generator, ``iter(list)``,
a file): each ``iter()`` of the loader reads on where the last one stopped. The loader's thread
reads up to ``prefetch`` batches ahead of the consumer, so a ``break`` (or ``close()``, an
error, Ctrl-C caught) left those batches read and gone: a generator source, ``break`` after 2
batches with ``prefetch=3``, then a new loop lost batches 2, 3 and 4 without an error. Now the
second loop starts at batch 2, as the same two loops over the generator itself would. A
re-iterable source (a ``DataLoader``, a list) starts a new pass at each ``iter()`` and is read
directly.

One ``Replay`` per one-pass source, owned by the loader for its life; each epoch reads it through
a ``Reader`` (on the loader's thread, through the run's ``Outside``), and the consumer marks
what it took (``Reader.taken``). Batches are kept from their read until the consumer takes
them (at most the batches in flight: host memory for ``prefetch`` batches more than a
re-iterable source needs). An earlier epoch's thread may still be inside the source when the
next epoch starts (a slow generator): one thread at a time reads it, and what the earlier one
brings back is kept, in order, for the next. Standard library only.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

from torchshard.data._loader.prefetch import POLL_SECONDS, Outside, Retired

END: Any = object()  # the source's end (what ``Reader.read`` returns then)


def one_pass(source: Any, it: Iterator[Any]) -> bool:
    """Whether ``source``, of which ``it = iter(source)``, is its own iterator (one pass)."""
    return it is source


class Replay:
    """A one-pass source and its batches read but not taken yet.

    Args:
        it: the source (its own iterator).
    """

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._reading = threading.Lock()  # one thread inside the source at a time
        self._lock = threading.Lock()  # guards _kept and _taken
        self._kept: collections.deque[Any] = collections.deque()  # read, not taken, in order
        self._taken = 0  # the source's batches the consumers took (the index of _kept[0])

    @property
    def kept(self) -> int:
        """How many batches were read and not taken (the next epoch's first ones)."""
        return len(self._kept)

    def reader(self, outside: Outside) -> Reader:
        """An epoch's reader: from the first batch not taken, its reads marked by ``outside``."""
        with self._lock:
            return Reader(self, self._taken, outside)

    def read(self, pos: int, outside: Outside) -> Any:
        """Batch ``pos`` of the source (counted from its first read): a kept one, else the
        source's next (kept until taken); ``END`` at the source's end. Waits for another
        thread inside the source, unless ``outside`` is stopped (``Retired``)."""
        while not self._reading.acquire(timeout=POLL_SECONDS):
            if outside.stopped:
                raise Retired
        try:
            with self._lock:
                i = pos - self._taken
                if i < len(self._kept):
                    return self._kept[i]
                if i > len(self._kept):  # pragma: no cover - readers read in order
                    raise RuntimeError(f"Replay: read {pos} past {self._taken + len(self._kept)}")
            x = next(self._it, END)
            if x is not END:
                with self._lock:
                    self._kept.append(x)
            return x
        finally:
            self._reading.release()

    def taken(self, upto: int) -> None:
        """The consumer took every batch before ``upto``: they are no longer kept."""
        with self._lock:
            while self._taken < upto and self._kept:
                self._kept.popleft()
                self._taken += 1


class Reader(Iterator[Any]):
    """One epoch's read of a ``Replay``: ``next()`` is its next batch (kept ones first);
    ``position`` is how many batches of the source it has read. The producer marks the call
    (``outside.call``); a wait for an earlier thread gives up once ``outside`` is stopped."""

    __slots__ = ("_outside", "_replay", "position")

    def __init__(self, replay: Replay, position: int, outside: Outside) -> None:
        self._replay = replay
        self._outside = outside
        self.position = position

    def __iter__(self) -> Reader:
        return self

    def __next__(self) -> Any:
        x = self._replay.read(self.position, self._outside)
        if x is END:
            raise StopIteration
        self.position += 1
        return x

    def taken(self, upto: int) -> None:
        """The consumer took this source's batches before ``upto`` (``Replay.taken``)."""
        self._replay.taken(upto)
