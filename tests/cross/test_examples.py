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


def _torchrun(nproc, *args):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PJRT_", "XLA_")) and k not in ("CPU_NUM_DEVICES", "PYTHONWARNINGS")
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-W",
            "error::Warning:torchshard",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


def test_resume_stream_saves_on_two_gloo_processes_and_resumes_on_one(tmp_path):
    """A stream of 5 tar shards read by 2 processes, saved with torch.distributed.checkpoint
    after 3 global batches; 1 process resumes it: the unfinished shards split again, the
    examples read before and after are every example once (the script asserts it)."""
    script = EXAMPLES / "resume_stream.py"
    saved = _torchrun(2, script, "save", tmp_path)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert saved.stdout.strip().endswith("resume_stream: 2 processes read 12 examples, saved")
    resumed = _torchrun(1, script, "resume", tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.strip().endswith(
        "resume_stream: saved on 2 processes after 12 examples, resumed on 1: 31 examples, "
        "each once"
    )
