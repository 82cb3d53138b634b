"""The global -> host benchmark (benchmarks.g2h): global_to_host_array against
``.cpu()``, on h2g's cases; its run wired to the report, with the timing stubbed."""

import pytest

from benchmarks import BENCHES, g2h
from torchshard._tools.bench._report import Report

pytestmark = pytest.mark.xla


def test_run_records_every_case_and_the_ratio(quick, stub_measure):
    calls = stub_measure(g2h)
    report = Report(progress=lambda msg: progress.append(msg))
    progress = []
    g2h.run(report)
    cases = [f"{n}x[64,32] f32 {m}" for m in ("(8,)", "(4,2)") for n in (1, 8)]
    assert progress == [f"g2h {c}" for c in cases]
    assert [(f.case, f.method, f.unit) for f in report.figures] == [
        (c, m, "GB/s") for c in cases for m in ("torchshard", ".cpu()")
    ]
    assert [(r.case, r.numerator, r.denominator, r.target) for r in report.ratios] == [
        (c, "torchshard", ".cpu()", None) for c in cases
    ]
    assert len(calls["torchshard"]) == len(calls[".cpu()"]) == 2 * len(cases)
    assert BENCHES[g2h.NAME] == "benchmarks.g2h" and g2h.DESCRIPTION
