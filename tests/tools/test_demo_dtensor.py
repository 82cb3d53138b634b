"""The DTensor demo (torchshard._tools.demo_dtensor): the demo's training loop on gloo processes,
end to end in a subprocess with torch_xla hidden; its mesh shape and settings."""

import dataclasses
import os
import pickle
import re
import subprocess
import sys

import pytest

from torchshard._tools import demo_dtensor

FINAL = re.compile(
    r"^loss (\d+\.\d+) -> (\d+\.\d+) \(mean of the first and last steps\); (\d+\.\d) steps/s, "
    r"[\d,]+ examples/s after \d+\.\d s of (?:compilation|warm-up); input wait (\d+\.\d)% of "
    r"step time after each epoch's first batch \(loader\.stats; \d+\.\d s waited for those: the "
    r"DataLoader workers' start\)$",
    re.M,
)
# Runs the command line with torch_xla hidden, as on a plain install (no torch_xla).
NO_XLA = (
    "import sys; sys.modules['torch_xla'] = None; from torchshard._tools.cli import main; "
    "raise SystemExit(main(sys.argv[1:]))"
)


def demo(*args, devices=None, xla=True):
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    start = ["-m", "torchshard"] if xla else ["-c", NO_XLA]
    top = [] if devices is None else ["--devices", str(devices)]
    return subprocess.run(
        [sys.executable, *start, *top, "demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


def test_demo_without_torch_xla_trains_on_dtensor_gloo_processes():
    """A plain install (torch_xla hidden here): ``--backend auto`` picks dtensor; 2 gloo
    processes, each a host with its DataLoader worker; the same lines as on XLA."""
    run = demo("--steps", "100", devices=2, xla=False)
    assert run.returncode == 0, run.stdout + run.stderr
    # gloo's own "[Gloo] Rank r is connected to n peer ranks. Expected number of connected
    # peer ranks is : n" lines, which the processes may write into each other's (split anywhere).
    gloo = re.compile(r"\[Gloo\]|peer ranks")
    lines = [line for line in run.stdout.splitlines() if not gloo.search(line)]
    out = "".join(line + "\n" for line in lines).lstrip("\n")
    assert out.startswith(
        "mesh {'data': 1, 'model': 2}, 2 gloo process(es) x 1 DataLoader worker(s) "
        "(forkserver), global batch 256 (128 per process), 100 steps\n"
    )
    steps = re.findall(r"^step +(\d+)/100  loss (\d+\.\d+) +(\S+)", out, re.M)
    assert [int(s) for s, _, _ in steps] == list(range(10, 101, 10))  # every 100 // 10
    first, last, rate, wait = (float(x) for x in FINAL.search(out).groups())
    assert last < 0.95 * first and rate > 0 and 0 <= wait <= 100
    assert "s of warm-up" in out and out.endswith("ok: the loss fell\n")


@pytest.mark.parametrize(
    ("processes", "shape"), [(1, (1, 1)), (2, (1, 2)), (3, (3, 1)), (8, (4, 2))]
)
def test_mesh_shape(processes, shape):
    assert demo_dtensor.mesh_shape(processes) == shape


def test_settings_are_a_frozen_picklable_value():
    s = demo_dtensor.Settings(processes=2, steps=12, batch_size=256, workers=1, lr=3e-3, seed=0)
    assert pickle.loads(pickle.dumps(s)) == s  # every spawned process gets it
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps = 1
    assert demo_dtensor.COLLECTIVE_TIMEOUT.total_seconds() == 120
