"""One epoch's plan (torchshard.data._loader.plan): made once by ``iter()`` and frozen; whether a
thread makes the batches and whether their exchanges are pipelined follow from it; a channel
exactly when the processes compare or exchange; the plan picks the producer's mode; and the
loader hands the same plan to its producer and its epoch, neither of which can change it."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from data_helpers import make_plan

import torchshard as ts
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard.data._loader.plan import EpochPlan, plan_epoch
from torchshard.data._loader.producer import PipelinedProducer, Producer, producer_for
from torchshard.data._loader.stats import Counters

DATA = ts.P("data")


@pytest.mark.parametrize(
    ("fields", "background", "pipeline"),
    [
        ({"prefetch": 0}, False, False),
        ({"prefetch": 2}, True, False),
        ({"prefetch": 0, "agree": True, "channel": "c"}, False, False),
        ({"prefetch": 2, "agree": True, "channel": "c"}, True, True),
        ({"prefetch": 1, "agree": True, "channel": "c"}, True, True),
        ({"prefetch": 2, "agree": True, "channel": "c", "prefetch_bytes": 64}, True, False),
        ({"prefetch": 2, "agree": True, "exchange": True, "channel": "c"}, True, False),
        ({"prefetch": 2, "exchange": True, "channel": "c"}, True, False),
    ],
)
def test_background_and_pipeline_follow_from_the_plan(mesh8, fields, background, pipeline):
    plan = make_plan(mesh8, DATA, **fields)
    assert (plan.background, plan.pipeline) == (background, pipeline)
    kind = PipelinedProducer if pipeline else Producer
    exchanges = None
    if plan.channel is not None:
        from torchshard.data._loader.exchanges import Exchanges

        exchanges = Exchanges(object(), mesh8, plan.channel)  # nothing is exchanged here
    producer = producer_for(plan, [iter([])], [[]], None, Counters(), exchanges)
    assert type(producer) is kind and producer.plan is plan


def test_a_plan_is_frozen(mesh8):
    plan = make_plan(mesh8, DATA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prefetch = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    "fields",
    [{"agree": True}, {"exchange": True}, {"channel": "loader1"}],
    ids=["agree-without-channel", "exchange-without-channel", "channel-without-exchange"],
)
def test_a_channel_exactly_when_the_processes_compare_or_exchange(mesh8, fields):
    agree, exchange = fields.get("agree", False), fields.get("exchange", False)
    message = (
        "EpochPlan: a channel is needed exactly when the processes compare or exchange "
        f"(agree={agree}, exchange={exchange}), but got channel={fields.get('channel')!r}."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_plan(mesh8, DATA, **fields)


def test_a_producer_needs_exchanges_exactly_when_its_plan_has_a_channel(mesh8):
    for prefetch in (0, 2):  # in place, and pipelined on a thread
        plan = make_plan(mesh8, DATA, agree=True, channel="loader3", prefetch=prefetch)
        with pytest.raises(ValueError, match=r"^Producer: exchanges are needed exactly when"):
            producer_for(plan, [iter([])], [[]], None, Counters())


def test_a_pipelined_producer_needs_a_pipelined_plan(mesh8):
    from torchshard.data._loader.exchanges import Exchanges

    plan = make_plan(mesh8, DATA, agree=True, channel="c", prefetch=0)
    message = (
        "PipelinedProducer: needs a plan whose pipeline is on (a thread, the agreement check, "
        "no status exchange, no byte budget), but got prefetch=0, agree=True, exchange=False, "
        "prefetch_bytes=None."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        PipelinedProducer(plan, [iter([])], [[]], None, Counters(), Exchanges(None, mesh8, "c"))


def test_on_one_process_the_plan_compares_nothing(mesh8):
    source = [{"x": np.zeros((8, 2), np.float32)}]
    plan = plan_epoch(
        mesh8,
        sources=[source],
        dispatchers=None,
        partition=DATA,
        per_host=False,
        policy="drop",
        prefetch=3,
        prefetch_bytes=None,
        first=4,
        samplers=None,
    )
    assert plan == EpochPlan(
        mesh=mesh8,
        backend=plan.backend,
        spec=DATA,
        first=4,
        processes=1,
        explicit_partition=True,
        policy="drop",
        prefetch=3,
        full=(None,),
    )
    assert plan.backend.name == "xla" and not plan.agree and plan.channel is None


def test_the_plan_counts_the_processes_of_the_global_position(mesh8):
    from torch.utils.data import DataLoader

    dataset = list(range(64))
    sampler = ts.host_sampler(dataset, {"num_shards": 1, "shard_index": 0}, shuffle=False)
    source = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=0)
    plan = plan_epoch(
        mesh8,
        sources=[source],
        dispatchers=None,
        partition=ts.DataPartitionType.FULL,
        per_host=False,
        policy="error",
        prefetch=2,
        prefetch_bytes=None,
        first=0,
        samplers=[sampler],
    )
    assert plan.full == (8,) and plan.share == (1, 1) and plan.warmup == 1
    assert plan.spec is DEFAULT_PARTITION and plan.explicit_partition  # FULL: the default


def test_the_loader_hands_one_plan_to_its_producer_and_its_epoch(mesh8):
    """``iter()`` makes the plan; the epoch's producer and the epoch itself read that plan,
    the same object, and nothing of either writes the other's settings."""
    batches = [{"x": np.zeros((8, 2), np.float32)}] * 2
    loader = ts.GlobalBatchLoader(batches, prefetch=0)
    epoch = iter(loader)
    maker = epoch._maker
    producer = maker._produce
    assert isinstance(producer, Producer)
    assert producer.plan is epoch._plan and epoch._plan.prefetch == 0
    assert [b["x"].shape[0] for b in epoch] == [8, 8]
