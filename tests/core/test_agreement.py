"""The cross-process agreement check's pure parts: descriptions, hashes, error messages.

The collective itself runs on real processes in ``tests/backend/dtensor/test_backend.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._core.agreement import describe, digest, disagreement
from torchshard._core.tree import LazyPaths, flatten


def _describe(tree, partition=None):
    leaves, treespec = flatten(tree)
    return describe(treespec, leaves, partition)


def test_numpy_and_torch_leaves_of_one_shape_and_dtype_describe_alike():
    a = _describe({"x": np.zeros((4, 3), np.float32), "y": np.zeros(4, np.bool_)})
    b = _describe({"x": torch.zeros(4, 3), "y": torch.zeros(4, dtype=torch.bool)})
    assert (
        a
        == b
        == [
            "structure PyTreeSpec({'x': *, 'y': *}), partition None",
            "(4, 3) float32",
            "(4,) bool",
        ]
    )
    assert digest(a) == digest(b)


@pytest.mark.parametrize(
    "other",
    [
        {"x": torch.zeros(5, 3), "y": torch.zeros(4, dtype=torch.bool)},
        {"x": torch.zeros(4, 3, dtype=torch.float64), "y": torch.zeros(4, dtype=torch.bool)},
        {"x": torch.zeros(4, 3), "y": torch.zeros(4, dtype=torch.bool), "z": torch.zeros(1)},
    ],
)
def test_any_difference_changes_the_hash(other):
    ref = _describe({"x": torch.zeros(4, 3), "y": torch.zeros(4, dtype=torch.bool)})
    assert digest(_describe(other)) != digest(ref)
    assert digest(_describe(other, ts.P("data"))) != digest(_describe(other))


def test_digest_is_a_signed_int64_and_separates_items():
    d = digest(["ab", "c"])
    assert -(2**63) <= d < 2**63
    assert d == digest(["ab", "c"])
    assert d != digest(["a", "bc"])


def test_the_error_names_the_first_leaf_that_differs_and_the_processes():
    tree = {"x": torch.zeros(4, 3), "y": [torch.zeros(4), torch.zeros(4)]}
    leaves, treespec = flatten(tree)
    ref = describe(treespec, leaves, None)
    odd = list(ref)
    odd[3] = "(3,) float32"
    where = LazyPaths(treespec, "host_arrays").__getitem__
    err = disagreement("host_arrays", [ref, odd, ref, odd], where)
    assert isinstance(err, ts.errors.ProcessDisagreementError)
    assert isinstance(err, ValueError)
    assert str(err) == (
        "host_arrays['y'][1]: every process must pass the same shape and dtype for a leaf (the "
        "global shape is inferred from them); expected (4,) float32 (as on process 0), got "
        "(3,) float32 on process(es) [1, 3]. Make every process's input yield the same shapes "
        "and dtypes (pad or drop a short last batch, or use torchshard.InputDispatcher)."
    )


def test_a_structure_difference_is_reported_first():
    a = _describe({"x": torch.zeros(2)}, ts.P("data"))
    b = _describe({"x": torch.zeros(2), "z": torch.zeros(2)}, ts.P("data"))
    err = disagreement("host_arrays", [a, b], lambda i: f"leaf {i}")
    assert str(err) == (
        "host_arrays: every process must pass the same tree structure and partition; expected "
        "structure PyTreeSpec({'x': *}), partition P('data',) (as on process 0), got structure "
        "PyTreeSpec({'x': *, 'z': *}), partition P('data',) on process(es) [1]."
    )


def test_set_agreement_check_rejects_non_bools():
    msg = "set_agreement_check: expected a bool, but got 1."
    with pytest.raises(TypeError, match=re.escape(msg)):
        ts.set_agreement_check(1)
