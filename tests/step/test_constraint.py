"""with_sharding_constraint (strict) and maybe_shard (best effort): in-step annotations checked
against torch_xla's own shard indices."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
import torch_xla.distributed.spmd as xs
from sharding_oracle import assert_sharded_as, placed_ranges

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard._core.spec import UNCONSTRAINED
from torchshard._step import constraint as _constraint

P = ts.P


@pytest.fixture(autouse=True)
def _fresh_debug_log():
    _constraint._LOGGED.clear()
    yield
    _constraint._LOGGED.clear()


def _global(mesh, x, spec=None):
    spec = P(mesh.axis_names) if spec is None else spec
    return ts.host_to_global_array(x, partition=spec)


def _rows(n=8, width=3):
    return np.arange(n * width, dtype=np.float32).reshape(n, width)


# -- no-ops ------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [ts.with_sharding_constraint, ts.maybe_shard])
def test_spec_none_returns_input(mesh42, fn):
    x = {"a": _global(mesh42, _rows())}
    assert fn(x, None) is x


@pytest.mark.parametrize("fn", [ts.with_sharding_constraint, ts.maybe_shard])
def test_no_mesh_returns_input(fn):
    x = {"a": torch.arange(4)}
    assert ts.current_mesh() is None
    assert fn(x, P("data")) is x
    assert fn(x, P("no_such_axis", None, None)) is x  # not even validated


@pytest.mark.parametrize("fn", [ts.with_sharding_constraint, ts.maybe_shard])
def test_one_device_mesh_returns_input(monkeypatch, fn):
    # A 1-device mesh cannot be entered on the 8-device runtime (a mesh covers every device),
    # so the current mesh is stubbed.
    one = ts.Mesh(np.array([0]), ("data",))
    monkeypatch.setattr(_constraint, "current_mesh", lambda: one)
    x = {"a": torch.arange(4)}
    assert fn(x, P("data")) is x


# -- strict ------------------------------------------------------------------------------
def test_constrains_device_data_without_touching_it(mesh42):
    x = _global(mesh42, _rows())  # rows over ("data", "model"): one row per device
    y = ts.with_sharding_constraint(x, P("model"))
    assert y is not x
    assert_sharded_as(y, mesh42, P("model"))
    assert_sharded_as(x, mesh42, P(("data", "model")))
    assert torch.equal(ts.replicate_to_local_data(y), torch.from_numpy(_rows()))


def test_torch_xla_refuses_to_reannotate_device_data(mesh42):
    """The case with_sharding_constraint handles: mark_sharding on device data that carries
    another sharding is refused until cleared (and clearing reshards through the host)."""
    x = _global(mesh42, _rows(8, 4))
    with pytest.raises(RuntimeError, match="Existing annotation must be cleared first"):
        xs.mark_sharding(x, mesh42.xla_mesh, ("model", None))
    y = ts.with_sharding_constraint(x, P("data", "model"))
    assert_sharded_as(y, mesh42, P("data", "model"))
    assert_sharded_as(x, mesh42, P(("data", "model")))


def test_reannotates_lazy_tensor(mesh42):
    x = _global(mesh42, _rows())
    y = ts.with_sharding_constraint(x * 2, P("data"))
    z = ts.with_sharding_constraint(y, P(None, "model"))
    assert_sharded_as(z, mesh42, P(None, "model"))
    assert torch.equal(ts.replicate_to_local_data(z), torch.from_numpy(_rows() * 2))


@pytest.mark.parametrize(
    "spec",
    [P("data"), P("model"), P(("data", "model")), P(("model", "data")), P(None, "model"), P()],
)
def test_every_spec_matches_index_maths(mesh42, spec):
    x = _global(mesh42, _rows(8, 4))
    assert_sharded_as(ts.with_sharding_constraint(x + 1, spec), mesh42, spec)


def test_uneven_split_in_step_is_placed_as_index_maths_says(mesh42):
    # In a step XLA pads uneven splits (6 rows over 4 shards); devices_indices_map describes
    # them exactly as torch_xla places them.
    x = _global(mesh42, _rows(8))[:6]
    y = ts.with_sharding_constraint(x, P("data"))
    assert placed_ranges(y, mesh42)[6] == ((6, 6), (0, 3))
    assert_sharded_as(y, mesh42, P("data"))


def test_zero_dim_replicated(mesh42):
    x = _global(mesh42, _rows()).sum()
    y = ts.with_sharding_constraint(x, P())
    assert_sharded_as(y, mesh42, P())


def test_tree_with_prefix_specs(mesh42):
    a = _global(mesh42, _rows())
    b = _global(mesh42, _rows())
    x = {"a": a, "b": [b], "c": None}
    y = ts.with_sharding_constraint(x, {"a": P("model"), "b": None, "c": None})
    assert list(y) == ["a", "b", "c"] and y["c"] is None
    assert y["b"][0] is b  # None: left unconstrained
    assert_sharded_as(y["a"], mesh42, P("model"))
    assert x["a"] is a  # the input tree is not modified


def test_one_spec_for_a_whole_tree(mesh42):
    x = {"a": _global(mesh42, _rows()), "b": (_global(mesh42, _rows(8, 2)),)}
    y = ts.with_sharding_constraint(x, P("model"))
    assert type(y["b"]) is tuple
    assert_sharded_as(y["a"], mesh42, P("model"))
    assert_sharded_as(y["b"][0], mesh42, P("model"))


def test_strict_errors(mesh42):
    x = {"a": [_global(mesh42, _rows())]}
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "x['a'][0]: partition spec P('data', None, None) has 3 entries but the array has "
            "rank 2; a spec may not be longer than the rank of the array it shards."
        ),
    ):
        ts.with_sharding_constraint(x, P("data", None, None))
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "x['a'][0]: partition spec P('fsdp',) names mesh axis 'fsdp', which is not an axis "
            "of the mesh; expected one of ('data', 'model')."
        ),
    ):
        ts.with_sharding_constraint(x, P("fsdp"))
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "x['a'][0]: partition spec P(UNCONSTRAINED,): entry 0 is UNCONSTRAINED, which only "
            "maybe_shard accepts"
        ),
    ):
        ts.with_sharding_constraint(x, P(UNCONSTRAINED))


def test_strict_type_errors(mesh42):
    with pytest.raises(
        TypeError,
        match=re.escape(
            "x['a'][1]: with_sharding_constraint annotates tensors of the xla backend (inside a "
            "step), but got Tensor on cpu. Move host data with host_to_global_array first."
        ),
    ):
        ts.with_sharding_constraint({"a": [_global(mesh42, _rows()), torch.zeros(2)]}, P())
    x = {"a": [_global(mesh42, _rows())]}
    with pytest.raises(
        TypeError,
        match=re.escape(
            "spec: expected a PartitionSpec or a tree prefix of them, but got the str 'data'; "
            "write P('data')."
        ),
    ):
        ts.with_sharding_constraint(x, "data")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "spec (for x['a'][0]): expected a PartitionSpec or None, but got 'data' of type "
            "str; wrap axis names in P(...)."
        ),
    ):
        ts.with_sharding_constraint(x, {"a": ["data"]})
    with pytest.raises(
        ts.errors.TreeStructureError, match=re.escape("spec must be a tree prefix of x")
    ):
        ts.with_sharding_constraint(x, {"b": P()})


def test_nothing_annotated_when_a_leaf_is_bad(mesh42, monkeypatch):
    calls = []
    backend = lookup(mesh42)
    original = backend.step.annotate
    monkeypatch.setattr(backend.step, "annotate", lambda *a: calls.append(a) or original(*a))
    x = [_global(mesh42, _rows()), _global(mesh42, _rows()).sum()]
    with pytest.raises(ts.ShardingError):
        ts.with_sharding_constraint(x, P("data"))
    assert calls == []


# -- best effort -------------------------------------------------------------------------
def test_maybe_shard_plain_sequence(mesh42):
    x = _global(mesh42, _rows())
    assert_sharded_as(ts.maybe_shard(x, ["model", None]), mesh42, P("model", None))
    assert_sharded_as(ts.maybe_shard(x, "model"), mesh42, P("model"))


def test_maybe_shard_empty_spec_replicates(mesh42, caplog):
    """P() has no UNCONSTRAINED entry: it asks for replication, as in with_sharding_constraint
    (it used to count as "all UNCONSTRAINED" and return the tensor as it was)."""
    x = _global(mesh42, _rows())
    with caplog.at_level(logging.DEBUG, logger="torchshard"):
        y = ts.maybe_shard(x, P())
    assert y is not x
    assert_sharded_as(y, mesh42, P())
    assert torch.equal(ts.replicate_to_local_data(y), torch.from_numpy(_rows()))
    assert caplog.records == []


def test_maybe_shard_all_unconstrained_is_nothing_to_do(mesh42, caplog):
    x = _global(mesh42, _rows())
    with caplog.at_level(logging.DEBUG, logger="torchshard"):
        assert ts.maybe_shard(x, (UNCONSTRAINED, UNCONSTRAINED)) is x
    assert caplog.records == []


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            (UNCONSTRAINED, "model"),
            (
                "P(UNCONSTRAINED, 'model') mixes UNCONSTRAINED with constrained dimensions, which "
                "the xla backend cannot express."
            ),
        ),
        (
            ("data", None, None),
            "partition spec P('data', None, None) has 3 entries but the array has rank 2",
        ),
        (
            ("fsdp",),
            "partition spec P('fsdp',) names mesh axis 'fsdp', which is not an axis of the mesh",
        ),
    ],
)
def test_maybe_shard_leaves_what_it_cannot_apply_and_logs_once(mesh42, caplog, spec, reason):
    x = _global(mesh42, _rows())
    with caplog.at_level(logging.DEBUG, logger="torchshard"):
        assert ts.maybe_shard(x, spec) is x
        assert ts.maybe_shard({"a": x}, spec)["a"] is x
    assert len(caplog.records) == 1
    record = caplog.records[0]
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith("maybe_shard: left a tensor of shape (8, 3) as it is: ")
    assert reason in record.getMessage()


def test_maybe_shard_leaves_host_tensors(mesh42, caplog):
    x = {"host": torch.arange(8), "dev": _global(mesh42, _rows())}
    with caplog.at_level(logging.DEBUG, logger="torchshard"):
        y = ts.maybe_shard(x, P("model"))
    assert y["host"] is x["host"]
    assert_sharded_as(y["dev"], mesh42, P("model"))
    assert [r.getMessage() for r in caplog.records] == [
        (
            "maybe_shard: left Tensor on cpu as it is: P('model',) applies to tensors of the xla "
            "backend."
        )
    ]


def test_maybe_shard_applies_per_leaf(mesh42):
    # A rank-0 leaf cannot take P("model"); its rank-2 sibling still does.
    x = _global(mesh42, _rows())
    s = x.sum()
    y = ts.maybe_shard([x, s], P("model"))
    assert y[1] is s
    assert_sharded_as(y[0], mesh42, P("model"))


def test_maybe_shard_malformed_spec_is_a_type_error(mesh42):
    with pytest.raises(TypeError, match="PartitionSpec entry 0 must be None, an axis name"):
        ts.maybe_shard(_global(mesh42, _rows()), (3,))


def test_gradients_flow_through(mesh42):
    x = _global(mesh42, _rows()).requires_grad_(True)
    y = ts.with_sharding_constraint(x, P("model"))
    (y * 3).sum().backward()
    torch_xla.sync()
    assert torch.equal(x.grad.cpu(), torch.full((8, 3), 3.0))


def test_accepts_what_mark_sharding_returns(mesh42):
    t = torch.arange(16.0).reshape(8, 2).to("xla")
    wrapped = xs.mark_sharding(t, mesh42.xla_mesh, ("data", None))
    assert type(wrapped) is not torch.Tensor  # an XLAShardedTensor
    y = ts.with_sharding_constraint(wrapped, P("model"))
    assert_sharded_as(y, mesh42, P("model"))
    assert torch.equal(ts.replicate_to_local_data(y), torch.arange(16.0).reshape(8, 2))


def test_a_spec_dict_is_matched_to_the_data_by_key(mesh42):
    """OrderedDict(b=..., a=...) data with a plain-dict spec tree: each key gets its own spec
    (they were matched by position: a dict sorts its keys, an OrderedDict keeps them)."""
    import collections

    x = collections.OrderedDict(b=_global(mesh42, _rows()), a=_global(mesh42, _rows()))
    out = ts.with_sharding_constraint(x, {"a": P(), "b": P("data", "model")})
    assert type(out) is collections.OrderedDict and list(out) == ["b", "a"]
    assert_sharded_as(out["a"], mesh42, P())
    assert_sharded_as(out["b"], mesh42, P("data", "model"))
