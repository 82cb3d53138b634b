"""dispatch_input_batch: axlearn's behaviours (ported), both key forms, shardings checked
against torch_xla's own shard indices, and the bad inputs."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
from sharding_oracle import assert_sharded_as

import torchshard as ts
from torchshard._core import deprecation as _deprecation

P = ts.P
KEY = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY

pytestmark = pytest.mark.filterwarnings("ignore:dispatch_input_batch is deprecated")


def _equal_trees(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _equal_trees(a[k], b[k])
    else:
        assert torch.equal(a, b), (a, b)


def test_key_value():
    assert ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY == "__physical_to_logical_batch_dispatch"


def test_deprecation_warned_once():
    _deprecation.reset()
    batch = {"x": torch.arange(4)}
    with pytest.warns(DeprecationWarning, match="dispatch_input_batch is deprecated; use "):
        ts.dispatch_input_batch(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.dispatch_input_batch(batch)


# -- axlearn's tests, no mesh ------------------------------------------------------------
def test_dispatch_subsets_input_batch():
    default = {"value_a": torch.arange(4), "value_b": torch.arange(16).reshape(4, 4)}
    _equal_trees(ts.dispatch_input_batch(default), default)
    with_key = dict(default)
    with_key[KEY] = torch.tensor([[1, 0], [0, 1], [0, 0], [0, 0]])
    expected = {k: v[:2] for k, v in default.items()}
    _equal_trees(ts.dispatch_input_batch(with_key), expected)
    assert KEY in with_key  # the input is not modified


def test_dispatch_subsets_input_batch_under_key():
    change = {"value_a": torch.arange(4), "value_b": torch.arange(16).reshape(4, 4)}
    batch = {"no-change": torch.arange(3), "change": change}
    _equal_trees(ts.dispatch_input_batch(batch), batch)
    batch["change"] = dict(change, **{KEY: torch.tensor([[1, 0], [0, 1], [0, 0], [0, 0]])})
    out = ts.dispatch_input_batch(batch)
    _equal_trees(
        out, {"no-change": torch.arange(3), "change": {k: v[:2] for k, v in change.items()}}
    )
    assert out["no-change"] is batch["no-change"]  # siblings untouched
    assert KEY in batch["change"]


def test_index_vector_equals_onehot():
    x = torch.arange(24).reshape(6, 4)
    onehot = torch.zeros(6, 3, dtype=torch.bool)
    onehot[[5, 0, 3], [0, 1, 2]] = True
    a = ts.dispatch_input_batch({"x": x, KEY: onehot}, check=True)
    b = ts.dispatch_input_batch({"x": x, KEY: torch.tensor([5, 0, 3])}, check=True)
    _equal_trees(a, b)
    assert torch.equal(a["x"], x[[5, 0, 3]])


def test_containers_keep_their_types():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    inner = OrderedDict(z=torch.arange(4), a=Pair(torch.arange(4), [torch.arange(8).reshape(4, 2)]))
    inner[KEY] = torch.tensor([3, 1])
    out = ts.dispatch_input_batch({"inner": inner, "other": (torch.arange(2),)})
    assert type(out["inner"]) is OrderedDict and list(out["inner"]) == ["z", "a"]
    assert type(out["inner"]["a"]) is Pair and type(out["other"]) is tuple
    assert torch.equal(out["inner"]["a"].b[0], torch.tensor([[6, 7], [2, 3]]))


def test_every_dict_with_the_key_at_any_depth():
    a = {"x": torch.arange(4), KEY: torch.tensor([2])}
    b = {"y": torch.arange(6), KEY: torch.tensor([5, 4])}
    out = ts.dispatch_input_batch({"a": a, "deeper": [{"b": b}]})
    assert out["a"]["x"].tolist() == [2]
    assert out["deeper"][0]["b"]["y"].tolist() == [5, 4]


# -- on a mesh ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "names", "batch_axes"),
    [
        ((1, 8), ("data", "model"), "data"),
        ((1, 2, 2, 2), ("replica", "data", "fsdp", "model"), ("replica", "data", "fsdp")),
        ((4, 2), ("data", "model"), "data"),
        ((2, 4), ("data", "model"), ("model", "data")),
    ],
)
def test_dispatch_shards_input_batch(shape, names, batch_axes):
    mesh = ts.Mesh(np.arange(8).reshape(shape), names)
    spec = P(batch_axes)
    with mesh:
        x = ts.host_to_global_array(np.ones(8, np.float32))  # split over every axis
        out = ts.dispatch_input_batch(x, batch_axis_names=batch_axes)
        assert_sharded_as(out, mesh, spec)
        # With a key: the dispatched leaves are constrained on the batch axes too.
        rows = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
        key = np.zeros((16, 8), bool)
        key[np.arange(15, -1, -2), np.arange(8)] = True
        batch = ts.host_to_global_array({"x": rows, KEY: key})
        out = ts.dispatch_input_batch(batch, batch_axis_names=batch_axes, check=True)
        assert list(out) == ["x"]
        assert_sharded_as(out["x"], mesh, spec)
        assert torch.equal(
            ts.replicate_to_local_data(out["x"]), torch.from_numpy(rows[15::-2].copy())
        )


def test_global_index_vector_equals_onehot(mesh42):
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    order = np.array([9, 2, 15, 0, 7, 4, 11, 6])
    onehot = np.zeros((16, 8), bool)
    onehot[order, np.arange(8)] = True
    a = ts.host_to_global_array({"x": rows, KEY: onehot})
    b = {
        "x": a["x"],
        KEY: ts.host_to_global_array(order.astype(np.int64), partition=P("data")),
    }
    ra = ts.replicate_to_local_data(ts.dispatch_input_batch(a, check=True))
    rb = ts.replicate_to_local_data(ts.dispatch_input_batch(b, check=True))
    assert torch.equal(ra["x"], torch.from_numpy(rows[order]))
    assert torch.equal(rb["x"], ra["x"])


# -- bad input ---------------------------------------------------------------------------
def test_onehot_check_names_the_columns():
    key = torch.tensor([[1, 0, 0], [0, 0, 1], [0, 0, 1], [0, 0, 0]])
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"input_batch['b'][{KEY!r}]: every column of a dispatch matrix must be one-hot "
            "(exactly one 1, the rest 0); expected one nonzero entry per column, but columns "
            "[1, 2] have [0, 2] nonzero entries."
        ),
    ):
        ts.dispatch_input_batch({"b": {"x": torch.arange(4), KEY: key}}, check=True)
    with pytest.raises(ts.ShardingError, match=re.escape("some entries are neither 0 nor 1.")):
        ts.dispatch_input_batch({"x": torch.arange(2), KEY: torch.tensor([[2], [0]])}, check=True)


def test_onehot_check_on_a_mesh(mesh42):
    key = np.zeros((8, 4), bool)
    key[0, 0] = key[1, 1] = key[2, 2] = True
    batch = ts.host_to_global_array({"x": np.arange(8), KEY: key})
    with pytest.raises(
        ts.ShardingError, match=re.escape("but columns [3] have [0] nonzero entries.")
    ):
        ts.dispatch_input_batch(batch, check=True)


def test_index_check():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"input_batch[{KEY!r}]: dispatch indices must be physical row numbers in [0, 4); "
            "got values in [1, 4]."
        ),
    ):
        ts.dispatch_input_batch({"x": torch.arange(4), KEY: torch.tensor([1, 4])}, check=True)


def test_onehot_rows_must_match_the_batch():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"input_batch[{KEY!r}]: a one-hot dispatch matrix has one row per physical example; "
            "expected shape (4, logical), got (3, 2)."
        ),
    ):
        ts.dispatch_input_batch({"x": torch.arange(4), KEY: torch.ones(3, 2)})


def test_key_of_the_wrong_rank_or_dtype():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"input_batch[{KEY!r}]: expected a one-hot matrix [physical, logical] (rank 2) or "
            "gather indices [logical] (rank 1), but got shape (4, 2, 1)."
        ),
    ):
        ts.dispatch_input_batch({"x": torch.arange(4), KEY: torch.ones(4, 2, 1)})
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"input_batch[{KEY!r}]: a 1-D dispatch tensor holds gather indices [logical] and "
            "must have an integer dtype; got torch.float32."
        ),
    ):
        ts.dispatch_input_batch({"x": torch.arange(4), KEY: torch.ones(2)})
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"input_batch[{KEY!r}]: expected the dispatch tensor (a torch.Tensor), but got ndarray."
        ),
    ):
        ts.dispatch_input_batch({"x": torch.arange(4), KEY: np.eye(4, 2)})


def test_siblings_must_share_the_physical_batch():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "input_batch['b']: every leaf beside a dispatch key is a batch of the same physical "
            "rows; expected dim 0 of size 4 (as input_batch['a']), got 3 (shape (3, 2))."
        ),
    ):
        ts.dispatch_input_batch(
            {"a": torch.arange(4), "b": torch.zeros(3, 2), KEY: torch.tensor([0])}
        )
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "input_batch['s']: dispatch selects rows along dim 0, so every leaf beside the "
            "dispatch key must be a tensor of rank >= 1; got shape ()."
        ),
    ):
        ts.dispatch_input_batch({"s": torch.tensor(1.0), KEY: torch.tensor([0])})


def test_nested_keys_are_refused():
    inner = {"y": torch.arange(4), KEY: torch.tensor([0])}
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "input_batch['outer']['inner']: this dict holds the dispatch key, and so does the "
            "dict around it (input_batch['outer'])"
        ),
    ):
        ts.dispatch_input_batch(
            {"outer": {"x": torch.arange(4), "inner": inner, KEY: torch.tensor([1])}}
        )
