"""The demo (`python -m torchshard demo`) runs end to end in a subprocess."""

import os
import re
import subprocess
import sys

import pytest

FINAL = re.compile(
    r"^loss (\d+\.\d+) -> (\d+\.\d+) \(mean of the first and last steps\); (\d+\.\d) steps/s, "
    r"[\d,]+ examples/s after \d+\.\d s of compilation; input wait (\d+\.\d)% of step time$",
    re.M,
)


def demo(*args):
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "torchshard", "demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "hosts"), [(("--steps", "20"), 1), (("--steps", "12", "--hosts", "2"), 2)]
)
def test_demo_trains_and_the_loss_falls(args, hosts):
    run = demo(*args)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    per_host = 256 // hosts
    assert out.startswith(
        f"mesh {{'data': 4, 'model': 2}}, {hosts} host(s) x {2 // hosts} DataLoader worker(s) "
        f"(forkserver), global batch 256 ({per_host} per host), {args[1]} steps\n"
    )
    steps = re.findall(r"^step +(\d+)/\d+  loss (\d+\.\d+)", out, re.M)
    assert steps and steps[-1][0] == args[1]
    first, last, rate, wait = (float(x) for x in FINAL.search(out).groups())
    assert last < 0.95 * first and rate > 0 and 0 <= wait <= 100
    assert out.endswith("ok: the loss fell\n")


def test_demo_fails_when_the_loss_does_not_fall():
    run = demo("--steps", "8", "--lr", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED: the loss did not fall" in run.stderr
