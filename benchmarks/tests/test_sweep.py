"""The sweep benchmark (benchmarks.sweep): its sizes and labels, and its run wired to
the report (every method measured at every size, the ratios to torchshard)."""

from __future__ import annotations

import pytest

from benchmarks import BENCHES, sweep
from benchmarks.sweep import SIZES, batch_shape, label_bytes, size_label
from torchshard._tools.bench._report import Report


def test_sweep_sizes():
    assert [size_label(n) for n in SIZES] == [
        "1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB",
    ]  # fmt: skip
    for n in SIZES:
        rows, cols = batch_shape(n)
        assert rows % 8 == 0 and rows * cols * 4 == n and label_bytes(size_label(n)) == n
    assert BENCHES["sweep"] == "benchmarks.sweep"


@pytest.mark.xla
def test_run_measures_every_method_at_every_quick_size(quick, stub_measure):
    calls = stub_measure(sweep)
    report = Report()
    sweep.run(report)
    assert [(f.case, f.method) for f in report.figures] == [
        (c, m) for c in ("1 KiB", "16 KiB") for m in sweep.METHODS
    ]
    assert [(r.case, r.denominator) for r in report.ratios] == [
        (c, d) for c in ("1 KiB", "16 KiB") for d in ("direct", "to+mark_sharding", "memcpy")
    ]
    assert len(calls["memcpy"]) == 4  # two sizes, two calls each


def test_size_labels_round_trip_and_refuse_other_units():
    assert sweep.size_label(1024) == "1 KiB" and sweep.size_label(3 * 2**20) == "3 MiB"
    assert sweep.label_bytes("16 KiB") == 16 * 1024
    with pytest.raises(KeyError):
        sweep.label_bytes("1 GiB")
    assert sweep.batch_shape(1024) == (8, 32)  # at least one row per device
