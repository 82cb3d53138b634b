"""What a GlobalBatchLoader's thread does per batch (torchshard.data._producer): one host batch
from every source, the sources' snapshot, the batch checks, the dispatchers, the engine, and
the counters; the end of the sources, together or not; the outcome described for the
consumer's agreement step. A ``Producer`` is driven directly here, as the loader's thread
drives it."""

import re

import numpy as np
import pytest
import torch
from data_helpers import FakeDispatcher
from helpers import xla_shards

import torchshard as ts
from torchshard.data._producer import OUTCOME, Ended, Made, Producer, stateful
from torchshard.data._stats import Counters
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


def _producer(sources, *, mesh, spec=DATA, dispatchers=None, first=0, agree=False):
    return Producer(
        [iter(s) for s in sources],
        sources,
        dispatchers,
        spec,
        mesh,
        Counters(),
        first,
        per_host=len(sources) > 1,
        explicit_partition=True,
        agree=agree,
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
        assert made.outcome is None and made.where is None and made.ready is None
        shards = xla_shards(made.batch["x"])
        assert sorted(shards) == list(range(8))
        assert all(torch.equal(d, torch.full((1, 2), float(k))) for _, d in shards.values())
    stats = producer.counters.value
    assert stats.bytes == 3 * 8 * 2 * 4 and stats.transfer_seconds > 0
    with pytest.raises(StopIteration) as end:
        producer(3)
    assert end.value.value == Ended(None, None)


def test_a_stateful_source_is_snapshotted_after_each_batch(mesh8):
    source = Stateful([{"x": np.zeros(8)}] * 2)
    producer = _producer([source], mesh=mesh8)
    assert producer.snapshot() == [{"pos": 0}]
    assert producer(0).snapshot == [{"pos": 1}]
    assert producer(1).snapshot == [{"pos": 2}]
    with pytest.raises(StopIteration) as end:
        producer(2)
    assert end.value.value == Ended([{"pos": 2}], None)


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


def test_the_outcome_describes_the_host_batch_for_the_agreement_step(mesh8):
    producer = _producer([[{"x": np.zeros((8, 3), np.float32)}]], mesh=mesh8, first=4, agree=True)
    made = producer(0)
    assert made.outcome[1:] == ["(8, 3) float32"]
    assert made.outcome[0].startswith("structure PyTreeSpec({'x': *}), partition P('data',)")
    assert made.where(0) == "GlobalBatchLoader: batch 4: batch['x']"
    with pytest.raises(StopIteration) as end:
        producer(1)
    assert end.value.value.outcome is not None and end.value.value.snapshot is None


def test_a_failed_batch_carries_its_outcome_when_the_processes_compare(mesh8):
    producer = _producer([[{"x": np.zeros(6)}]], mesh=mesh8, agree=True)
    with pytest.raises(ts.errors.IndivisibleError) as info:
        producer(0)
    assert getattr(info.value, OUTCOME)  # the consumer's agreement step compares it
    quiet = _producer([[{"x": np.zeros(6)}]], mesh=mesh8, agree=False)
    with pytest.raises(ts.errors.IndivisibleError) as info:
        quiet(0)
    assert not hasattr(info.value, OUTCOME)


def test_an_indivisible_batch_names_the_batch_index(mesh8):
    producer = _producer([[{"x": np.zeros(6)}]], mesh=mesh8, first=2)
    with pytest.raises(
        ts.errors.IndivisibleError,
        match=re.escape("GlobalBatchLoader: batch 2: host_arrays['x']: dim 0 has size 6"),
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
