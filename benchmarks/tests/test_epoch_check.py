"""The first-batch value check's bench (benchmarks.epoch_check): its cases, its
run wired to the report with the workers stubbed, and one real quick run on 2 gloo processes."""

import pytest

from benchmarks import BENCHES, NEEDS_NO_XLA, epoch_check
from torchshard._tools.bench._report import Report


def test_the_cases():
    assert BENCHES["epoch_check"] == "benchmarks.epoch_check"
    assert epoch_check.NAME in NEEDS_NO_XLA
    assert epoch_check.CASES == {
        "[32,16] f32": (32, 16),
        "[256,1024] f32": (256, 1024),
        "[1024,4096] f32": (1024, 4096),
    }
    assert (epoch_check.PROCESSES, epoch_check.BATCHES) == (2, 2)


def test_run_records_milliseconds_per_epoch(monkeypatch):
    started = []

    def workers(module, processes, env=None):
        started.append((module, processes, env))
        return {"[32,16] f32": {"default (first batch checked)": 2e-3, "first-batch check": 5e-4}}

    monkeypatch.setattr(epoch_check, "run_gloo_workers", workers)
    report = Report()
    epoch_check.run(report)
    assert started == [("benchmarks.epoch_check", 2, {})]
    assert [(f.case, f.method, f.value, f.unit) for f in report.figures] == [
        ("[32,16] f32", "default (first batch checked)", pytest.approx(2.0), "ms/epoch"),
        ("[32,16] f32", "first-batch check", pytest.approx(0.5), "ms/epoch"),
    ]
    assert report.notes == [
        (
            "epoch_check: epochs of 2 batches per process (2 processes over gloo on loopback, "
            "prefetch=0); first-batch check = median of (default - off) per sample"
        )
    ]


def test_a_quick_run_on_gloo_processes(capsys):
    """``python -m benchmarks epoch_check --quick --plain``, in this process (the command's code
    path without a third interpreter; the workers are two fresh ones)."""
    from benchmarks import cli
    from torchshard._tools.bench import _report

    try:
        status = cli.main(["epoch_check", "--quick", "--plain"])
    finally:
        _report.configure(quick=False)
    done = capsys.readouterr()
    assert status == 0, done.err[-3000:]
    rows = [line.split() for line in done.out.splitlines() if line.startswith("epoch_check ")]
    methods = [" ".join(r[3:-2]) for r in rows]
    assert methods == ["default (first batch checked)", "value check off", "first-batch check"]
    assert all(r[1:3] == ["[32,16]", "f32"] and r[-1] == "ms/epoch" for r in rows)
