"""The torchax backend's checks (torchshard._backend.torchax.checks) as pure functions of the
verdicts the processes' exchanges return: out-of-step calls, 64-bit values beyond 32 bits, and
a single process comparing nothing. The checks between real processes are in
test_backend_multiprocess.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchax_env import jax8, needs_torchax

import torchshard as ts
from torchshard._core.ranks import RankSet
from torchshard._core.verdict import Group, Verdict

pytestmark = needs_torchax


@pytest.fixture(scope="module")
def checks():
    jax8()
    from torchshard._backend.torchax import checks

    return checks


def _verdict(*groups):
    return Verdict(tuple(Group(RankSet.of(r), tuple(items)) for r, items in groups), 4)


def test_in_step_names_the_calls_of_processes_out_of_step(checks):
    v = _verdict(([0, 1, 2], ["host_to_global_array", "a"]), ([3], ["replicate_to_local_data"]))
    with pytest.raises(ts.errors.ProcessDisagreementError) as e:
        checks.in_step("host_to_global_array", v)
    text = str(e.value)
    assert text.startswith("host_to_global_array: the processes are out of step")
    assert "ranks 0-2: host_to_global_array; rank 3: replicate_to_local_data" in text


def test_in_step_drops_the_call_name_when_the_calls_agree(checks):
    v = _verdict(([0, 1], ["h2g", "a"]), ([2, 3], ["h2g", "b"]))
    out = checks.in_step("h2g", v)
    assert [g.items for g in out.groups] == [("a",), ("b",)]


def test_values_beyond_32_bits_are_marked_only_without_x64(checks):
    items = ["structure", "leaf 0 line", "leaf 1 line", "leaf 2 line"]
    leaves = [
        torch.arange(3),  # fits
        np.array([1, 2**33], np.int64),  # does not
        np.zeros(2, np.float32),  # not an integer leaf
    ]
    marked = checks.beyond_32_bits(leaves, items)
    assert marked == [1]
    assert items[1:] == [
        "leaf 0 line",
        "leaf 1 line, a value beyond int32 (8589934592)",
        "leaf 2 line",
    ]
    assert checks.beyond_32_bits([np.zeros(2, np.float32)], ["s", "l"]) is None


def test_the_error_of_a_value_beyond_32_bits_names_the_ranks_and_the_fix(checks):
    groups = _verdict(
        ([0, 2], ["s", "leaf 0 int64 (4,)"]),
        ([1], ["s", "leaf 0 int64 (4,), a value beyond int32 (4294967296)"]),
    ).groups
    err = checks.beyond_32_bits_error("host_to_global_array", groups, lambda i: f"x[{i}]")
    assert isinstance(err, ts.errors.ProcessDisagreementError)
    text = str(err)
    assert text.startswith("x[0]: host_to_global_array: a 64-bit integer leaf holds a value")
    assert "beyond int32 (4294967296) on rank 1" in text and "jax_enable_x64" in text
    # shapes differ as well: not this error (the general one names them)
    other = _verdict(
        ([0], ["s", "leaf 0 int64 (4,)"]),
        ([1], ["s", "leaf 0 int64 (2,), a value beyond int32 (4294967296)"]),
    ).groups
    assert checks.beyond_32_bits_error("h2g", other, str) is None


def test_one_process_compares_nothing(checks):
    mesh = ts.create_device_mesh((8,), ("data",), backend="torchax")
    c = checks.TorchaxChecks()
    assert not c.compares(mesh)
    assert c.exchange(mesh, ["a"]) is None
    assert c.open_channel(mesh, what="loader") is None


def test_describe_array_is_what_the_processes_compare(checks):
    mesh = ts.create_device_mesh((4, 2), ("data", "model"), backend="torchax")
    with mesh:
        g = ts.host_to_global_array(np.zeros((8, 2), np.float32), partition=ts.P("data"))
    assert checks.describe_array(g.jax()) == (
        "an array of global shape (8, 2), float32, spec P('data',) on mesh {'data': 4, 'model': 2}"
    )
