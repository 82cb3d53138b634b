"""The dispatchers' protocol (torchshard._step.protocol): what the loader, ``sharded_collate`` and
``host_sampler`` ask of an input dispatcher. Both shipped dispatchers and a user's own class
satisfy it structurally; ``is_dispatcher`` asks only for the host-side conversion."""

import numpy as np
import pytest
from data_helpers import FakeDispatcher

import torchshard as ts
from torchshard._step.protocol import Dispatcher, is_dispatcher


class Minimal:
    """A user's own dispatcher: no base class, just the four members."""

    partition_spec = ts.P("data")

    def feed_read_config(self):
        return {"num_shards": 1, "shard_index": 0}

    def logical_to_physical_batch(self, batch, /):
        return batch

    def physical_to_logical_batch(self, batch, /):
        return batch


class HostSideOnly:
    def logical_to_physical_batch(self, batch, /):
        return batch


@pytest.mark.xla
def test_the_shipped_dispatchers_are_dispatchers(mesh42):
    for d in (
        ts.InputDispatcher(8, num_physical_feeds=1, physical_feed_index=0),
        ts.SpmdInputDispatcher(8, partition_spec=ts.P("data")),
    ):
        assert isinstance(d, Dispatcher) and is_dispatcher(d)


def test_a_class_with_the_members_is_a_dispatcher_without_inheriting():
    assert isinstance(Minimal(), Dispatcher) and is_dispatcher(Minimal())


def test_is_dispatcher_asks_only_for_the_host_side_conversion():
    assert is_dispatcher(HostSideOnly())
    assert not isinstance(HostSideOnly(), Dispatcher)  # the whole protocol: no
    fake = FakeDispatcher(ts.P("data"))  # the loader tests' stand-in: host side and spec only
    assert is_dispatcher(fake) and not isinstance(fake, Dispatcher)


@pytest.mark.parametrize(
    "value", [None, ts.P("data"), {"logical_to_physical_batch": 1}, np.zeros(2)]
)
def test_other_values_are_not_dispatchers(value):
    assert not is_dispatcher(value) and not isinstance(value, Dispatcher)


def test_a_non_callable_conversion_is_not_one():
    class Broken:
        logical_to_physical_batch = "not a function"

    assert not is_dispatcher(Broken())


def test_the_protocol_names_what_the_loader_uses():
    members = {n for n in vars(Dispatcher) if not n.startswith("_")}
    assert members == {
        "partition_spec",
        "feed_read_config",
        "logical_to_physical_batch",
        "physical_to_logical_batch",
    }
