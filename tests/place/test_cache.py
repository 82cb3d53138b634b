"""The plan cache (torchshard._place.cache): a call's plans kept by everything they depend on;
a hit returns the same CallPlan and still reads the new data; calls that are not cached (a spec
tree partition, an unsupported leaf, a global shape that is not a tuple of ints); clear()."""

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
from helpers import to_numpy, xla_shards

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard._mesh.context import current_topology
from torchshard._place import cache
from torchshard._place.call import read


@pytest.fixture
def fresh_cache():
    """An empty plan cache, before and after."""
    cache.clear()
    yield
    cache.clear()


DATA = ts.P("data")


def _plan(tree, partition=DATA, global_shape=None):
    """The cache's plan of one call on the current mesh (one host)."""
    mesh = ts.current_mesh()
    topology = current_topology(mesh)
    call = read([tree], topology, partition, per_host=False, global_shape=global_shape)
    return cache.plan_call(mesh, lookup(mesh), topology, call), call


def _key(tree, partition=DATA, global_shape=None):
    mesh = ts.current_mesh()
    topology = current_topology(mesh)
    call = read([tree], topology, partition, per_host=False, global_shape=global_shape)
    return cache.key(mesh, topology, call)


def _check_shards(g, expected, mesh, spec):
    """Each device holds the numpy slice devices_indices_map names; torch_xla agrees."""
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(tuple(expected.shape))
    shards = xla_shards(g)
    assert sorted(shards) == list(range(8))
    for d, (ranges, data) in shards.items():
        assert ranges == tuple((s.start, s.stop) for s in index_map[d])
        np.testing.assert_array_equal(
            to_numpy(data), to_numpy(torch.as_tensor(expected))[index_map[d]]
        )


def test_repeated_calls_reuse_plans_but_never_data_or_skipped_checks(mesh42):
    """A call's plans are kept by (mesh, topology, partition, structure, leaf types, shapes,
    dtypes): a hit still reads the new data, a bad call in between is still refused (and not
    cached), and a numpy leaf of the same shape is not taken for a tensor."""
    from torchshard._core.tree import structure
    from torchshard._place import cache as _engine

    spec = ts.P(("data", "model"))
    first = torch.arange(32).reshape(8, 4)
    g = ts.host_to_global_array({"x": first}, partition=spec)
    key = next(k for k in _engine._CALLS if k[4] == (structure({"x": 0}),) and k[3] == spec)
    plans = _engine._CALLS[key].plans
    assert all(not any(isinstance(v, torch.Tensor) for v in vars(p).values()) for p in plans)
    with pytest.raises(ts.ShardingError, match=r"host_arrays\['x'\]"):
        ts.host_to_global_array({"x": torch.zeros(7, 4)}, partition=spec)
    second = first + 100
    g = ts.host_to_global_array({"x": second}, partition=spec)
    assert _engine._CALLS[key].plans is plans  # a hit
    _check_shards(g["x"], second.numpy(), ts.current_mesh(), spec)
    g = ts.host_to_global_array({"x": second.numpy().astype(np.int32)}, partition=spec)
    assert g["x"].dtype == torch.int32
    _check_shards(g["x"], second.numpy(), ts.current_mesh(), spec)
    needs_grad = second.float().requires_grad_()  # not cached: converted (detached) each call
    for _ in range(2):
        g = ts.host_to_global_array({"x": needs_grad}, partition=spec)
        _check_shards(g["x"], second.float().numpy(), ts.current_mesh(), spec)


@pytest.mark.usefixtures("fresh_cache")
def test_a_hit_returns_the_same_call_plan(mesh42):
    first, call = _plan({"x": np.zeros((8, 2), np.float32)})
    assert call.tensors is not None  # validated: this call made the plan
    again, call = _plan({"x": np.ones((8, 2), np.float32)})  # same key, other values
    assert again is first
    assert call.tensors is None  # a hit skips validation (the key says no checks are needed)
    assert len(cache._CALLS) == 1 and cache._LAST[0][1] is first
    other, _ = _plan({"x": np.zeros((16, 2), np.float32)})  # another shape: another key
    assert other is not first and len(cache._CALLS) == 2
    assert _plan({"x": np.zeros((8, 2), np.float32)})[0] is first  # from the dict, not _LAST


def test_the_key_holds_what_the_plans_depend_on(mesh42):
    x = np.zeros((8, 2), np.float32)
    k = _key({"x": x})
    assert k is not None and k[0] == ts.current_mesh() and k[3] == ts.P("data")
    assert k[-1] == (np.ndarray, (8, 2), np.dtype(np.float32))
    assert _key({"x": x}) == k
    assert _key({"y": x}) != k  # the structure
    assert _key({"x": x}, ts.P("model")) != k  # the partition
    assert _key({"x": x.astype(np.int32)}) != k  # the dtype
    assert _key({"x": torch.zeros(8, 2)}) != k  # the leaf's kind: a tensor is used as it is
    assert _key({"x": torch.zeros(8, 2)})[-1] == (torch.Size([8, 2]), torch.float32)
    assert _key({"x": x}, global_shape=(16, 2)) != k


def test_calls_that_are_not_cached_have_no_key(mesh42):
    x = np.zeros((8, 2), np.float32)
    assert _key({"x": x}, {"x": ts.P("data")}) is None  # a spec tree partition
    assert _key({"x": x}, global_shape=[8, 2]) is None  # not a tuple
    assert _key({"x": x}, global_shape={"x": (8, 2)}) is None  # a prefix tree of shapes
    assert _key({"x": x, "n": np.float32(3)}) is None  # a numpy scalar: converted each call
    assert _key({"x": torch.zeros(8, 2).requires_grad_()}) is None  # detached each call
    assert _key({"x": ts.TensorSpec((8, 2), torch.float32)}) is None  # not a host array
    assert _key({"x": x}, ts.DataPartitionType.REPLICATED) is not None
    assert _key({"x": x}, None) is None  # None: replicated, given as a prefix tree


@pytest.mark.usefixtures("fresh_cache")
def test_calls_without_a_key_plan_every_time(mesh42):
    tree = {"x": np.zeros((8, 2), np.float32)}
    a, _ = _plan(tree, {"x": ts.P("data")})
    b, _ = _plan(tree, {"x": ts.P("data")})
    assert a is not b and cache._CALLS == {}
    assert [p.axes for p in a.plans] == [p.axes for p in b.plans]


@pytest.mark.usefixtures("fresh_cache")
def test_clear_forgets_every_plan(mesh42):
    first, _ = _plan({"x": np.zeros((8, 2), np.float32)})
    cache.clear()
    assert cache._CALLS == {} and cache._LAST == [None]
    assert _plan({"x": np.zeros((8, 2), np.float32)})[0] is not first


@pytest.mark.usefixtures("fresh_cache")
def test_the_cache_is_bounded(mesh42, monkeypatch):
    monkeypatch.setattr(cache, "_CALLS_BOUND", 2)
    plans = [_plan({"x": np.zeros((8 * (i + 1), 2), np.float32)})[0] for i in range(2)]
    assert len(cache._CALLS) == 2
    _plan({"x": np.zeros((24, 2), np.float32)})  # full: cleared, then kept
    assert len(cache._CALLS) == 1
    assert _plan({"x": np.zeros((8, 2), np.float32)})[0] is not plans[0]


@pytest.mark.usefixtures("fresh_cache")
def test_a_bad_call_is_refused_on_every_call_and_never_kept(mesh42):
    for _ in range(2):
        with pytest.raises(ts.errors.IndivisibleError, match=r"host_arrays\['x'\]"):
            _plan({"x": np.zeros((6, 2), np.float32)})
    assert cache._CALLS == {}
