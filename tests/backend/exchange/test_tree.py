"""The exchange tree's shape (torchshard._backend.exchange.tree): every rank but the root has
one parent, the children are the inverse of the parents, subtrees hold the ranks above their
root, the depth is the longest path; hosts' ranks hang off their leader."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchshard._backend.exchange.tree import TreeShape, children_of, depth, parent_of


@settings(deadline=None)
@given(st.integers(1, 300), st.integers(2, 16), st.sampled_from([1, 2, 4, 8]))
def test_parents_and_children_agree_and_reach_the_root(hosts, fanout, local):
    world = hosts * local
    longest = 0
    for r in range(world):
        p = parent_of(r, fanout, local)
        assert (p is None) == (r == 0)
        if p is not None:
            assert p < r and r in children_of(p, world, fanout, local)
            assert p % local == 0  # parents are leaders
        kids = children_of(r, world, fanout, local)
        assert list(kids) == sorted(kids) and all(parent_of(c, fanout, local) == r for c in kids)
        assert len(kids) <= fanout + local - 1
        hops, q = 0, r
        while q != 0:
            q = parent_of(q, fanout, local)
            hops += 1
        longest = max(longest, hops)
    assert longest == depth(world, fanout, local)
    assert TreeShape(0, world, fanout, local).subtree_size() == world


def test_a_hosts_ranks_report_to_its_leader():
    shape = TreeShape(13, 32, fanout=2, local_size=8)
    assert shape.host == 1 and shape.parent == 8 and shape.children == ()
    assert TreeShape(8, 32, 2, 8).children == (9, 10, 11, 12, 13, 14, 15, 24)
    assert TreeShape(0, 32, 2, 8).children == (1, 2, 3, 4, 5, 6, 7, 8, 16)


def test_the_depth_grows_as_log_n():
    assert depth(2, 8) == 1 and depth(9, 8) == 1 and depth(10, 8) == 2
    assert depth(8192, 8, 8) == 5 and depth(16384, 8, 8) == 5 and depth(8192, 16, 8) == 4


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rank 4 is not in range"):
        TreeShape(4, 4)
    with pytest.raises(ValueError, match="fanout must be >= 2"):
        TreeShape(0, 4, fanout=1)
    with pytest.raises(ValueError, match="local_size must divide world"):
        TreeShape(0, 6, local_size=4)
