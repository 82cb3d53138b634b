"""Packing documents into fixed-length rows: where each document (or piece of one) goes, and
the batch of rows that results (``torchshard.data.Packer`` feeds it and keeps its state).

One batch is ``rows`` rows of ``seq_len`` positions, filled online, in the order the documents
come (grain's packers, whose results these equal):

- ``"first_fit"``: a document goes into the first row it fits (``used + length <= seq_len``,
  fewer than ``max_documents`` there); the first document that fits no row closes the batch
  and opens the next.
- ``"best_fit"``: into the row it fits most tightly (the fullest that has room; the first of
  equals); the same close.
- ``"concat_split"``: the documents one after another, rows filled in turn, a document split
  where a row ends (its rest opens the next row, and the next batch); a row with
  ``max_documents`` pieces is closed early.

A document padded to a multiple of ``pad_to_multiple_of`` (for ``context_parallel_order``'s
``"per_document"``, which cuts every document into ``2 * cp`` chunks) takes that many
positions: its pad tokens belong to it (its segment id, positions running on) but carry no
loss. The row's end is padding (segment id 0). Pure maths (numpy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

METHODS = ("best_fit", "first_fit", "concat_split")
"""The packing methods, by their ``method=`` name."""

KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
"""The leaves of a packed batch, each ``[rows, seq_len]``."""


@dataclasses.dataclass(frozen=True)
class Pending:
    """A document (or its rest) waiting for a row: its real tokens and the pad tokens after
    them (``pad_to_multiple_of``)."""

    tokens: np.ndarray
    pad: int = 0

    @property
    def length(self) -> int:
        """The positions it takes."""
        return len(self.tokens) + self.pad

    def split(self, n: int) -> tuple[Pending, Pending | None]:
        """Its first ``n`` positions (all of it when ``n`` is more) and the rest (``None`` when
        nothing is left)."""
        n = min(n, self.length)
        real = min(n, len(self.tokens))
        head = Pending(self.tokens[:real], n - real)
        if n == self.length:
            return head, None
        return head, Pending(self.tokens[real:], self.length - n - (len(self.tokens) - real))


def padded(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


class RowBatch:
    """One batch of rows being filled: where each piece goes; ``assemble`` makes its arrays.

    Example (first fit: 5 and 4 fill row 0 and 1, 3 goes after the 5):
        >>> from torchshard._core.packing import Pending, RowBatch
        >>> batch = RowBatch(rows=2, seq_len=8, max_documents=None)
        >>> [batch.fit(n, "first_fit") for n in (5, 4, 3)]
        [0, 0, 0]
        >>> batch = RowBatch(rows=2, seq_len=8, max_documents=None)
        >>> for n in (5, 4, 3):
        ...     batch.place(batch.fit(n, "first_fit"), Pending(np.arange(n)))
        >>> batch.used
        [8, 4]
    """

    def __init__(self, *, rows: int, seq_len: int, max_documents: int | None) -> None:
        self.rows = rows
        self.seq_len = seq_len
        self.max_documents = max_documents
        self.used = [0] * rows
        self.count = [0] * rows
        self.pieces: list[tuple[int, int, Pending]] = []  # (row, start, piece)
        self.cursor = 0  # concat_split: the row being filled

    @property
    def empty(self) -> bool:
        """No piece placed yet."""
        return not self.pieces

    def fit(self, length: int, method: str) -> int | None:
        """The row a document of ``length`` positions goes to (``"first_fit"`` or
        ``"best_fit"``), or ``None`` when it fits no row (the batch is then full)."""
        room = self.seq_len - length
        limit = self.max_documents
        best, best_used = None, -1
        for r, used in enumerate(self.used):
            if used <= room and (limit is None or self.count[r] < limit):
                if method == "first_fit":
                    return r
                if used > best_used:
                    best, best_used = r, used
        return best

    def place(self, row: int, piece: Pending) -> None:
        """Puts ``piece`` at the end of ``row``."""
        self.pieces.append((row, self.used[row], piece))
        self.used[row] += piece.length
        self.count[row] += 1

    def concat(self, doc: Pending) -> Pending | None:
        """Concat-then-split: fills the rows in turn with ``doc``; returns what is left of it
        when the batch is full (``None`` when all of it went in)."""
        rest: Pending | None = doc
        while rest is not None and self.cursor < self.rows:
            r = self.cursor
            piece, rest = rest.split(self.seq_len - self.used[r])
            self.place(r, piece)
            full = self.used[r] == self.seq_len
            if full or (self.max_documents is not None and self.count[r] >= self.max_documents):
                self.cursor += 1
        return rest

    @property
    def full(self) -> bool:
        """Concat-then-split: every row is closed."""
        return self.cursor >= self.rows

    def assemble(self, dtype: Any, pad_id: int) -> dict[str, np.ndarray]:
        """The batch's arrays, each ``[rows, seq_len]``: ``tokens`` (``pad_id`` where no
        document is), ``segment_ids`` (1, 2, ... per row in the order placed; 0 for padding),
        ``positions`` (from 0 in each piece) and ``loss_mask`` (``True`` at a real token whose
        next position is the next real token of the same piece: the positions whose shifted
        label, ``tokens[:, i + 1]``, is of the same document)."""
        shape = (self.rows, self.seq_len)
        tokens = np.full(shape, pad_id, dtype=dtype)
        segment_ids = np.zeros(shape, dtype=np.int32)
        positions = np.zeros(shape, dtype=np.int32)
        loss_mask = np.zeros(shape, dtype=bool)
        ramp = np.arange(self.seq_len, dtype=np.int32)
        seen = [0] * self.rows
        for row, start, piece in self.pieces:
            seen[row] += 1
            real, end = len(piece.tokens), start + piece.length
            tokens[row, start : start + real] = piece.tokens
            segment_ids[row, start:end] = seen[row]
            positions[row, start:end] = ramp[: piece.length]
            loss_mask[row, start : start + real - 1] = True
        return {
            "tokens": tokens,
            "segment_ids": segment_ids,
            "positions": positions,
            "loss_mask": loss_mask,
        }
