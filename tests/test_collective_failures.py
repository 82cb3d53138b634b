"""Nothing hangs, nothing fails without saying where: processes that skip a call, leave a loader
loop early, die mid-call, enter a mesh alone, are out of step, or read back tensors made from
disagreeing shapes (real gloo processes, ``tests/_multiproc.py``).

Each case that leaves the processes out of step (or kills one) runs on a pool of its own whose
default group has a short timeout (``TIMEOUT``), closed afterwards; the others share the
session's pools.
"""

from __future__ import annotations

import contextlib

import pytest
from _multiproc import WorkerPool

import torchshard as ts

TIMEOUT = 3.0  # the workers' init_process_group(timeout=...)
SLACK = 8.0  # seconds allowed past it (a loaded machine)
CASES = "_collective_cases:"


@contextlib.contextmanager
def _pool(n: int = 2):
    pool = WorkerPool(n, timeout=120, collective_timeout=TIMEOUT)
    try:
        yield pool
    finally:
        pool.close()


def test_a_rank_that_skips_a_call_makes_the_others_fail_within_the_timeout():
    with _pool() as pool:
        r0, r1 = pool.run(CASES + "skip_call")
    assert r1["error"] == "skipped"
    assert r0["error"].startswith(
        "CollectiveError: host_arrays: torchshard's collective (call #"
    ), r0
    assert f"timed out after {TIMEOUT:g} s" in r0["error"]
    assert "ranks that did not answer: rank 1 (its last torchshard call: #" in r0["error"]
    assert " host_arrays)" in r0["error"]
    assert "The processes are now out of step" in r0["error"]
    assert r0["seconds"] < TIMEOUT + SLACK


def test_a_rank_that_leaves_a_loader_loop_early_names_the_batch_and_the_rank():
    with _pool() as pool:
        r0, r1 = pool.run(CASES + "loader_break")
    assert r1["error"] == "no error"
    assert r0["error"].startswith("CollectiveError: GlobalBatchLoader: batch 2: torchshard's"), r0
    assert "rank 1 (its last torchshard call: #" in r0["error"]
    assert "GlobalBatchLoader: batch 1)" in r0["error"]
    assert r0["seconds"] < TIMEOUT + SLACK


@pytest.mark.parametrize(
    ("call", "what"),
    [
        ("gather", "replicate_to_local_data"),
        ("redistribute", "maybe_shard: redistributing a tensor of shape (8, 2)"),
        ("agreement", "host_arrays"),
    ],
)
def test_a_peer_that_dies_mid_call_is_named(call, what):
    with _pool() as pool:
        r0, r1 = pool.run_some(CASES + "peer_dies_mid_call", call=call)
    assert r1 is None or "CollectiveError" in r1  # it died (or, slowed down, timed out first)
    assert r0["error"].startswith(f"CollectiveError: {what}"), r0
    assert "rank 1 (" in r0["error"]
    assert "Connection closed by peer" not in r0["error"].split(";")[1]
    assert r0["seconds"] < TIMEOUT + SLACK


def test_a_mesh_entered_on_one_rank_fails_within_the_timeout():
    with _pool() as pool:
        r0, r1 = pool.run(CASES + "mesh_on_one_rank")
    assert r1["error"] == "did not enter"
    assert r0["error"].startswith("CollectiveError: building the DeviceMesh of Mesh("), r0
    assert "(every process must enter it)" in r0["error"]
    assert "rank 1 (" in r0["error"]
    assert r0["seconds"] < TIMEOUT + SLACK


def test_processes_in_different_calls_with_alike_inputs_are_out_of_step(pools):
    """Before, a ``host_to_global_array`` on one rank and a loader batch of the same shapes on
    the other passed the check (their descriptions are alike). The processes stay in step."""
    results = pools(2).run(CASES + "out_of_step")
    for r in results:
        assert r["error"] == (
            "ProcessDisagreementError: host_arrays: the processes are out of step, each in "
            "another torchshard call (rank 0: host_arrays; rank 1: GlobalBatchLoader: batch 0)."
            " Every process must make the same torchshard calls in the same order (the same "
            "host_to_global_array calls, the same loader batches, the same read-backs)."
        ) or r["error"].startswith(
            "ProcessDisagreementError: GlobalBatchLoader: batch 0: the processes are out of step"
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


def test_collective_error_is_public_and_a_runtime_error():
    assert issubclass(ts.errors.CollectiveError, RuntimeError)


@pytest.mark.parametrize("kind", ["replicated", "loader"])
def test_the_value_check_names_replicas_that_differ(pools, kind):
    """Each rank passes its own values for a replicated leaf: before, every device silently
    held its own process's values; with the opt-in value check, every rank raises."""
    what = "host_arrays" if kind == "replicated" else "GlobalBatchLoader: batch 0"
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
        assert r["error"] == "no error"  # off by default: nothing is exchanged


def test_the_value_check_on_a_mesh_whose_processes_share_blocks(pools):
    for r in pools(4).run(CASES + "replica_values", kind="shared", check=True):
        assert (
            "the ranks [0, 1] hold the same block (global ranges ((0, 4), (0, 2))" in (r["error"])
        ), r
    for r in pools(4).run(CASES + "replica_values", kind="equal", check=True):
        assert r["error"] == "no error"
