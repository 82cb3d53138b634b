"""Values and merges (torchshard._backend.exchange.merge): merging a tree of processes' values
level by level gives what a flat pass over every process gives (the oracle: plain grouping of
the processes' values), whatever the tree; processes in other calls merge into "mixed"; the
value check's blocks are settled where all their holders met and only conflicts reach the
root."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from torchshard._backend.exchange import merge
from torchshard._backend.exchange.tree import children_of
from torchshard._core.ranks import RankSet


def _tree_merge(values, world, fanout, local):
    def up(r):
        kids = children_of(r, world, fanout, local)
        vs = [values[r]] + [up(c) for c in kids]
        return merge.merge(vs) if len(vs) > 1 else vs[0]

    return up(0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=40),
    st.integers(2, 5),
    st.data(),
)
def test_a_tree_merge_is_the_flat_grouping(digests, fanout, data):
    world = len(digests)
    local = data.draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0]))
    counts = data.draw(st.lists(st.integers(-5, 9), min_size=world, max_size=world))
    values = [
        merge.agree_value("call", d, [c, 1], r)
        for r, (d, c) in enumerate(zip(digests, counts, strict=False))
    ]
    got = _tree_merge(values, world, fanout, local)
    want: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        want.setdefault(d, []).append(r)
    assert {g[1]: list(RankSet.from_wire(g[2])) for g in got["g"]} == want
    assert got["g"][0][1] == digests[0]  # rank 0's group first
    assert got["s"] == [sum(counts), world]
    assert got["lo"] == [min(counts), 1] and got["hi"] == [max(counts), 1]


def test_processes_in_other_calls_merge_into_mixed():
    vs = [merge.agree_value("A", "d", [], 0), merge.agree_value("B", "d", [], 1)]
    got = merge.merge(vs)
    assert got["K"] == "mixed"
    assert [(w, RankSet.from_wire(r)) for w, _, r in got["g"]] == [
        ("A", RankSet.of([0])),
        ("B", RankSet.of([1])),
    ]
    other_kind = merge.merge([merge.replicas_value("A", {}, 0), vs[0]])
    assert other_kind["K"] == "mixed"


def test_groups_past_the_limit_are_counted_in_one():
    vs = [merge.agree_value("c", str(r), [], r) for r in range(merge.MAX_GROUPS + 10)]
    got = merge.merge(vs)
    assert len(got["g"]) == merge.MAX_GROUPS + 1
    other = got["g"][-1]
    assert other[0] == merge.OTHER and len(RankSet.from_wire(other[2])) == 10


def test_blocks_settle_where_their_holders_meet_and_conflicts_reach_the_root():
    # 8 processes, 4 blocks held by pairs (2r, 2r + 1); ranks 6 and 7 disagree
    values = [
        merge.replicas_value("v", {f"0 b{r // 2}": ("bad" if r == 7 else "ok", 2)}, r)
        for r in range(8)
    ]
    pair = merge.merge(values[2:4])
    assert pair["b"] == {}  # both holders of b1 met: settled, nothing goes up
    got = _tree_merge(values, 8, 2, 2)
    assert list(got["b"]) == ["0 b3"]
    checksum, seen, need, holders, others = got["b"]["0 b3"]
    assert (checksum, seen, need) == ("ok", 2, 2)
    assert RankSet.from_wire(holders) == RankSet.of([6])
    assert {c: RankSet.from_wire(r) for c, r in others.items()} == {"bad": RankSet.of([7])}
