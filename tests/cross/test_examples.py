"""The scripts under ``examples/`` run end to end in a subprocess and print what they promise."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xla  # every test here runs on torch_xla

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


def test_uneven_batch_prints_the_logical_ids():
    """4 examples per step over 8 devices: the step sees exactly the 4 logical rows."""
    out = run("uneven_batch.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout == (
        "logical batch 4 per host -> physical 8, sharded P(('data',),)\n"
        "step 0: physical rows 8, logical ids [0, 1, 2, 3], loss 36\n"
        "step 1: physical rows 8, logical ids [4, 5, 6, 7], loss 132\n"
        "step 2: physical rows 8, logical ids [8, 9, 10, 11], loss 228\n"
    )


def test_quickstart_round_trip():
    out = run("quickstart.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.endswith("round trip is bit-exact\n")
