"""The DTensor benchmark (torchshard._tools.bench.dtensor): the gloo workers it starts (their
failure carries each rank's output), and its run wired to the report (figures in us/call, the
ratios to from_local), with the workers stubbed."""

import re

import pytest

from torchshard._tools.bench import NEEDS_NO_XLA, dtensor
from torchshard._tools.bench._report import Report

SECS = {
    "8x[32,16] f32": {
        "torchshard": 4e-4,
        "torchshard unchecked": 2e-4,
        "torchshard + value check": 8e-4,
        "from_local": 1e-4,
        "agreement check": 2e-4,
        "value check": 4e-4,
    }
}


def test_the_cases_and_that_it_needs_no_xla():
    assert dtensor.NAME in NEEDS_NO_XLA and dtensor.PROCESSES == 2
    assert list(dtensor.CASES) == ["8x[32,16] f32", "1x[1024,2048] f32", "8x[1024,2048] f32"]


@pytest.mark.parametrize("quick_mode", [False, True])
def test_run_records_microseconds_and_ratios(monkeypatch, request, quick_mode):
    if quick_mode:
        request.getfixturevalue("quick")
    started = []

    def workers(module, processes, env=None):
        started.append((module, processes, env))
        return SECS

    monkeypatch.setattr(dtensor, "run_gloo_workers", workers)
    report = Report()
    dtensor.run(report)
    env = {"TORCHSHARD_BENCH_QUICK": "1"} if quick_mode else {}
    assert started == [("torchshard._tools.bench.dtensor", 2, env)]
    figures = {f.method: (f.value, f.unit) for f in report.figures}
    assert figures["torchshard"] == (pytest.approx(400.0), "us/call")
    assert figures["agreement check"] == (pytest.approx(200.0), "us/call")
    assert [(r.numerator, r.denominator, r.value) for r in report.ratios] == [
        ("torchshard unchecked", "from_local", pytest.approx(0.5)),
        ("torchshard", "from_local", pytest.approx(0.25)),
    ]
    assert report.notes[-1].startswith("dtensor: agreement check = median of")


def test_failing_workers_raise_with_each_ranks_output():
    with pytest.raises(RuntimeError) as info:
        dtensor.run_gloo_workers("torchshard_no_such_bench_module", 2)
    text = str(info.value)
    assert text.startswith("torchshard_no_such_bench_module workers exited with [1, 1]\n")
    assert re.search(r"--- rank 0 ---\n.*No module named torchshard_no_such_bench_module", text)
    assert "--- rank 1 ---" in text
