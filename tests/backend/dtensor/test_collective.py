"""Nothing hangs, nothing fails without saying where: processes that skip a call, leave a loader
loop early, die mid-call, enter a mesh alone, are out of step, or read back tensors made from
disagreeing shapes (real gloo processes, ``tests/_multiproc.py``).

Each case that leaves the processes out of step (or kills one) runs on a pool of its own whose
default group has a short timeout (``TIMEOUT``), closed afterwards; the others share the
session's pools.
"""

from __future__ import annotations

import contextlib
import re

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
        "CollectiveError: host_to_global_array: torchshard's collective (call #"
    ), r0
    assert f"timed out after {TIMEOUT:g} s" in r0["error"]
    assert "ranks that did not answer: rank 1 (its last torchshard call: #" in r0["error"]
    assert " host_to_global_array)" in r0["error"]  # the API call, on both sides
    assert "The processes are now out of step" in r0["error"]
    assert r0["seconds"] < TIMEOUT + SLACK


_ENDED = (
    "rank 1 ended this GlobalBatchLoader epoch after taking 2 batch(es) (it left the loop, "
    "closed the loader or started another iter()), so it makes no more of its batches. Every "
    "process must take the same batches of an epoch: stop every process's loop at the same "
    "batch (e.g. the same number of steps), or give every process a source of the same length."
)


def test_a_rank_that_leaves_a_loader_loop_early_names_the_batch_and_the_rank():
    """Rank 1 takes batches 0 and 1 and closes its loader; rank 0 raises at the first batch
    rank 1's thread had not made (2 to 5: it makes up to two ahead, and one more whose exchange
    it began), at once: rank 1's close wrote that exchange's verdict (before, rank 0 waited for
    the group's timeout)."""
    with _pool() as pool:
        r0, r1 = pool.run(CASES + "loader_break")
    assert r1["error"] == "no error"
    assert re.fullmatch(
        r"CollectiveError: GlobalBatchLoader: batch [2-5]: " + re.escape(_ENDED), r0["error"]
    ), r0
    assert r0["batches"] == int(r0["error"].split("batch ")[1][0])  # it took those before
    assert r0["seconds"] < TIMEOUT


def test_exchanges_begun_one_ahead_of_their_ends_pair_and_leave_no_keys(pools):
    """A thread may begin its channel's next exchange before ending the current one (a loader's
    thread does, so that it makes its next batch while the others catch up): over 120 rounds at
    varying paces every verdict is the right one, the one disagreement names both ranks' items,
    and the channel's keys are deleted at its end (the store does not grow)."""
    r0, r1 = pools(2).run(CASES + "pipelined_exchanges")
    for r in (r0, r1):
        assert r["agreed"] == [k for k in range(120) if k != 57]
        assert r["differed"] == {57: [["exchange 57", "rank 0"], ["exchange 57", "rank 1"]]}
    assert r0["keys"] == r1["keys"] == 0, (r0["keys"], r1["keys"])


@pytest.mark.parametrize(
    ("call", "what"),
    [
        ("gather", "replicate_to_local_data"),
        ("redistribute", "maybe_shard: redistributing a tensor of shape (8, 2)"),
        ("agreement", "host_to_global_array"),
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


def test_collective_error_is_public_and_a_runtime_error():
    assert issubclass(ts.errors.CollectiveError, RuntimeError)


def test_the_same_calls_meet_whatever_their_threads_are_called(pools):
    """Calls are matched in program order on a stream, not by thread name (issue 32: a
    MainThread on one rank and a ``trainer`` thread on another timed out after 12 s)."""
    for rank, r in enumerate(pools(2).run(CASES + "threads_meet")):
        for what in ("named", "default", "loader"):
            assert r[what]["error"] == "no error", (rank, what, r[what])
        for name in ("eval", "train"):
            assert r["streams"][name]["error"] == "no error", (rank, r["streams"])
        assert r["held"] == "agreed"
        if rank == 0:
            assert r["second"]["error"].startswith(
                "CollectiveError: host_to_global_array: thread 'second' began torchshard call #"
            ), r["second"]
            assert "while thread 'holder' has one under way there" in r["second"]["error"]
            assert "torchshard.call_stream('eval')" in r["second"]["error"]
