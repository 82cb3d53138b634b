"""``RankSet``: a set of process ranks kept as sorted ranges, so that naming "every rank but
one" of 10,000 processes costs two ranges, not 10,000 numbers.

The exchanges between processes (``_backend/exchange/``) merge the ranks that passed the same
thing into one ``RankSet`` per distinct value, level by level, and the errors print them
(``0-4095, 4097-8191``). A set may be *truncated*: past ``MAX_RANGES`` ranges only the first
ones are kept with a count of the rest, which is enough to name them in an error; decisions are
never taken from a truncated set (the exchanges count processes separately).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

MAX_RANGES = 64  # ranges a set keeps; the rest are only counted


class RankSet:
    """An immutable set of ranks: ``ranges`` (sorted, disjoint, non-adjacent ``(lo, hi)``, both
    included), and ``more``, the ranks left out past ``MAX_RANGES`` ranges (0: exact)."""

    __slots__ = ("more", "ranges")

    def __init__(self, ranges: Iterable[Sequence[int]] = (), more: int = 0) -> None:
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted((int(r[0]), int(r[1])) for r in ranges):
            if hi < lo:
                raise ValueError(f"RankSet: a range must have lo <= hi, but got ({lo}, {hi}).")
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        extra = sum(hi - lo + 1 for lo, hi in merged[MAX_RANGES:])
        self.ranges: tuple[tuple[int, int], ...] = tuple(merged[:MAX_RANGES])
        self.more = int(more) + extra

    @classmethod
    def _normal(cls, ranges: tuple[tuple[int, int], ...], more: int) -> RankSet:
        """A set of ranges already sorted, disjoint, non-adjacent and at most ``MAX_RANGES``
        (what ``to_wire`` writes): no checks, no sorting."""
        out = cls.__new__(cls)
        out.ranges = ranges
        out.more = more
        return out

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSet:
        """The set of ``ranks``."""
        return cls((r, r) for r in ranks)

    @classmethod
    def span(cls, lo: int, hi: int) -> RankSet:
        """Ranks ``lo`` to ``hi``, both included (empty when ``hi < lo``)."""
        return cls([(lo, hi)] if hi >= lo else [])

    def __or__(self, other: RankSet) -> RankSet:
        return RankSet(self.ranges + other.ranges, self.more + other.more)

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges) + self.more

    def __iter__(self) -> Iterator[int]:
        """The ranks kept (a truncated set leaves ``more`` out)."""
        for lo, hi in self.ranges:
            yield from range(lo, hi + 1)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and any(lo <= rank <= hi for lo, hi in self.ranges)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RankSet) and self.ranges == other.ranges and self.more == other.more
        )

    def __hash__(self) -> int:
        return hash((self.ranges, self.more))

    @property
    def first(self) -> int:
        """The lowest rank (``ValueError`` when empty)."""
        if not self.ranges:
            raise ValueError("RankSet.first: the set is empty.")
        return self.ranges[0][0]

    def __str__(self) -> str:
        text = ", ".join(
            str(lo) if lo == hi else f"{lo}, {hi}" if hi == lo + 1 else f"{lo}-{hi}"
            for lo, hi in self.ranges
        )
        if self.more:
            text += f" and {self.more} more"
        return text

    def __repr__(self) -> str:
        return f"RankSet({[list(r) for r in self.ranges]!r}, more={self.more})"

    def to_wire(self) -> list[int]:
        """``[lo0, hi0, lo1, hi1, ..., more]``: what the exchanges send."""
        return [n for r in self.ranges for n in r] + [self.more]

    @classmethod
    def from_wire(cls, data: Sequence[int]) -> RankSet:
        """The inverse of ``to_wire``; ``ValueError`` for what it did not write."""
        if not data or len(data) % 2 != 1:
            raise ValueError(f"RankSet.from_wire: expected 2k + 1 ints, but got {list(data)!r}.")
        pairs = tuple((int(data[i]), int(data[i + 1])) for i in range(0, len(data) - 1, 2))
        if (
            len(pairs) <= MAX_RANGES
            and all(lo <= hi for lo, hi in pairs)
            and all(pairs[i][1] + 1 < pairs[i + 1][0] for i in range(len(pairs) - 1))
        ):
            return cls._normal(pairs, int(data[-1]))
        return cls(pairs, int(data[-1]))
