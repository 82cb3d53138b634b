"""What a runtime implements (torchshard._backend.protocols): the ``Backend`` record and its
protocols. Both shipped records implement the four every runtime has, member by member with the
protocol's parameters; torch_xla's has no limits, process checks, device threads or local
views (``None``, not no-op members: its SPMD step takes global tensors), DTensor's has all
four."""

import dataclasses
import inspect

import pytest
import torch

from torchshard._backend import protocols
from torchshard._backend.registry import lookup

ALWAYS = {
    "place": protocols.Placement,
    "read": protocols.ReadBack,
    "step": protocols.InStep,
    "meshes": protocols.Meshes,
}
OPTIONAL = {
    "limits": protocols.LayoutLimits,
    "processes": protocols.ProcessChecks,
    "threads": protocols.DeviceThreads,
    "views": protocols.LocalViews,
}


def _members(protocol):
    return {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def _check_implements(obj, protocol):
    members = _members(protocol)
    assert members, protocol
    for name, member in members.items():
        got = getattr(type(obj), name, None)
        assert got is not None, f"{type(obj).__name__} lacks {protocol.__name__}.{name}"
        if isinstance(member, property):
            continue
        want = list(inspect.signature(member).parameters)
        have = list(inspect.signature(got).parameters)
        assert have == want, (protocol.__name__, name, have, want)


def test_the_record_fields():
    fields = [f.name for f in dataclasses.fields(protocols.Backend)]
    assert fields == ["name", *ALWAYS, *OPTIONAL]
    defaults = {f.name: f.default for f in dataclasses.fields(protocols.Backend)}
    assert all(defaults[name] is None for name in OPTIONAL)
    xla = lookup("xla")
    with pytest.raises(dataclasses.FrozenInstanceError):
        xla.name = "other"


@pytest.mark.parametrize("name", ["xla", "dtensor"])
def test_every_backend_implements_the_four_protocols(name):
    backend = lookup(name)
    for field, protocol in ALWAYS.items():
        _check_implements(getattr(backend, field), protocol)


def test_torch_xla_has_only_layout_limits_of_the_optional_protocols():
    """torch_xla 2.9 has one limit (sharded leaves of rank <= 5); no process checks, device
    threads or local views (its step takes global tensors)."""
    backend = lookup("xla")
    _check_implements(backend.limits, OPTIONAL["limits"])
    assert (backend.processes, backend.threads, backend.views) == (None,) * 3


def test_dtensor_has_every_optional_protocol():
    backend = lookup("dtensor")
    for field, protocol in OPTIONAL.items():
        assert getattr(backend, field) is not None, field
        _check_implements(getattr(backend, field), protocol)


def test_records_compare_by_identity():
    """``eq=False``: two records are equal only when they are the same record."""
    xla = lookup("xla")
    twin = dataclasses.replace(xla)
    assert twin != xla and twin.place is xla.place
    assert hash(xla) == object.__hash__(xla)


def test_a_local_shard_is_a_named_tuple():
    shard = protocols.LocalShard(3, ((0, 2), (4, 8)), torch.zeros(2, 4))
    device, ranges, data = shard
    assert (device, ranges) == (3, ((0, 2), (4, 8))) and data.shape == (2, 4)
    assert shard._fields == ("device", "ranges", "data")
