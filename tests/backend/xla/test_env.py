"""The CPU emulation set-up: environment for torch_xla's runtime, set before it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xla  # every test here runs on torch_xla

SHOW = (
    "import os; os.environ.pop('PJRT_DEVICE', None); os.environ.pop('CPU_NUM_DEVICES', None)\n"
    "from torchshard._backend.xla.env import setup_cpu_emulation\n"
    "assert setup_cpu_emulation(4, force=True)\n"
    "print(os.environ['PJRT_DEVICE'], os.environ['CPU_NUM_DEVICES'], os.environ['PJRT_NPROC'])\n"
)


def run(**env):
    full = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    full.pop("PYTHONWARNINGS", None)
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", SHOW], capture_output=True, text=True, env=full, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_xla_cpu_pool_gets_spare_threads():
    """Twice as many pool threads as devices, so that a collective step (one thread per
    device) never waits behind a host->device copy for the last thread."""
    assert run() == ["CPU", "4", "8"]


def test_a_pool_size_set_by_the_user_is_kept():
    assert run(PJRT_NPROC="5") == ["CPU", "4", "5"]
