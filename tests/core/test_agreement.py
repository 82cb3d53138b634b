"""The cross-process agreement check's pure parts: descriptions, hashes, error messages.

The collective itself runs on real processes in ``tests/backend/dtensor/test_backend.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._core import agreement
from torchshard._core.agreement import describe, digest, disagreement, with_mesh
from torchshard._core.tree import LazyPaths, flatten
from torchshard._core.verdict import Verdict


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
    err = disagreement("host_arrays", Verdict.of([ref, odd, ref, odd]).groups, where)
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
    err = disagreement("host_arrays", Verdict.of([a, b]).groups, lambda i: f"leaf {i}")
    assert str(err) == (
        "host_arrays: every process must pass the same tree structure and partition; expected "
        "structure PyTreeSpec({'x': *}), partition P('data',) (as on process 0), got structure "
        "PyTreeSpec({'x': *, 'z': *}), partition P('data',) on process(es) [1]."
    )


def test_set_agreement_check_rejects_non_bools():
    msg = "set_agreement_check: expected a bool, but got 1."
    with pytest.raises(TypeError, match=re.escape(msg)):
        ts.set_agreement_check(1)


# -- the environment switches: every spelling of off is off, anything else is refused --


@pytest.mark.parametrize("raw", ["0", "false", "no", "off", "disabled", " NO ", "Disabled", ""])
def test_every_spelling_of_off_turns_the_checks_off(raw, monkeypatch):
    """``TORCHSHARD_AGREEMENT_CHECK=no`` and ``TORCHSHARD_VALUE_CHECK=disabled`` were read as
    on, without a word."""
    monkeypatch.setenv(agreement.ENV_VAR, raw)
    monkeypatch.setenv(agreement.VALUES_ENV_VAR, raw)
    state = agreement._State()
    assert state.enabled is False and state.values is False


@pytest.mark.parametrize("raw", ["1", "true", "yes", "on", "enabled", " On "])
def test_every_spelling_of_on_turns_the_checks_on(raw, monkeypatch):
    monkeypatch.setenv(agreement.ENV_VAR, raw)
    monkeypatch.setenv(agreement.VALUES_ENV_VAR, raw)
    state = agreement._State()
    assert state.enabled is True and state.values is True


def test_an_unknown_switch_value_is_refused(monkeypatch):
    monkeypatch.delenv(agreement.ENV_VAR, raising=False)
    monkeypatch.setenv(agreement.VALUES_ENV_VAR, "nope")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "environment variable TORCHSHARD_VALUE_CHECK='nope': expected one of 1, true, yes, "
            "on, enabled (on) or 0, false, no, off, disabled (off), but got 'nope'. Set "
            "TORCHSHARD_VALUE_CHECK=0 to turn the check off or TORCHSHARD_VALUE_CHECK=1 to "
            "turn it on."
        ),
    ):
        agreement._State()
    monkeypatch.delenv(agreement.VALUES_ENV_VAR)
    state = agreement._State()  # unset: the defaults (values: each loader epoch's first batch)
    assert state.enabled is True and state.values is None


def test_processes_on_meshes_with_the_axes_in_another_order_disagree():
    """The DTensor backend adds the mesh to the structure line: ranks whose meshes differ
    (axes in another order) passed the check and placed the same spec differently."""
    a = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"), backend="dtensor")
    b = ts.Mesh(np.arange(8).reshape(2, 4), ("model", "data"), backend="dtensor")
    items = _describe({"x": np.zeros((8, 2), np.float32)}, ts.P("data"))
    mine, other = with_mesh(items, a), with_mesh(items, b)
    assert mine != other and mine[1:] == items[1:]
    assert digest(mine) != digest(other)
    err = disagreement("host_arrays", Verdict.of([mine, other]).groups, lambda i: f"leaf {i}")
    assert str(err) == (
        "host_arrays: every process must place on the same mesh (axis names in the same order, "
        "the same sizes and devices); expected mesh {'data': 4, 'model': 2} of devices "
        "[[0, 1], [2, 3], [4, 5], [6, 7]] (as on process 0), got mesh {'model': 2, 'data': 4} "
        "of devices [[0, 1, 2, 3], [4, 5, 6, 7]] on process(es) [1]. Build the mesh alike on "
        "every process (e.g. init_device_mesh(..., mesh_dim_names=...) with the same names in "
        "the same order)."
    )
    assert with_mesh(items, a) == with_mesh(items, a)  # the same mesh: nothing differs


def test_a_structure_disagreement_on_one_mesh_does_not_show_the_mesh():
    mesh = ts.Mesh(np.arange(2), ("data",), backend="dtensor")
    a = with_mesh(_describe({"x": np.zeros(4)}, ts.P("data")), mesh)
    b = with_mesh(_describe({"x": np.zeros(4), "y": np.zeros(4)}, ts.P("data")), mesh)
    err = str(disagreement("host_arrays", Verdict.of([a, b]).groups, lambda i: f"leaf {i}"))
    assert err.startswith("host_arrays: every process must pass the same tree structure")
    assert "mesh" not in err


def test_deferral_by_default_from_64_processes_and_forced_either_way():
    old = ts.set_agreement_deferred(None)
    try:
        assert not agreement.agreement_deferred(2)
        assert not agreement.agreement_deferred(agreement.DEFER_FROM - 1)
        assert agreement.agreement_deferred(agreement.DEFER_FROM)
        assert ts.set_agreement_deferred(True) is None
        assert agreement.agreement_deferred(2)
        ts.set_agreement_deferred(False)
        assert not agreement.agreement_deferred(8192)
        with pytest.raises(TypeError, match=re.escape("expected True, False or None")):
            ts.set_agreement_deferred("yes")  # type: ignore[arg-type]
    finally:
        ts.set_agreement_deferred(old)
