"""``Verdict``: what an exchange between the processes found, in a form that costs what the
*distinct* values cost (not one entry per process).

An exchange compares each process's items (a call's description, a loader batch's outcome) and
reduces a few ints per process (sum, min and max: a loader's real rows, ended sources, source
lengths). Its verdict is the groups of processes that passed the same items, lowest rank first,
and the reduced ints; the errors name groups by their ranks (``0-4095, 4097-8191``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torchshard._core.ranks import RankSet


@dataclasses.dataclass(frozen=True)
class Group:
    """The processes ``ranks`` that passed ``items``."""

    ranks: RankSet
    items: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """An exchange's result: ``groups`` (one when every process passed the same items), and
    the sum, min and max of each int the processes passed (``counts``), over ``processes``."""

    groups: tuple[Group, ...]
    processes: int
    sums: tuple[int, ...] = ()
    mins: tuple[int, ...] = ()
    maxs: tuple[int, ...] = ()

    @property
    def agreed(self) -> bool:
        """Whether every process passed the same items."""
        return len(self.groups) == 1

    @classmethod
    def alone(cls, items: Sequence[str], counts: Sequence[int] = ()) -> Verdict:
        """The verdict of one process (nothing to compare)."""
        c = tuple(int(n) for n in counts)
        return cls((Group(RankSet.of([0]), tuple(items)),), 1, c, c, c)

    @classmethod
    def of(cls, per_process: Sequence[Sequence[str]]) -> Verdict:
        """The verdict of ``per_process[p]``, each process's items (tests, small worlds)."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for p, items in enumerate(per_process):
            groups.setdefault(tuple(items), []).append(p)
        return cls(
            tuple(Group(RankSet.of(ps), items) for items, ps in groups.items()), len(per_process)
        )

    def without_first(self) -> Verdict:
        """The same verdict with each group's first item (the call's name) left out."""
        return dataclasses.replace(
            self, groups=tuple(Group(g.ranks, g.items[1:]) for g in self.groups)
        )

    def per_process(self) -> list[tuple[str, ...]]:
        """Each process's items, by rank (for a small world: every rank of every group must be
        known, i.e. no group truncated)."""
        out: list[tuple[str, ...] | None] = [None] * self.processes
        for g in self.groups:
            for r in g.ranks:
                out[r] = g.items
        missing = [r for r, items in enumerate(out) if items is None]
        if missing:
            raise ValueError(f"Verdict.per_process: no items for ranks {missing[:8]}.")
        return [items for items in out if items is not None]


def ranks_text(ranks: RankSet) -> str:
    """``"rank 3"`` or ``"ranks 0-2, 5"``."""
    return f"rank {ranks}" if len(ranks) == 1 else f"ranks {ranks}"


def processes_text(ranks: RankSet) -> str:
    """``"process 3"`` or ``"processes 0-2, 5"``."""
    return f"process {ranks}" if len(ranks) == 1 else f"processes {ranks}"
