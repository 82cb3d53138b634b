"""torchshard's exchanges over the tree (torchshard._backend.exchange.session), many processes
as sessions in this process (``exchange_helpers``): verdicts and counts against the processes'
own items (the oracle: grouping them here), pipelined exchanges, streams and threads, and every
failure named within the timeout: a straggler and its last call, a rank that left (the root
among them) and the ranks cut off with it, an epoch ended early, a check switched on one rank,
processes that started with other checks."""

from __future__ import annotations

import random
import re
import threading
import time

import pytest
from exchange_helpers import close, on_ranks, sessions

from torchshard._core.agreement import call_stream
from torchshard._core.errors import CollectiveError
from torchshard._core.verdict import Verdict

TIMEOUT = 2.0
SLACK = 6.0


@pytest.fixture
def tree():
    made = []

    def make(world, **kw):
        ss, kv = sessions(world, timeout=kw.pop("timeout", TIMEOUT), **kw)
        made.append(ss)
        return ss, kv

    yield make
    for ss in made:
        close(ss)


@pytest.mark.parametrize(("world", "fanout", "local"), [(2, 2, 1), (13, 3, 1), (12, 2, 4)])
def test_verdicts_group_the_processes_and_reduce_their_counts(tree, world, fanout, local):
    ss, kv = tree(world, fanout=fanout, local=local)
    before = kv.requests

    def run(r):
        out = []
        for i in range(6):
            item = f"odd {r % 3}" if i == 4 else "alike"
            out.append(ss[r].exchange(f"call {i}", [item], "c", counts=[r, i]))
        return out

    results = on_ranks(run, range(world))
    for _r, verdicts in enumerate(results):
        assert not isinstance(verdicts, Exception), verdicts
        for i, v in enumerate(verdicts):
            items = [[f"call {i}", f"odd {q % 3}" if i == 4 else "alike"] for q in range(world)]
            assert v.per_process() == Verdict.of(items).per_process()
            assert v.agreed == (i != 4 or world == 1)
            assert v.sums == (sum(range(world)), i * world)
            assert (v.mins, v.maxs) == ((0, i), (world - 1, i))
    assert kv.requests == before  # the store is the bootstrap only


def test_pipelined_exchanges_pair_at_any_pace(tree):
    ss, _ = tree(5, fanout=2)

    def run(r):
        pace = random.Random(r)
        ends, verdicts = [], []
        for x in range(41):
            if x < 40:
                time.sleep(pace.random() * 0.002)
                item = f"rank {r}" if x == 17 else "alike"
                ends.append(ss[r].begin(f"exchange {x}", [item], "p"))
            if x >= 1:
                time.sleep(pace.random() * 0.002)
                verdicts.append(ends[x - 1]())
        return verdicts

    for verdicts in on_ranks(run, range(5)):
        assert [k for k, v in enumerate(verdicts) if not v.agreed] == [17]
        assert verdicts[17].per_process() == [("exchange 17", f"rank {q}") for q in range(5)]


def test_the_busiest_process_handles_o_fanout_messages_per_exchange(tree):
    ss, _ = tree(40, fanout=3)
    rounds = 10
    on_ranks(lambda r: [ss[r].exchange(f"c{i}", [], "m") for i in range(rounds)], range(40))
    for s in ss:
        kids = len(s.shape.children)
        assert s.node.sent + s.node.received <= (rounds + 1) * 2 * (kids + 1)  # + the join
        assert s.node.connections == kids + (s.rank != 0)


def test_a_straggler_is_named_with_its_last_call_within_the_timeout(tree):
    ss, _ = tree(9, fanout=2)

    def run(r):
        ss[r].exchange("call A", [], "main")
        if r == 6:
            return "skipped"
        t0 = time.monotonic()
        try:
            ss[r].exchange("call B", [], "main")
        except CollectiveError as e:
            return str(e), time.monotonic() - t0
        return "no error"

    for r, got in enumerate(on_ranks(run, range(9))):
        if r == 6:
            continue
        text, seconds = got
        assert text.startswith(
            f"call B: torchshard's collective (call #2 of stream 'main' on rank {r}) timed out "
            f"after {TIMEOUT:g} s; ranks that did not answer: rank 6 (its last torchshard call: "
            "#1 call A)."
        ), text
        assert seconds < TIMEOUT + SLACK


def test_a_rank_that_leaves_is_named_at_once_with_the_ranks_cut_off(tree):
    ss, _ = tree(7, fanout=2)  # 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6
    ss[1].close()
    t0 = time.monotonic()
    got = on_ranks(lambda r: ss[r].exchange("call", [], "x"), [0, 2, 3, 4, 5, 6])
    assert time.monotonic() - t0 < TIMEOUT  # at once, not after the timeout
    for _r, e in zip([0, 2, 3, 4, 5, 6], got, strict=True):
        assert isinstance(e, CollectiveError), e
        assert "ranks that did not answer: rank 1 (it left: its connection to torchshard's" in str(
            e
        )
    assert "the 2 process(es) below it in the tree are cut off with it" in str(got[0])


def test_the_root_leaving_is_named_with_the_store(tree):
    ss, _ = tree(4, fanout=2)
    ss[0].close()
    got = on_ranks(lambda r: ss[r].exchange("call", [], "x"), [1, 2, 3])
    for e in got:
        assert isinstance(e, CollectiveError), e
        assert "rank 0 (it left" in str(e)
        assert "rank 0 also hosts the job's store (MASTER_ADDR): the job cannot go on" in str(e)


def test_an_epoch_ended_early_fails_the_later_exchanges_at_once(tree):
    ss, _ = tree(6, fanout=2)

    def run(r):
        taken = 0
        try:
            for i in range(6):
                if r == 4 and i == 3:
                    ss[r].close_channel("main.loader1", finished=False, taken=3)
                    return "closed"
                ss[r].exchange(f"GlobalBatchLoader: batch {i}", [], "main.loader1")
                taken += 1
        except CollectiveError as e:
            return taken, str(e)
        return "no error"

    t0 = time.monotonic()
    got = on_ranks(run, range(6))
    assert time.monotonic() - t0 < TIMEOUT
    for r, g in enumerate(got):
        if r == 4:
            assert g == "closed"
            continue
        taken, text = g
        assert taken == 3
        assert text.startswith(
            "GlobalBatchLoader: batch 3: rank 4 ended this GlobalBatchLoader epoch after taking 3 "
            "batch(es)"
        ), text


def test_a_check_switched_on_one_rank_is_named_at_once(tree):
    ss, _ = tree(3, fanout=2)
    on_ranks(lambda r: ss[r].exchange("call A", [], "main"), range(3))
    ss[2].node.mine = {"set_agreement_check": False, "set_value_check": None}
    with call_stream("main"):
        ss[2].switched("set_agreement_check", False)
    t0 = time.monotonic()
    got = on_ranks(lambda r: ss[r].exchange("call B", [], "main"), [0, 1])
    assert time.monotonic() - t0 < TIMEOUT
    for r, e in enumerate(got):
        assert isinstance(e, CollectiveError), e
        assert str(e).startswith(
            f"call B: torchshard's collective (call #2 of stream 'main' on rank {r}) cannot be "
            "matched: rank 2 called set_agreement_check(False) after its call #1 on stream "
            "'main', and this process has set_agreement_check True."
        ), e


def test_a_switch_made_alike_on_every_rank_is_no_error_whatever_the_order(tree):
    ss, _ = tree(3, fanout=2)
    # rank 2 switches late (its announcement arrives after the others' switch): no false alarm
    for r in (0, 1):
        ss[r].node.mine = {"set_agreement_check": False, "set_value_check": None}
        with call_stream("main"):
            ss[r].switched("set_agreement_check", False)

    def run(r):
        if r == 2:
            time.sleep(0.3)
            ss[r].node.mine = {"set_agreement_check": False, "set_value_check": None}
            with call_stream("main"):
                ss[r].switched("set_agreement_check", False)
        return ss[r].exchange("forced", [], "main").agreed

    assert on_ranks(run, range(3)) == [True, True, True]


def test_two_threads_on_one_stream_at_once_are_refused_at_once(tree):
    ss, _ = tree(2, fanout=2)
    gate, release = threading.Event(), threading.Event()
    out = {}

    def hold():
        end = ss[0].begin("held", [], "main")
        gate.set()
        release.wait(10)
        out["held"] = end().agreed

    t = threading.Thread(target=hold, name="holder")
    t.start()
    gate.wait(10)
    with pytest.raises(CollectiveError) as info:
        ss[0].begin("second", [], "main")
    assert re.search(r"while thread 'holder' has one under way there", str(info.value))
    assert "torchshard.call_stream('eval')" in str(info.value)
    release.set()
    assert ss[1].exchange("held", [], "main").agreed
    t.join(10)
    assert out["held"] is True


def test_processes_that_started_with_other_checks_are_told_at_the_first_exchange(tree, monkeypatch):
    from torchshard._backend.exchange import session as session_module

    states = iter(
        [{"set_agreement_check": True, "set_value_check": None}] * 2
        + [{"set_agreement_check": False, "set_value_check": None}]
    )
    lock = threading.Lock()

    def switches():
        with lock:
            return next(states, {"set_agreement_check": True, "set_value_check": None})

    monkeypatch.setattr(session_module, "switches", switches)
    ss, _ = tree(3, fanout=2)
    time.sleep(0.2)  # the join exchange completes
    got = on_ranks(lambda r: ss[r].exchange("call", [], "main"), range(3))
    assert all(isinstance(e, CollectiveError) for e in got), got
    assert "the processes started with different checks" in str(got[0])
    assert "set_agreement_check(False)" in str(got[0]) and "TORCHSHARD_AGREEMENT_CHECK" in str(
        got[0]
    )


@pytest.mark.parametrize("eager", [True, False])
def test_an_eager_exchange_starts_its_second_round_without_its_end(tree, eager):
    """Rank 1 begins an exchange whose digest differs and calls its end only after rank 0's
    end returned (a deferred check, judged later): eager, rank 0 gets the descriptions at
    once; not eager, rank 0 waits for rank 1's end until the timeout."""
    ss, _ = tree(2)
    ends = [ss[r].begin("call", [f"item {r}"], "c", eager=eager) for r in (0, 1)]
    if eager:
        v = ends[0]()
        assert v.per_process() == [("call", "item 0"), ("call", "item 1")]
    else:
        with pytest.raises(CollectiveError, match="timed out"):
            ends[0]()
    if eager:
        assert ends[1]().per_process() == [("call", "item 0"), ("call", "item 1")]


def test_a_deferred_check_is_judged_at_the_next_call_on_its_stream_once(tree):
    ss, _ = tree(2)
    judged: dict[int, list[str]] = {0: [], 1: []}

    def run(r):
        ss[r].exchange("first", ["a"], "s")
        ss[r].defer("s", judged[r].append)
        ss[r].exchange("other stream", ["a"], "t")  # another stream: not judged
        before = list(judged[r])
        ss[r].exchange("second", ["a"], "s")
        ss[r].settle(None, "at the end")  # nothing left
        return before

    assert on_ranks(run, [0, 1]) == [[], []]
    assert judged == {r: ["at the next torchshard call on its stream (second)"] for r in (0, 1)}
