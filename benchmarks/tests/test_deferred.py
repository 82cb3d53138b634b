"""The deferred check's bench (benchmarks.deferred): its methods, its run wired to the report
with the workers stubbed, and one real quick run on 2 gloo processes."""

import pytest

from benchmarks import BENCHES, NEEDS_NO_XLA, deferred
from torchshard._tools.bench._report import Report


def test_the_methods():
    assert BENCHES["deferred"] == "benchmarks.deferred"
    assert deferred.NAME in NEEDS_NO_XLA
    assert deferred.METHODS == ("check deferred", "check in the call", "unchecked")
    assert (deferred.PROCESSES, deferred.RUN) == (2, 4)


def test_run_records_microseconds(monkeypatch):
    started = []

    def workers(module, processes, env=None):
        started.append((module, processes, env))
        return {"check deferred": 4e-4, "on the path, check deferred": 1e-5}

    monkeypatch.setattr(deferred, "run_gloo_workers", workers)
    report = Report()
    deferred.run(report)
    assert started == [("benchmarks.deferred", 2, {})]
    assert [(f.case, f.method, f.value, f.unit) for f in report.figures] == [
        ("8x[32,16] f32", "check deferred", pytest.approx(400.0), "us"),
        ("8x[32,16] f32", "on the path, check deferred", pytest.approx(10.0), "us"),
    ]


def test_a_quick_run_on_gloo_processes(capsys):
    """``python -m benchmarks deferred --quick --plain``, in this process (the workers are two
    fresh interpreters)."""
    from benchmarks import cli
    from torchshard._tools.bench import _report

    try:
        status = cli.main(["deferred", "--quick", "--plain"])
    finally:
        _report.configure(quick=False)
    done = capsys.readouterr()
    assert status == 0, done.err[-3000:]
    rows = [line.split() for line in done.out.splitlines() if line.startswith("deferred ")]
    methods = [" ".join(r[3:-2]) for r in rows]
    assert methods == [
        "check deferred",
        "check in the call",
        "unchecked",
        "on the path, check deferred",
        "call, check deferred",
        "on the path, check in the call",
        "call, check in the call",
    ]
    assert all(r[1:3] == ["8x[32,16]", "f32"] and r[-1] == "us" for r in rows)
