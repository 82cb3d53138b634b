"""The bench report (torchshard._tools.bench._report): timing statistics, measurement, the
plain tables and the JSON (no timing asserted). The display is tested in test_display.py."""

from __future__ import annotations

import io
import json

import pytest

from torchshard._tools.bench._display import print_tables
from torchshard._tools.bench._report import (
    Report,
    Timing,
    compare,
    configure,
    measure,
    paired_ratio,
)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_timing_statistics():
    t = Timing((4.0, 1.0, 3.0, 2.0, 5.0), calls=1)
    assert (t.best, t.median, t.quartiles) == (1.0, 3.0, (2.0, 4.0))
    assert t.spread == pytest.approx(2.0 / 3.0)
    assert Timing((2.0,), calls=3).spread == 0.0


def test_paired_ratio_is_the_median_of_per_round_ratios():
    timings = {"a": Timing((1.0, 2.0, 4.0), 1), "b": Timing((3.0, 2.0, 12.0), 1)}
    assert paired_ratio(timings, "a", "b") == 3.0  # rounds: 3x, 1x, 3x


def test_measure_interleaves_and_counts_calls():
    calls = {"a": 0, "b": 0}

    def make(name):
        def fn():
            calls[name] += 1

        return fn

    timings = measure({"a": make("a"), "b": make("b")}, rounds=4, min_seconds=0.0, warmup=2)
    assert {k: len(t.samples) for k, t in timings.items()} == {"a": 4, "b": 4}
    assert calls == {"a": 2 + 3 + 4, "b": 2 + 3 + 4}  # warm-up, calibration, one per round
    secs = compare({"a": make("a")}, rounds=3, min_seconds=0.0, warmup=0)
    assert set(secs) == {"a"} and secs["a"] >= 0


def test_quick_cuts_every_measurement():
    n = 0

    def fn():
        nonlocal n
        n += 1

    configure(quick=True)
    try:
        assert Report().quick
        timings = measure({"f": fn}, rounds=15, warmup=3, min_seconds=1.0)
    finally:
        configure(quick=False)
    assert len(timings["f"].samples) == 3 and timings["f"].calls == 1
    assert n == 1 + 3 + 3
    assert not Report().quick


def _report():
    report = Report(meta={"machine": {"nproc": 2}})
    report.throughput("h2g", "case A", {"torchshard": Timing((0.5, 1.0, 1.0), 1)}, 10**9)
    report.figure("loader", "case B", "x", 12.5, "steps/s")
    report.ratio("h2g", "case A", "torchshard", "direct", 0.9, 0.95)
    report.ratio("h2g", "case A", "torchshard", "to+mark_sharding", 2.0, 1.5)
    report.notes.append("a note")
    return report


def test_plain_tables_and_json(tmp_path):
    report = _report()
    assert report.render().splitlines() == [
        "bench   case    method      value  median  spread  unit",
        "------  ------  ----------  -----  ------  ------  -------",
        "h2g     case A  torchshard  2      1       25%     GB/s",
        "loader  case B  x           12.5                   steps/s",
        "",
        "bench  case    ratio                          value   target",
        "-----  ------  -----------------------------  ------  --------------",
        "h2g    case A  torchshard / direct            0.900x  >= 0.95 MISSED",
        "h2g    case A  torchshard / to+mark_sharding  2.000x  >= 1.5 ok",
        "note: a note",
    ]
    report.write_json(str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["machine"] == {"nproc": 2}
    assert data["figures"][0] == {
        "bench": "h2g",
        "case": "case A",
        "method": "torchshard",
        "value": 2.0,
        "unit": "GB/s",
        "spread": 0.25,
        "median": 1.0,
    }
    assert [r["ok"] for r in data["ratios"]] == [False, True]
    out = io.StringIO()
    print_tables(report, file=out)  # not a terminal: plain
    assert out.getvalue() == report.render() + "\n"
