"""The DTensor dispatch benchmark (benchmarks.dtensor_dispatch): its cases, and its
run on 2 then 4 processes wired to the report, with the workers stubbed."""

import pytest

from benchmarks import NEEDS_NO_XLA, dtensor_dispatch
from torchshard._tools.bench._report import Report


def test_the_cases():
    assert dtensor_dispatch.NAME in NEEDS_NO_XLA
    assert dtensor_dispatch.CASES == {
        "P=256 L=128": (256, 128),
        "P=256 L=32": (256, 32),
        "P=1024 L=512": (1024, 512),
        "P=1024 L=128": (1024, 128),
    }
    assert dtensor_dispatch.PROCESSES == (2, 4)


def test_run_records_each_process_count(monkeypatch):
    started = []

    def workers(module, processes, env=None):
        started.append((module, processes))
        return {"P=256 L=128": {"torchshard": 1e-3, "DTensor index_select": 3e-3}}

    monkeypatch.setattr(dtensor_dispatch, "run_gloo_workers", workers)
    report = Report()
    dtensor_dispatch.run(report)
    module = "benchmarks.dtensor_dispatch"
    assert started == [(module, 2), (module, 4)]
    assert [(f.case, f.method, f.value) for f in report.figures] == [
        (f"{n} processes, P=256 L=128", m, pytest.approx(v))
        for n in (2, 4)
        for m, v in (("torchshard", 1000.0), ("DTensor index_select", 3000.0))
    ]
    assert [(r.case, r.value) for r in report.ratios] == [
        (f"{n} processes, P=256 L=128", pytest.approx(3.0)) for n in (2, 4)
    ]
    assert report.notes == [
        (
            "dtensor_dispatch: [P, 1024] float32 over gloo on loopback; all-gather bytes per rank "
            "(n-1)/n*P*W*4, the reduce-scatter's (n-1)/n*L*W*4"
        )
    ]
