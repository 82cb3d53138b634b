"""The bench machinery in process: timing statistics, tables, progress (no timing asserted)."""

from __future__ import annotations

import io
import json

import pytest

from torchshard._tools.bench import BENCHES
from torchshard._tools.bench._display import Progress, print_tables
from torchshard._tools.bench._report import (
    Report,
    Timing,
    compare,
    configure,
    measure,
    paired_ratio,
)
from torchshard._tools.bench.sweep import SIZES, batch_shape, label_bytes, size_label


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


def test_rich_tables_on_a_terminal():
    out = _Terminal()
    print_tables(_report(), file=out)
    text = out.getvalue()
    for cell in ("torchshard / direct", "MISSED", "steps/s", "note: a note", "spread"):
        assert cell in text
    plain = _Terminal()
    print_tables(_report(), file=plain, plain=True)
    assert plain.getvalue() == _report().render() + "\n"


def test_plain_progress_lines():
    out = io.StringIO()
    with Progress(2, stream=out) as p:
        p.start("h2g")
        p.message("h2g case 1")
        p.advance()
        p.start("g2h")
        p.advance()
    lines = [line.split("s  ", 1) for line in out.getvalue().splitlines()]
    assert [(head[:9], tail) for head, tail in lines] == [
        ("[..] 0/2 ", "h2g: starting"),
        ("[..] 0/2 ", "h2g case 1"),
        ("[#.] 1/2 ", "h2g: done"),
        ("[#.] 1/2 ", "g2h: starting"),
        ("[##] 2/2 ", "g2h: done"),
    ]


def test_rich_progress_on_a_terminal():
    out = _Terminal()
    with Progress(1, stream=out) as p:
        p.start("sweep")
        p.message("sweep 1 KiB per host")
        p.advance()
    assert "1/1" in out.getvalue()


def test_sweep_sizes():
    assert [size_label(n) for n in SIZES] == [
        "1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB",
    ]  # fmt: skip
    for n in SIZES:
        rows, cols = batch_shape(n)
        assert rows % 8 == 0 and rows * cols * 4 == n and label_bytes(size_label(n)) == n
    assert BENCHES["sweep"] == "torchshard._tools.bench.sweep"
