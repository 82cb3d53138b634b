"""The DTensor backend's checks across processes (torchshard._backend.dtensor.checks): the
agreement step's exchange (processes out of step), the size check before a gather and the opt-in
value check, on real gloo processes; the pure parts in this process."""

from __future__ import annotations

import hashlib
import re

import helpers
import pytest
import torch

import torchshard as ts
from torchshard._backend.dtensor import checks
from torchshard._core.verdict import Verdict

CASES = "_collective_cases:"


def test_in_step_drops_the_call_names_when_the_processes_agree():
    agreed = checks.in_step("host_arrays", Verdict.of([["host_arrays", "a"]] * 3))
    assert agreed.agreed and [g.items for g in agreed.groups] == [("a",)]
    every = [["host_arrays", "a", "b"], ["host_arrays", "a", "c"]]
    differ = checks.in_step("host_arrays", Verdict.of(every))
    assert differ.per_process() == [("a", "b"), ("a", "c")]


def test_in_step_names_each_calls_ranks_when_they_are_out_of_step():
    every = [["host_arrays", "x"], ["GlobalBatchLoader: batch 3", "x"], ["host_arrays", "x"]]
    with pytest.raises(
        ts.errors.ProcessDisagreementError,
        match="^"
        + re.escape(
            "host_arrays: the processes are out of step, each in another torchshard call "
            "(ranks 0, 2: host_arrays; rank 1: GlobalBatchLoader: batch 3). "
            "Every process must make the same torchshard calls in the same order (the same "
            "host_to_global_array calls, the same loader batches, the same read-backs)."
        )
        + "$",
    ):
        checks.in_step("host_arrays", Verdict.of(every))


def test_the_checksum_is_blake2b_of_the_bytes():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    want = hashlib.blake2b(t.numpy().tobytes(), digest_size=8).hexdigest()
    assert checks._checksum(t) == want and len(want) == 16
    assert checks._checksum(t.T) == checks._checksum(t.T.contiguous())  # row-major bytes
    assert checks._checksum(torch.zeros(0)) == hashlib.blake2b(b"", digest_size=8).hexdigest()


def test_the_checksum_compares_bit_patterns():
    assert checks._checksum(torch.tensor([0.0])) != checks._checksum(torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert checks._checksum(nan) == checks._checksum(nan.clone())
    assert checks._checksum(torch.ones(2, dtype=torch.bfloat16)) != checks._checksum(torch.ones(2))
    assert checks._checksum(torch.ones(2, requires_grad=True)) == checks._checksum(torch.ones(2))


def test_the_checksum_of_a_lazy_view_is_that_of_its_values():
    """Before: ``_checksum`` of ``x.conj()`` raised torch's "torch.Tensor.view is not
    supported for conjugate view tensors when converting to a different dtype"."""
    z = torch.tensor([1 + 2j, -0.0 - 3j])
    assert checks._checksum(z.conj()) == checks._checksum(z.conj().resolve_conj())
    assert checks._checksum(z.conj()) != checks._checksum(z)
    n = torch.tensor([1.0, -0.0])
    assert checks._checksum(torch._neg_view(n)) == checks._checksum(-n)


def test_a_conjugate_view_of_a_dtensor_reads_back_and_passes_the_value_check(pools):
    """``x.conj()`` of a complex DTensor: read back, gathered and resharded with its values;
    passed again to ``host_to_global_array`` with the value check on, it failed inside torch
    (the checksum viewed the lazy view's bytes)."""
    for rank, r in enumerate(pools(2).run("conj_views")):
        assert r["is_conj"] == (True, True)
        expected = r["expected"]
        assert torch.equal(r["back"], expected[2 * rank : 2 * rank + 2])
        assert torch.equal(r["again"], expected[2 * rank : 2 * rank + 2])
        assert torch.equal(r["full"], expected) and torch.equal(r["resharded"], expected)
        assert not any(r[k].is_conj() for k in ("back", "again", "full", "resharded"))


def test_processes_in_different_calls_with_alike_inputs_are_out_of_step(pools):
    """Before, a ``host_to_global_array`` on one rank and a loader batch of the same shapes on
    the other passed the check (their descriptions are alike). The processes stay in step."""
    results = pools(2).run(CASES + "out_of_step")
    for r in results:
        r["error"] = helpers.without_deferral_note(r["error"])  # torch >= 2.13: at first use
        assert r["error"] == (
            "ProcessDisagreementError: host_to_global_array: the processes are out of step, each "
            "in another torchshard call (rank 0: host_to_global_array; rank 1: GlobalBatchLoader: "
            "iter() from batch 0)."
            " Every process must make the same torchshard calls in the same order (the same "
            "host_to_global_array calls, the same loader batches, the same read-backs)."
        ) or r["error"].startswith(
            "ProcessDisagreementError: GlobalBatchLoader: iter() from batch 0: the processes are "
            "out of step"
        ), r
        assert r["after"] == (4, 4)


def test_reading_back_tensors_made_from_disagreeing_shapes_fails_before_the_gather(pools):
    """With the agreement check off, rank 0 made a (8, 2) DTensor and rank 1 a (6, 2) one:
    before, the gather aborted one process and gave the other uninitialised memory."""
    results = pools(2).run(CASES + "readback_of_disagreeing_shapes")
    for r in results:
        assert r["error"] == (
            "ProcessDisagreementError: x['x']: replicate_to_local_data: every process must "
            "gather the same tensor, but found a DTensor of global shape (8, 2), float32, "
            "placements [Shard(dim=0)] on ranks [0, 1] on rank(s) [0]; a DTensor of global "
            "shape (6, 2), float32, placements [Shard(dim=0)] on ranks [0, 1] on rank(s) [1]. "
            "The processes passed different shapes or dtypes when it was made (with the "
            "agreement check off, see set_agreement_check, or DTensor.from_local with a wrong "
            "shape); nothing was gathered."
        ), r
        assert r["after"] == 4


@pytest.mark.parametrize("kind", ["replicated", "loader"])
def test_the_value_check_names_replicas_that_differ(pools, kind):
    """Each rank passes its own values for a replicated leaf: before, every device silently
    held its own process's values; with the opt-in value check, every rank raises."""
    what = "host_to_global_array" if kind == "replicated" else "GlobalBatchLoader: batch 0"
    argname = "host_arrays" if kind == "replicated" else "batch"
    for r in pools(2).run(CASES + "replica_values", kind=kind, check=True):
        assert r["error"].startswith(
            f"ProcessDisagreementError: {argname}['w']: {what}: the ranks [0, 1] hold the same "
            "block (global ranges ((0, 4), (0, 2)), one (start, stop) per dimension) and must "
            "pass the same values, but found checksum "
        ), r
        assert "on rank(s) [0]; checksum " in r["error"]
        assert r["after"] == (4, 2)
    for r in pools(2).run(CASES + "replica_values", kind=kind, check=False):
        assert r["error"] == "no error"  # turned off: nothing is exchanged
    for r in pools(2).run(CASES + "replica_values", kind=kind, check=None):
        if kind == "loader":  # the default checks a loader's first batch of each epoch
            assert r["error"].startswith(f"ProcessDisagreementError: {argname}['w']: {what}: ")
        else:  # and not host_to_global_array's calls
            assert r["error"] == "no error", r


def test_the_value_check_on_a_mesh_whose_processes_share_blocks(pools):
    for r in pools(4).run(CASES + "replica_values", kind="shared", check=True):
        assert (
            "the ranks [0, 1] hold the same block (global ranges ((0, 4), (0, 2))" in (r["error"])
        ), r
    for r in pools(4).run(CASES + "replica_values", kind="equal", check=True):
        assert r["error"] == "no error"
