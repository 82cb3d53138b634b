"""What makes each batch of a GlobalBatchLoader's epoch (torchshard.data._loader.producer): one host
batch from every source, the sources' snapshot, the batch checks, the dispatchers, the engine, and
the counters; the end of the sources, together or not; each batch's outcome exchanged on the epoch's
channel before the batch is handed over (the agreement step, with a fake backend's checks here; on
real gloo processes in tests/backend/dtensor). A ``Producer`` is driven directly here, as the
loader's thread drives it, on a plan made by hand; the plan picks the producer's mode
(``producer_for``)."""

import re

import numpy as np
import pytest
import torch
from data_helpers import FakeDispatcher, make_plan
from helpers import xla_shards

import torchshard as ts
from torchshard._core.verdict import Verdict
from torchshard.data._loader.checkpoint import stateful
from torchshard.data._loader.exchanges import Exchanges
from torchshard.data._loader.prefetch import LOCATED
from torchshard.data._loader.producer import (
    EndOfData,
    Made,
    PipelinedProducer,
    Producer,
    producer_for,
)
from torchshard.data._loader.stats import Counters
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


class Stateful:
    """A source that can save and restore its position (a list of batches)."""

    def __init__(self, batches):
        self.batches, self.pos = batches, 0

    def __iter__(self):
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


DATA = ts.P("data")


class FakeChecks:
    """The backend's process checks as a recorder: ``answers`` maps a call to every process's
    outcomes (their ``Verdict``; none: they agree)."""

    def __init__(self, answers=None):
        self.calls, self.closed, self.answers = [], [], answers or {}
        self.outcomes = []  # begin_exchange's items (pipelined)

    def exchange(self, mesh, items, *, what, channel=None, force=False, counts=()):
        self.calls.append((channel, what, list(items)))
        return self._verdict(what, items)

    def _verdict(self, what, items):
        every = self.answers.get(what)
        return Verdict.of([items]) if every is None else Verdict.of(every)

    def begin_exchange(self, mesh, items, *, what, channel=None):
        self.calls.append(("begin", what))
        self.outcomes.append(list(items))

        def end():
            self.calls.append(("end", what))
            return self._verdict(what, items)

        return end

    def close_channel(self, mesh, channel, *, finished, taken):
        self.closed.append((channel, finished, taken))


def _producer(sources, *, mesh, spec=DATA, dispatchers=None, first=0, agree=None, prefetch=0):
    """A producer over ``sources`` on a plan made by hand: in place (``prefetch=0``), and with
    the agreement exchanged on channel ``loader7`` when ``agree`` (fake checks) is given."""
    exchanges = None if agree is None else Exchanges(agree, mesh, "loader7")
    plan = make_plan(
        mesh,
        spec,
        first=first,
        per_host=len(sources) > 1,
        explicit_partition=True,
        agree=exchanges is not None,
        channel=None if exchanges is None else "loader7",
        prefetch=prefetch,
        full=(None,) * len(sources),
    )
    return producer_for(
        plan, [iter(s) for s in sources], sources, dispatchers, Counters(), exchanges
    )


def test_stateful_needs_both_methods():
    assert stateful(Stateful([]))
    assert not stateful([1, 2])

    class Half:
        def state_dict(self):
            return {}

    assert not stateful(Half())


def test_each_call_makes_one_global_batch_and_counts_its_bytes(mesh8):
    batches = [{"x": np.full((8, 2), k, np.float32)} for k in range(3)]
    producer = _producer([batches], mesh=mesh8)
    assert producer.sources is None and producer.snapshot() is None  # a list is not stateful
    for k in range(3):
        made = producer(k)
        assert isinstance(made, Made) and made.snapshot is None
        assert made.ready is None and not made.compared
        shards = xla_shards(made.batch["x"])
        assert sorted(shards) == list(range(8))
        assert all(torch.equal(d, torch.full((1, 2), float(k))) for _, d in shards.values())
    stats = producer.counters.value
    assert stats.bytes == 3 * 8 * 2 * 4 and stats.transfer_seconds > 0
    with pytest.raises(StopIteration) as end:
        producer(3)
    assert end.value.value == EndOfData(None)


def test_a_stateful_source_is_snapshotted_after_each_batch(mesh8):
    source = Stateful([{"x": np.zeros(8)}] * 2)
    producer = _producer([source], mesh=mesh8)
    assert producer.snapshot() == [{"pos": 0}]
    assert producer(0).snapshot == [{"pos": 1}]
    assert producer(1).snapshot == [{"pos": 2}]
    with pytest.raises(StopIteration) as end:
        producer(2)
    assert end.value.value == EndOfData([{"pos": 2}])


def test_the_dispatcher_runs_on_every_host_batch(mesh8):
    dispatcher = FakeDispatcher(ts.P("data"), add_key=True)
    source = [{"id": np.arange(8) + 8 * k} for k in range(2)]
    producer = _producer([source], mesh=mesh8, dispatchers=[dispatcher])
    out = producer(0).batch
    assert dispatcher.calls == 1 and producer.feeds_checked
    assert ts.replicate_to_local_data(out["__physical_to_logical_batch_dispatch"]).tolist() == list(
        range(8)
    )
    producer(1)
    assert dispatcher.calls == 2


def test_each_batch_s_outcome_is_exchanged_on_the_channel_before_it_is_handed_over(mesh8):
    checks = FakeChecks()
    batches = [{"x": np.zeros((8, 3), np.float32)}] * 2
    producer = _producer([batches], mesh=mesh8, first=4, agree=checks)
    assert type(producer) is Producer  # in place: each exchange at once
    made = producer(0)
    assert made.compared
    ((channel, what, outcome),) = checks.calls
    assert (channel, what) == ("loader7", "GlobalBatchLoader: batch 4")
    assert outcome[1:] == ["(8, 3) float32"]
    assert outcome[0].startswith("structure PyTreeSpec({'x': *}), partition P('data',)")
    producer(1)
    with pytest.raises(StopIteration) as end:
        producer(2)
    assert checks.calls[2] == ("loader7", "GlobalBatchLoader: batch 6", ["the end of the source"])
    assert end.value.value == EndOfData(None) and producer.exchanges.finished
    producer.exchanges.close()
    producer.exchanges.close()  # once
    assert checks.closed == [("loader7", True, 0)]


def test_outcomes_that_differ_raise_at_their_batch_before_it_is_handed_over(mesh8):
    batch = {"x": np.zeros((8, 3), np.float32)}
    describe = f"structure {ts._core.tree.flatten(batch)[1]}, partition P('data',)"
    every = [[describe, "(8, 3) float32"], ["the end of the source"]]
    checks = FakeChecks({"GlobalBatchLoader: batch 0": every})
    producer = _producer([[batch]], mesh=mesh8, agree=checks)
    with pytest.raises(ts.errors.ProcessDisagreementError) as info:
        producer(0)
    assert str(info.value) == (
        "GlobalBatchLoader: batch 0: every process must make the batch or end its source at "
        "the same batch, but process 0: a batch; process 1: the end of the source. Give every "
        "process a source that yields the same number of batches (e.g. torchshard.host_sampler "
        "with drop_last=True)."
    )
    assert getattr(info.value, LOCATED)  # names its batch: no note naming the thread
    assert not producer.exchanges.finished


def test_a_failed_batch_exchanges_its_failure_and_keeps_its_own_error(mesh8):
    every = [["a failure: IndivisibleError: ..."], ["structure ...", "(6,) float64"]]
    checks = FakeChecks({"GlobalBatchLoader: batch 0": every})
    producer = _producer([[{"x": np.zeros(6)}]], mesh=mesh8, agree=checks)
    with pytest.raises(ts.errors.IndivisibleError) as info:
        producer(0)
    ((_, _, outcome),) = checks.calls
    assert outcome[0].startswith("a failure: IndivisibleError: GlobalBatchLoader: batch 0: ")
    assert info.value.__notes__[-1].startswith(
        "(the other processes' outcomes differ: GlobalBatchLoader: batch 0: every process must "
        "make the batch or end its source at the same batch, but process 0: a failure: "
    )
    quiet = _producer([[{"x": np.zeros(6)}]], mesh=mesh8)
    with pytest.raises(ts.errors.IndivisibleError) as info:
        quiet(0)
    assert not getattr(info.value, "__notes__", [])


def _pipelined(sources, *, mesh, checks, first=0):
    producer = _producer(sources, mesh=mesh, agree=checks, first=first, prefetch=2)
    assert isinstance(producer, PipelinedProducer)  # the plan of a thread, the check on
    return producer


def test_pipelined_each_exchange_ends_after_the_next_batch_is_made(mesh8):
    """On the loader's thread a batch's exchange ends only after the next batch is made and
    its exchange begun, so another process's making of batch n overlaps this one's making of
    n + 1; the batches, their order and the end are those of the sequential producer."""
    checks = FakeChecks()
    batches = [{"x": np.full((8, 3), k, np.float32)} for k in range(3)]
    producer = _pipelined([batches], mesh=mesh8, checks=checks, first=4)
    b = lambda k: f"GlobalBatchLoader: batch {k}"  # noqa: E731
    made = producer(0)
    assert made.compared and torch.equal(xla_shards(made.batch["x"])[0][1], torch.full((1, 3), 0.0))
    assert checks.calls == [("begin", b(4)), ("begin", b(5)), ("end", b(4))]
    assert checks.outcomes[0][1:] == ["(8, 3) float32"]
    assert torch.equal(xla_shards(producer(1).batch["x"])[0][1], torch.full((1, 3), 1.0))
    assert torch.equal(xla_shards(producer(2).batch["x"])[0][1], torch.full((1, 3), 2.0))
    assert not producer.exchanges.finished
    with pytest.raises(StopIteration) as end:
        producer(3)
    assert end.value.value == EndOfData(None) and producer.exchanges.finished
    assert checks.calls[3:] == [
        ("begin", b(6)), ("end", b(5)),
        ("begin", b(7)), ("end", b(6)),
        ("end", b(7)),
    ]  # fmt: skip
    assert checks.outcomes[-1] == ["the end of the source"]


def test_pipelined_a_disagreement_raises_at_its_own_batch(mesh8):
    batch = {"x": np.zeros((8, 3), np.float32)}
    describe = f"structure {ts._core.tree.flatten(batch)[1]}, partition P('data',)"
    every = [[describe, "(8, 3) float32"], ["the end of the source"]]
    checks = FakeChecks({"GlobalBatchLoader: batch 1": every})
    producer = _pipelined([[batch] * 3], mesh=mesh8, checks=checks)
    producer(0)  # batch 1's outcome is exchanged meanwhile: it differs, but not batch 0's
    with pytest.raises(ts.errors.ProcessDisagreementError, match=r"^GlobalBatchLoader: batch 1: "):
        producer(1)


def test_pipelined_a_failure_of_the_next_batch_waits_for_its_own_turn(mesh8):
    """The source fails at batch 1: batch 0 is handed over first, and batch 1's error,
    exchanged as a failure, is raised at batch 1 with the others' outcomes noted."""

    class Failing:
        def __iter__(self):
            yield {"x": np.zeros(8)}
            raise OSError("bad record")

    every = [["a failure: OSError: bad record"], ["structure ...", "(8,) float64"]]
    checks = FakeChecks({"GlobalBatchLoader: batch 1": every})
    producer = _pipelined([Failing()], mesh=mesh8, checks=checks)
    assert producer(0).compared
    assert checks.outcomes[1] == ["a failure: OSError: bad record"]
    with pytest.raises(OSError, match=r"^bad record\n") as info:
        producer(1)
    assert info.value.__notes__[-1].startswith("(the other processes' outcomes differ: ")


class _Interrupted:
    """Batches 0 to ``at - 1``, then a ``KeyboardInterrupt`` raised by the source itself."""

    def __init__(self, at):
        self.at = at

    def __iter__(self):
        for k in range(self.at):
            yield {"x": np.full((8, 3), k, np.float32)}
        raise KeyboardInterrupt


def test_pipelined_a_keyboard_interrupt_in_the_source_comes_at_its_batch(mesh8):
    """A ``KeyboardInterrupt`` raised by the source at batch 3 was raised while the producer
    made batch 3 ahead, inside the call for batch 2: the consumer got it after 2 batches, and
    batch 2 was lost. Now batch 2 comes, then the interrupt at batch 3; it is not exchanged
    (an exchange could wait on the other processes: they learn of this process's end when it
    closes its channel)."""
    checks = FakeChecks()
    producer = _pipelined([_Interrupted(3)], mesh=mesh8, checks=checks)
    got = []
    try:  # (a KeyboardInterrupt escaping a test would stop the whole session)
        for k in range(4):
            got.append(float(xla_shards(producer(k).batch["x"])[0][1][0, 0]))
    except KeyboardInterrupt:
        got.append("KeyboardInterrupt")
    assert got == [0.0, 1.0, 2.0, "KeyboardInterrupt"]
    assert ("begin", "GlobalBatchLoader: batch 3") not in checks.calls
    assert checks.calls[-1] == ("end", "GlobalBatchLoader: batch 2")


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_keyboard_interrupt_in_the_source_reaches_the_consumer_at_its_batch(mesh8, prefetch):
    """Through the loader (the producer's thread, or in place), in order, with its batch."""
    loader = ts.GlobalBatchLoader(_Interrupted(3), prefetch=prefetch)
    got, notes = [], []
    try:  # (a KeyboardInterrupt escaping a test would stop the whole session)
        for batch in loader:
            got.append(int(ts.replicate_to_local_data(batch["x"])[0, 0]))
    except KeyboardInterrupt as e:
        got.append("KeyboardInterrupt")
        notes = e.__notes__
    assert got == [0, 1, 2, "KeyboardInterrupt"]
    where = "raised in torchshard's thread 'torchshard-loader-" if prefetch else "raised by "
    assert where in notes[-1] and notes[-1].endswith("at batch 3)")


def test_a_keyboard_interrupt_in_one_process_s_source_reaches_it_at_its_batch(pools):
    """On 2 gloo processes (the pipelined producer), rank 1's source raises
    ``KeyboardInterrupt`` at batch 3: it reached rank 1 after 2 batches. Now rank 1 takes
    batches 0 to 2 and gets it at batch 3; rank 0 raises at batch 3, naming rank 1's end."""
    r0, r1 = pools(2).run("_loader_cases:source_interrupted", at=3)
    assert r1["got"] == [0, 1, 2] and r1["error"] == "KeyboardInterrupt: ", r1
    assert "at batch 3)" in r1["notes"][-1]
    assert r0["got"] == [0, 1, 2], r0
    assert r0["error"].startswith(
        "CollectiveError: GlobalBatchLoader: batch 3: rank 1 ended this GlobalBatchLoader epoch"
    ), r0
    assert r0["after"] == r1["after"] == (2, 2)  # still in step


def test_an_indivisible_batch_names_the_batch_index(mesh8):
    producer = _producer([[{"x": np.zeros(6)}]], mesh=mesh8, first=2)
    with pytest.raises(
        ts.errors.IndivisibleError,
        match=re.escape("GlobalBatchLoader: batch 2: batch['x']: dim 0 has size 6"),
    ):
        producer(0)


def test_a_later_host_whose_source_ends_first_is_named(mesh8):
    sources = [[{"id": np.arange(4)}] * 2, [{"id": np.arange(4)}] * 1]
    with virtual_hosts(2):
        producer = _producer(sources, mesh=mesh8)
        producer(0)
        with pytest.raises(
            ts.ShardingError,
            match="^"
            + re.escape(
                "GlobalBatchLoader: batch 1: host 1's source ended, but host 0's did not; every "
                "host's source must yield the same number of batches."
            )
            + "$",
        ):
            producer(1)


def test_per_host_sources_must_end_together(mesh42):
    sources = [[{"id": np.arange(4)}] * 2, [{"id": np.arange(4)}] * 3]
    with virtual_hosts(2):
        it = iter(global_batch_loader_per_host(sources))
        next(it), next(it)
        msg = (
            "GlobalBatchLoader: batch 2: host 0's source ended, but host 1's did not; every "
            "host's source must yield the same number of batches."
        )
        with pytest.raises(ts.ShardingError) as info:
            next(it)
    assert str(info.value) == msg
