"""The h2d benchmark (torchshard._tools.bench.h2d): DTensor host -> accelerator copies; without
an accelerator it says so in one line and measures nothing."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
def test_bench_h2d_without_an_accelerator_says_so_in_one_line():
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "torchshard", "bench", "h2d", "--quick", "--plain"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert (
        "note: h2d: no accelerator (torch.accelerator.is_available() is False); nothing measured."
        in lines
    )
    assert all(line.startswith("note: ") for line in lines), lines  # notes only: no figures


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
def test_without_an_accelerator_the_run_adds_one_note_in_process():
    from torchshard._tools.bench import h2d
    from torchshard._tools.bench._report import Report

    assert h2d.accelerator() is None
    report = Report()
    h2d.run(report)
    assert report.figures == [] and report.ratios == []
    assert report.notes == [
        "h2d: no accelerator (torch.accelerator.is_available() is False); nothing measured."
    ]


def test_the_batch_sizes():
    from torchshard._tools.bench import NEEDS_NO_XLA, h2d

    assert "h2d" in NEEDS_NO_XLA
    assert (h2d.SIZE, h2d.QUICK_SIZE) == (64 * 2**20, 4 * 2**20)
    assert (h2d.STEPS, h2d.QUICK_STEPS, h2d.WAIT_TARGET) == (40, 8, 0.01)
