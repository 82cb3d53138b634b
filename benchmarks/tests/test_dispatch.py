"""The in-step dispatch benchmark (benchmarks.dispatch): the row-target key and the one-hot
matrix it builds agree, the three methods give the same logical rows (the bench checks it on
its first call), the run records ms/step, the dispatch bytes and the ratios, and its sizes
split evenly on any device count (no torch_xla needed for those)."""

import numpy as np
import pytest

from benchmarks import dispatch
from torchshard._tools.bench._report import Report


@pytest.mark.xla
@pytest.mark.parametrize(("physical", "logical"), [(256, 128), (64, 8)])
def test_keys_give_every_logical_row_once(physical, logical):
    rows, onehot = dispatch.keys(physical, logical)
    assert rows.shape == (physical,) and onehot.shape == (physical, logical)
    assert sorted(rows[rows >= 0].tolist()) == list(range(logical))
    assert (rows < 0).sum() == physical - logical  # padding rows
    for p in range(physical):
        expected = np.zeros(logical, bool)
        if rows[p] >= 0:
            expected[rows[p]] = True
        assert (onehot[p] == expected).all()


@pytest.mark.xla
def test_the_methods_agree_and_their_keys_have_the_bytes_they_move(mesh8):
    steps, nbytes = dispatch.methods(mesh8, 64)  # raises if a method gave other rows
    assert list(steps) == ["einsum", "index_select", "index_select(onehot)"]
    assert nbytes == {"einsum": 64 * 32, "index_select": 64 * 8, "index_select(onehot)": 64 * 32}
    out = steps["index_select"]()
    assert tuple(out.shape) == (32, dispatch.WIDTH)


@pytest.mark.xla
def test_run_records_times_bytes_ratios_and_a_note(monkeypatch, stub_measure):
    stub_measure(dispatch)
    steps = {m: (lambda: None) for m in ("einsum", "index_select", "index_select(onehot)")}
    sizes = {"einsum": 1000, "index_select": 100, "index_select(onehot)": 1000}
    seen = []
    monkeypatch.setattr(dispatch, "methods", lambda mesh, p: seen.append(p) or (steps, sizes))
    report = Report()
    dispatch.run(report)
    assert seen == [256, 1024]
    case = "P=1024 L=512 W=1024 f32 (8,)"
    assert ("dispatch", case, "einsum", 1.0, "ms/step") in [
        (f.bench, f.case, f.method, f.value, f.unit) for f in report.figures
    ]
    assert [(f.method, f.value) for f in report.figures if f.unit == "dispatch bytes"][:3] == [
        ("einsum", 1000),
        ("index_select", 100),
        ("index_select(onehot)", 1000),
    ]
    assert [(r.case, r.numerator, r.target) for r in report.ratios] == [
        ("P=256 L=128 W=1024 f32 (8,)", "index_select", None),
        ("P=256 L=128 W=1024 f32 (8,)", "index_select(onehot)", None),
        (case, "index_select", 2.0),
        (case, "index_select(onehot)", None),
    ]
    assert report.notes[-1] == (
        f"{case}: the one-hot key moves 1000 bytes per step, the row targets 100 (10x fewer)."
    )


@pytest.mark.parametrize("devices", [1, 3, 8, 512])
def test_every_size_splits_evenly(devices):
    physical = dispatch.physical_sizes(devices)
    assert sum(physical.values()) == 1  # one judged case (the larger)
    for p in physical:
        assert p % (2 * devices) == 0 and p % (2 * dispatch.FEEDS) == 0


def test_on_8_devices_the_documented_sizes():
    assert dispatch.physical_sizes(8) == {256: False, 1024: True}
    assert dispatch.physical_sizes(512) == {1024: True}  # both round to one case
