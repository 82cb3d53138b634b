"""The plan-scale bench (benchmarks.plan_scale): its cases, every figure on two small meshes,
its report, and the before/after table against a source tree (this checkout, twice)."""

import pathlib

import pytest

from benchmarks import BENCHES, NEEDS_NO_XLA, plan_scale
from torchshard._tools.bench._report import Report

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_cases():
    assert BENCHES["plan_scale"] == "benchmarks.plan_scale"
    assert plan_scale.NAME in NEEDS_NO_XLA  # pure index maths: no device, no runtime
    assert plan_scale.DEVICES == (8, 64, 512, 2048, 8192, 16384)
    assert plan_scale.QUICK_DEVICES == (8, 64)
    assert plan_scale.PER_HOST == 4


def test_every_figure_on_small_meshes():
    for devices in (8, 64):
        figures = plan_scale.measure_devices(devices, rounds=1)
        assert list(figures) == list(plan_scale.METHODS)
        assert all(v > 0 for v in figures.values()), figures


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
