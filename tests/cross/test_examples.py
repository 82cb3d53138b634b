"""The scripts under ``examples/`` run end to end in a subprocess and print what they promise."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def run(script, *args):
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


@pytest.mark.xla
def test_uneven_batch_prints_the_logical_ids():
    """4 examples per step over 8 devices: the step sees exactly the 4 logical rows."""
    out = run("uneven_batch.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout == (
        "logical batch 4 per host -> physical 8, sharded P('data',)\n"
        "step 0: physical rows 8, logical ids [0, 1, 2, 3], loss 36\n"
        "step 1: physical rows 8, logical ids [4, 5, 6, 7], loss 132\n"
        "step 2: physical rows 8, logical ids [8, 9, 10, 11], loss 228\n"
    )


@pytest.mark.xla
def test_quickstart_round_trip():
    out = run("quickstart.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.endswith("round trip is bit-exact\n")


def test_train_dtensor_trains_ddp_on_two_gloo_processes():
    """The DTensor training example under torchrun (no emulated XLA devices), with warnings
    from torchshard's own modules as errors, as CI runs it (.ci/run, job 2)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PJRT_", "XLA_")) and k not in ("CPU_NUM_DEVICES", "PYTHONWARNINGS")
    }
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::Warning:torchshard",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "train_dtensor.py"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("2 processes, mesh {'data': 2}, 96 steps of 64 rows: loss "), line
    first, last = (float(v) for v in line.split("loss ")[1].split(";")[0].split(" -> "))
    assert last < 0.5 * first
    assert "of step time after each epoch's first batch" in line
