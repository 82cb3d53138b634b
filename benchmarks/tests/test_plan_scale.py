"""The plan-scale bench (benchmarks.plan_scale): its cases, every figure on small meshes, its
report (alone, and with an old checkout's figures: PLAN_SCALE_BEFORE), and the before/after table
against a source tree (this checkout, twice)."""

import pathlib

import pytest

from benchmarks import BENCHES, NEEDS_NO_XLA, plan_scale
from torchshard._tools.bench._report import Report

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_cases():
    assert BENCHES["plan_scale"] == "benchmarks.plan_scale"
    assert plan_scale.NAME in NEEDS_NO_XLA  # pure index maths: no device, no runtime
    assert plan_scale.DEVICES == (2, 8, 64, 512, 2048, 8192, 16384)
    assert plan_scale.QUICK_DEVICES == (8, 64)
    assert plan_scale.PER_HOST == 4


def test_every_figure_on_small_meshes():
    for devices in (2, 8, 64):
        figures = plan_scale.measure_devices(devices, rounds=1)
        assert list(figures) == list(plan_scale.METHODS)
        assert all(v > 0 for v in figures.values()), figures
        hosts = max(1, devices // 4)
        per_host = figures["virtual hosts: per host"] * hosts
        assert abs(per_host - figures["virtual hosts: first plan"]) < 1e-9
        assert figures["one host: peak"] >= figures["one host: kept"]


def test_run_records_each_method_per_device_count(quick):
    report = Report(progress=lambda msg: progress.append(msg))
    progress = []
    plan_scale.run(report)
    assert progress == ["plan_scale 8 devices", "plan_scale 64 devices"]
    assert [(f.case, f.method, f.unit) for f in report.figures] == [
        (f"{n} devices", m, u) for n in (8, 64) for m, u in plan_scale.METHODS.items()
    ]
    assert report.notes and report.notes[0].startswith("plan_scale: (4-device hosts)")


@pytest.mark.parametrize("devices", [8])
def test_the_before_after_table_runs_each_tree_in_a_fresh_interpreter(devices):
    table = plan_scale.compare_trees([str(ROOT), str(ROOT)], [devices])
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["devices", "method"]
    assert len(lines) == 1 + len(plan_scale.METHODS)
    assert all(line.startswith(f"{devices} ") for line in lines[1:])


def test_run_with_an_old_checkout_records_both_and_the_ratios(quick, monkeypatch):
    measured = []

    def child(tree, devices, quick=False):
        measured.append((tree, devices))
        scale = 2.0 if tree == "/old" else 1.0
        return {m: scale * (i + 1) for i, m in enumerate(plan_scale.METHODS)}

    monkeypatch.setattr(plan_scale, "_child", child)
    monkeypatch.setenv(plan_scale.BEFORE_ENV, "/old")
    report = Report()
    plan_scale.run(report)
    here = str(ROOT)
    assert measured == [("/old", 8), (here, 8), ("/old", 64), (here, 64)]  # alternately
    methods = [f"{m} (before)" for m in plan_scale.METHODS] + list(plan_scale.METHODS)
    assert [(f.case, f.method) for f in report.figures] == [
        (f"{n} devices", m) for n in (8, 64) for m in methods
    ]
    assert [(r.case, r.numerator, r.denominator, r.value) for r in report.ratios] == [
        (f"{n} devices", f"{m} (before)", m, 2.0) for n in (8, 64) for m in plan_scale.COMPARED
    ]
    assert report.notes[0].endswith("; before: /old")
