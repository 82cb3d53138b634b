"""``Verdict`` (torchshard._core.verdict): groups of processes by the items they passed, lowest
rank first; per-process items back for small worlds; the call names dropped."""

from __future__ import annotations

import pytest

from torchshard._core.ranks import RankSet
from torchshard._core.verdict import Verdict, ranks_text


def test_a_verdict_groups_processes_by_their_items():
    v = Verdict.of([["a", "x"], ["a", "y"], ["a", "x"]])
    assert not v.agreed and v.processes == 3
    assert [(str(g.ranks), g.items) for g in v.groups] == [("0, 2", ("a", "x")), ("1", ("a", "y"))]
    assert v.per_process() == [("a", "x"), ("a", "y"), ("a", "x")]
    assert v.without_first().per_process() == [("x",), ("y",), ("x",)]


def test_alone_and_agreed():
    v = Verdict.alone(["a"], [3, 1])
    assert v.agreed and v.sums == v.mins == v.maxs == (3, 1) and v.processes == 1
    assert Verdict.of([["a"]] * 4).agreed


def test_per_process_needs_every_rank():
    v = Verdict((Verdict.of([["a"]]).groups[0],), 2)
    with pytest.raises(ValueError, match="no items for ranks \\[1\\]"):
        v.per_process()


def test_ranks_text():
    assert ranks_text(RankSet.of([3])) == "rank 3"
    assert ranks_text(RankSet.of([0, 1, 2, 5])) == "ranks 0-2, 5"
