"""A direct host_to_global_array's agreement check judged off the step's path
(torchshard._backend.dtensor.deferred), on real gloo processes: where a disagreement comes out
(the result's first use, the next call, leaving the mesh, interpreter exit) on a torch that can
make a first use wait (>= 2.13), in the call on one that cannot (2.9), with today's words and
the call it belongs to; the switches; a skipped call still bounded by the timeout."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from _multiproc import WorkerPool

from torchshard._backend.dtensor._torch_private import first_use_wait

CASES = "_deferred_cases:"
DEFERS = first_use_wait()  # the workers run this interpreter's torch
MESSAGE = (
    "ProcessDisagreementError: host_arrays['x']: every process must pass the same shape and "
    "dtype for a leaf (the global shape is inferred from them); expected (4, 3) float32 (as on "
    "process 0), got (2, 3) float32 on process(es) [1]. Make every process's input yield the "
    "same shapes and dtypes (pad or drop a short last batch, or use "
    "torchshard.InputDispatcher)."
)
WHERE = {
    "use": "at the first use of its result",
    "next": "at the next torchshard call on its stream (host_to_global_array)",
    "exit": "on leaving the mesh",
    "interpreter": "at interpreter exit",
}


def _note(where: str) -> str:
    return (
        f" (Raised {where}: the agreement check of host_to_global_array call #N on stream "
        "'main', judged off the step's path; torchshard.set_agreement_deferred(False) judges "
        "it in the call.)"
    )


@pytest.mark.parametrize("at", ["use", "next", "exit", "interpreter"])
def test_a_disagreement_comes_out_at_the_first_use_the_next_call_or_the_exit(pools, at):
    results = pools(2).run(CASES + "disagree_then", at=at)
    calls = set()
    for r in results:
        assert r["returned"] is DEFERS, r
        if DEFERS:
            number = re.search(r"call #(\d+) on stream", r["error"])
            assert number is not None, r["error"]
            calls.add(number.group(1))
            assert r["error"] == MESSAGE + _note(WHERE[at]).replace("#N", f"#{number.group(1)}")
            assert r["local_type"] == "AsyncCollectiveTensor"  # until judged
            assert r["local_type_after"] == "Tensor"  # judged: the plain block again
        else:  # torch 2.9: in the call, today's words
            assert r["error"] == MESSAGE
        # Still in step: the next call and a gather work on every rank.
        assert torch.equal(r["after"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))
    assert len(calls) <= 1  # both ranks name the same call


def test_the_switches_judge_in_the_call_or_not_at_all(pools):
    for r in pools(2).run(CASES + "switched", how="sync"):
        assert r == {"returned": False, "error": MESSAGE}
    for r in pools(2).run(CASES + "switched", how="off"):
        assert r == {"returned": True, "error": "no error", "local_type": "Tensor", "sum": 24.0}


TIMEOUT = 3.0


def test_a_skipped_call_fails_the_first_use_within_the_timeout():
    pool = WorkerPool(2, timeout=120, collective_timeout=TIMEOUT)
    with contextlib.closing(pool):
        r0, r1 = pool.run(CASES + "skipped_then_used")
    assert r1["error"] == "skipped"
    assert r0["error"].startswith(
        "CollectiveError: host_to_global_array: torchshard's collective (call #"
    ), r0
    assert f"timed out after {TIMEOUT:g} s" in r0["error"]
    assert "ranks that did not answer: rank 1 (its last torchshard call: #" in r0["error"]
    assert r0["error"].endswith(_note(WHERE["use"]).split("#N")[1]) is DEFERS, r0
    assert r0["seconds"] < TIMEOUT + 8.0
