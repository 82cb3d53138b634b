"""Placing (torchshard._place.place): a planned call's host tensors handed to the backend as one
view per device. The call that makes a plan goes through ``make_global``; a cached plan is bound
to its backend at its first reuse (``CallPlan.bound``), and later calls use the bound makers;
a loader's thread (``background``) always calls ``make_global``."""

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
from helpers import xla_shards

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard._mesh.context import current_topology
from torchshard._place import cache
from torchshard._place.call import read
from torchshard._place.place import Bound, bind, place, to_global

SPEC = ts.P("data", "model")


@pytest.fixture
def fresh_cache():
    cache.clear()
    yield
    cache.clear()


def _call(tree, partition=SPEC):
    mesh = ts.current_mesh()
    return read([tree], current_topology(mesh), partition, per_host=False)


def _to_global(tree, partition=SPEC, background=False):
    mesh = ts.current_mesh()
    call = _call(tree, partition)
    return to_global(mesh, lookup(mesh), current_topology(mesh), call, background=background)


def _planned(tree, partition=SPEC):
    mesh = ts.current_mesh()
    return cache.plan_call(mesh, lookup(mesh), current_topology(mesh), _call(tree, partition))


def _assert_placed(g, x, spec=SPEC):
    index_map = ts.NamedSharding(ts.current_mesh(), spec).devices_indices_map(tuple(x.shape))
    shards = xla_shards(g)
    assert sorted(shards) == list(range(8))
    for d, (_, data) in shards.items():
        np.testing.assert_array_equal(data.numpy(), np.asarray(x)[index_map[d]])


@pytest.mark.usefixtures("fresh_cache")
def test_a_cached_plan_is_bound_at_its_first_reuse(mesh42, monkeypatch):
    backend = lookup(mesh42)
    made = []
    real = backend.place.make_global
    monkeypatch.setattr(
        backend.place, "make_global", lambda *a, **k: made.append(1) or real(*a, **k)
    )
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    g = _to_global({"x": x})
    planned = _planned({"x": x})
    assert planned.bound is None  # the call that planned went through make_global
    assert len(made) == 1
    _assert_placed(g["x"], x)
    g = _to_global({"x": x + 1})  # the first reuse binds the plan
    bound = planned.bound
    assert isinstance(bound, Bound)
    assert len(bound.makers) == 1 and len(bound.placers) == 1  # one host: one placer per leaf
    assert len(made) == 1  # the bound makers, not make_global
    _assert_placed(g["x"], x + 1)
    g = _to_global({"x": x + 2})
    assert planned.bound is bound and len(made) == 1  # bound once
    _assert_placed(g["x"], x + 2)


@pytest.mark.usefixtures("fresh_cache")
def test_background_calls_go_through_make_global(mesh42, monkeypatch):
    backend = lookup(mesh42)
    seen = []
    real = backend.place.make_global

    def spy(*args, background=False):
        seen.append(background)
        return real(*args, background=background)

    monkeypatch.setattr(backend.place, "make_global", spy)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    for k in range(3):
        _assert_placed(_to_global({"x": x + k}, background=True)["x"], x + k)
    assert seen == [True, True, True]
    assert _planned({"x": x}).bound is not None  # bound at the first reuse, unused here


def test_bind_makes_one_maker_per_leaf(mesh42):
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    planned = _planned({"a": x, "b": [x, x]}, ts.P("data"))
    bound = bind(lookup(mesh42), mesh42, planned)
    assert len(bound.makers) == 3 and len(bound.placers) == 3
    out = bound.placers[1](torch.from_numpy(x))
    _assert_placed(out, x, ts.P("data"))


def test_place_returns_the_callers_tree(mesh42):
    x = np.arange(16).reshape(8, 2)
    tree = {"a": x, "b": (x, None), "c": [torch.from_numpy(x)]}
    call = _call(tree, ts.P("data"))
    backend = lookup(mesh42)
    planned = cache.plan_call(mesh42, backend, current_topology(mesh42), call)
    out = place(backend, mesh42, planned, call)
    assert set(out) == {"a", "b", "c"} and type(out["b"]) is tuple and out["b"][1] is None
    for leaf in (out["a"], out["b"][0], out["c"][0]):
        assert leaf.device.type == "xla"
        _assert_placed(leaf, x, ts.P("data"))


@pytest.mark.usefixtures("fresh_cache")
def test_already_global_leaves_are_returned_as_they_are_and_never_bound(mesh42):
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    g = ts.host_to_global_array(x, partition=ts.P("data"))
    for _ in range(2):
        out = _to_global({"g": g, "h": x}, ts.P("data"))
        assert out["g"] is g
        _assert_placed(out["h"], x, ts.P("data"))
    call = _call({"g": g, "h": x}, ts.P("data"))
    assert cache.key(mesh42, current_topology(mesh42), call) is None  # planned each time
