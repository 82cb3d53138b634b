"""``python -m benchmarks --plot`` (benchmarks._plot): a PNG of the sweep's figures, and the
errors before a run (matplotlib missing) and after one (no sweep figures)."""

import re
import sys

import pytest

from benchmarks import _plot
from torchshard._tools.bench._report import Report, Timing
from torchshard.errors import MissingDependencyError


def _sweep_report():
    report = Report(meta={"machine": {"nproc": 2, "cpu_model": "Test CPU"}})
    for size in ("1 KiB", "16 KiB"):
        timings = {m: Timing((0.001, 0.002, 0.004), 1) for m in ("torchshard", "direct", "memcpy")}
        report.throughput("sweep", size, timings, 1024)
    report.figure("h2g", "other", "torchshard", 1.0, "GB/s")  # not the sweep's: left out
    return report


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    _plot.plot_sweep(_sweep_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_without_sweep_figures_is_refused(tmp_path):
    pytest.importorskip("matplotlib")
    report = Report()
    report.figure("h2g", "case", "torchshard", 1.0, "GB/s")
    with pytest.raises(
        ValueError, match=re.escape("bench --plot: the report holds no sweep figures to plot.")
    ):
        _plot.plot_sweep(report, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_the_check_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    message = (
        "bench --plot needs matplotlib, which is not installed; install the optional extra with "
        "`pip install 'torchshard-input[plot]'` (from a checkout: `pip install -e '.[plot]'`), "
        "or `pip install matplotlib`."
    )
    with pytest.raises(MissingDependencyError, match=re.escape(message)):
        _plot.check_plot_available()
    with pytest.raises(MissingDependencyError, match=re.escape(message)):
        _plot.plot_sweep(_sweep_report(), "unused.png")


def test_every_sweep_method_has_a_style_and_a_label():
    from benchmarks.sweep import METHODS

    assert set(_plot._STYLE) == set(_plot._LABEL) == set(METHODS)
