"""``RankSet`` (torchshard._core.ranks): ranks as sorted ranges, exact up to ``MAX_RANGES``
ranges, then counted; the wire form round-trips; the text names ranges compactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchshard._core.ranks import MAX_RANGES, RankSet


@given(st.sets(st.integers(0, 300), max_size=80), st.sets(st.integers(0, 300), max_size=80))
def test_a_union_is_the_set_union_while_exact(a, b):
    ra, rb = RankSet.of(a), RankSet.of(b)
    both = ra | rb
    if both.more == 0:
        assert set(both) == a | b and len(both) == len(a | b)
    assert len(both) == len(a | b) or both.more  # counted, never lost
    assert RankSet.from_wire(both.to_wire()) == both


def test_the_text_is_compact():
    assert str(RankSet.of([0, 1, 2, 3, 5])) == "0-3, 5"
    assert str(RankSet.of([0, 1])) == "0, 1"
    assert str(RankSet.span(0, 8191)) == "0-8191"
    assert str(RankSet.of(range(0, 400, 2))).endswith(f"and {200 - MAX_RANGES} more")
    assert RankSet.of([7]).first == 7 and 7 in RankSet.of([7]) and 8 not in RankSet.of([7])


def test_past_the_limit_ranks_are_counted():
    odd = RankSet.of(range(1, 1000, 2))
    assert len(odd.ranges) == MAX_RANGES and len(odd) == 500


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="lo <= hi"):
        RankSet([(3, 1)])
    with pytest.raises(ValueError, match="2k \\+ 1 ints"):
        RankSet.from_wire([1, 2])
    with pytest.raises(ValueError, match="empty"):
        _ = RankSet().first
