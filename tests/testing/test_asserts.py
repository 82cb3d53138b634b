"""torchshard.testing.assert_sharded / assert_global_equal: what passes, and the exact messages."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla.distributed.spmd as xs

import torchshard as ts
from torchshard.testing import (
    assert_global_equal,
    assert_sharded,
    host_to_global_array_per_host,
    virtual_hosts,
)

X = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)


@pytest.mark.parametrize(
    "spec",
    [ts.P(), ts.P("data"), ts.P("data", "model"), ts.P(("data", "model")), ts.P(None, "model")],
)
def test_assert_sharded_passes_for_the_placed_spec(mesh42, spec):
    g = ts.host_to_global_array(X, partition=spec)
    assert_sharded(g, spec)
    assert_sharded(g, tuple(spec) + (None,) * (2 - len(spec)))  # trailing Nones are the same
    assert_sharded(g + 1, spec)  # a lazy result: materialised, then checked
    assert_global_equal(g, X)


def test_assert_sharded_on_a_permuted_mesh():
    ids = np.array([3, 1, 7, 5, 0, 2, 6, 4]).reshape(4, 2)
    permuted = ts.Mesh(ids, ("data", "model"))
    plain = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    with permuted:
        g = ts.host_to_global_array(X, partition=ts.P("data"))
        assert_sharded(g, ts.P("data"))
    with pytest.raises(AssertionError, match=re.escape("6 of 8 devices hold another block:")):
        assert_sharded(g, ts.P("data"), plain)


def test_wrong_spec_message(mesh42):
    g = ts.host_to_global_array(X, partition=ts.P("data"))
    want = "\n".join(
        [
            (
                "tensor of shape (16, 8) is not sharded as P(None, 'model') on "
                "Mesh({'data': 4, 'model': 2})."
            ),
            (
                "Expected dim 0 whole, dim 1 in 2 blocks; torch_xla holds dim 0 in 4 blocks, "
                "dim 1 whole."
            ),
            "8 of 8 devices hold another block:",
            "  device  expected     actual",
            "  0       [0:16, 0:4]  [0:4, 0:8]",
            "  1       [0:16, 4:8]  [0:4, 0:8]",
            "  2       [0:16, 0:4]  [4:8, 0:8]",
            "  3       [0:16, 4:8]  [4:8, 0:8]",
            "  4       [0:16, 0:4]  [8:12, 0:8]",
            "  5       [0:16, 4:8]  [8:12, 0:8]",
            "  6       [0:16, 0:4]  [12:16, 0:8]",
            "  7       [0:16, 4:8]  [12:16, 0:8]",
        ]
    )
    with pytest.raises(AssertionError) as e:
        assert_sharded(g, ts.P(None, "model"))
    assert str(e.value) == want


def test_replicated_tensor_when_a_split_was_expected(mesh42):
    g = ts.host_to_global_array(X, partition=ts.P())
    with pytest.raises(AssertionError) as e:
        assert_sharded(g, ts.P("data"))
    lines = str(e.value).splitlines()
    assert lines[1] == (
        "Expected dim 0 in 4 blocks, dim 1 whole; torch_xla holds it replicated: every device "
        "has the whole (16, 8) array."
    )
    assert lines[3:5] == ["  device  expected      actual", "  0       [0:4, 0:8]    [0:16, 0:8]"]


def test_unannotated_tensor(mesh42):
    t = torch.from_numpy(X).to("xla")
    assert_sharded(t, ts.P())
    assert_sharded(t, None)
    assert_global_equal(t, X)
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "tensor of shape (16, 8) is not sharded as P('data',) on Mesh({'data': 4, 'model': 2})"
            ": it carries no sharding at all (moved to the device and never annotated), so every "
            "device holds the whole array, but P('data',) expects dim 0 in 4 blocks, dim 1 whole. "
            "Place it with torchshard.host_to_global_array(..., partition=spec) or annotate it."
        ),
    ):
        assert_sharded(t, ts.P("data"))


def test_mark_sharding_tensor(mesh42):
    t = torch.from_numpy(X).to("xla")
    xs.mark_sharding(t, mesh42.xla_mesh, ("model", "data"))
    assert_sharded(t, ts.P("model", "data"))
    assert_global_equal(t, X)


def test_bad_arguments(mesh42):
    g = ts.host_to_global_array(X, partition=ts.P("data"))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "assert_sharded: tensor must be a global tensor of the 'xla' backend (an XLA tensor, "
            "e.g. from torchshard.host_to_global_array), but got a tensor on cpu."
        ),
    ):
        assert_sharded(torch.from_numpy(X), ts.P("data"))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "assert_global_equal: global_tensor must be a global tensor of the 'xla' backend (an "
            "XLA tensor, e.g. from torchshard.host_to_global_array), but got ndarray."
        ),
    ):
        assert_global_equal(X, X)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "assert_global_equal: expected must be a host value (numpy array or CPU tensor), but "
            "got a tensor on xla:0."
        ),
    ):
        assert_global_equal(g, g)
    with pytest.raises(ts.ShardingError, match=re.escape("names mesh axis 'batch'")):
        assert_sharded(g, ts.P("batch"))


def test_no_mesh():
    with pytest.raises(
        ts.errors.NoMeshError,
        match=re.escape(
            "assert_sharded: no mesh was given and there is no current mesh in this thread; pass "
            "mesh=... or call it inside `with mesh:`."
        ),
    ):
        assert_sharded(torch.zeros(2), ts.P())


def test_assert_global_equal_names_device_and_slice(mesh42):
    g = ts.host_to_global_array(X, partition=ts.P("data", "model"))
    y = X.copy()
    y[5, 6] = -1.0
    y[13, 1] = 7.5
    want = "\n".join(
        [
            (
                "assert_global_equal: 2 of 8 device shards differ from expected (global shape "
                "(16, 8), torch.float32):"
            ),
            (
                "  device 3 holds [4:8, 4:8]: 1 of 16 elements differ; first at [5, 6]: got 46.0, "
                "expected -1.0"
            ),
            (
                "  device 6 holds [12:16, 0:4]: 1 of 16 elements differ; first at [13, 1]: got "
                "105.0, expected 7.5"
            ),
        ]
    )
    with pytest.raises(AssertionError) as e:
        assert_global_equal(g, y)
    assert str(e.value) == want
    assert_global_equal(g, torch.from_numpy(y), atol=200.0)  # tolerances for floats


def test_assert_global_equal_shape_dtype_nan(mesh42):
    g = ts.host_to_global_array(X, partition=ts.P("data"))
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "assert_global_equal: the global tensor has shape (16, 8), but expected has shape "
            "(8, 16)."
        ),
    ):
        assert_global_equal(g, X.reshape(8, 16))
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "assert_global_equal: the global tensor has dtype torch.float32, but expected has "
            "dtype torch.float64; cast expected to compare values."
        ),
    ):
        assert_global_equal(g, X.astype(np.float64))
    nan = X.copy()
    nan[3] = np.nan
    assert_global_equal(ts.host_to_global_array(nan, partition=ts.P("data")), nan)


def test_assert_global_equal_across_virtual_hosts(mesh42):
    blocks = [X[4 * h : 4 * (h + 1)] for h in range(4)]
    with virtual_hosts(4):
        g = host_to_global_array_per_host(blocks, partition=ts.P("data"))
        assert_sharded(g, ts.P("data"))
        assert_global_equal(g, X)
        with pytest.raises(AssertionError, match=re.escape("device 0 holds [0:4, 0:8]")):
            assert_global_equal(g, X[::-1].copy())


def test_a_big_endian_expected_array_is_compared_by_value(mesh8):
    """``assert_global_equal`` with a ``>f4`` expected array failed inside torch."""
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    g = ts.host_to_global_array(x, partition=ts.P("data"))
    assert_global_equal(g, x.astype(">f4"))
    with pytest.raises(AssertionError, match="differ from expected"):
        assert_global_equal(g, (x + 1).astype(">f4"))
