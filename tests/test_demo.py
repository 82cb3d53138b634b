"""The demo (`python -m torchshard demo`) runs end to end in a subprocess."""

import os
import re
import subprocess
import sys

import pytest

FINAL = re.compile(
    r"^loss (\d+\.\d+) -> (\d+\.\d+) \(mean of the first and last steps\); (\d+\.\d) steps/s, "
    r"[\d,]+ examples/s after \d+\.\d s of (?:compilation|warm-up); input wait (\d+\.\d)% of "
    r"step time$",
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


@pytest.mark.xla
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


@pytest.mark.xla
def test_demo_fails_when_the_loss_does_not_fall():
    run = demo("--steps", "8", "--lr", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED: the loss did not fall" in run.stderr


def test_demo_without_torch_xla_trains_on_dtensor_gloo_processes():
    """A plain install (torch_xla hidden here): ``--backend auto`` picks dtensor; 2 gloo
    processes, each a host with its DataLoader worker; the same lines as on XLA."""
    run = demo("--steps", "12", devices=2, xla=False)
    assert run.returncode == 0, run.stdout + run.stderr
    # gloo's own "[Gloo] Rank r is connected to n peer ranks" lines, which the processes may
    # write into each other's (a line split after "[Gloo] Rank ").
    gloo = re.compile(r"\[Gloo\]|^\d+ is connected to \d+ peer ranks")
    lines = [line for line in run.stdout.splitlines() if not gloo.search(line)]
    out = "".join(line + "\n" for line in lines).lstrip("\n")
    assert out.startswith(
        "mesh {'data': 1, 'model': 2}, 2 gloo process(es) x 1 DataLoader worker(s) "
        "(forkserver), global batch 256 (128 per process), 12 steps\n"
    )
    steps = re.findall(r"^step +(\d+)/12  loss (\d+\.\d+) +(\S+)", out, re.M)
    assert [int(s) for s, _, _ in steps] == list(range(1, 13))  # every step: 12 // 10
    first, last, rate, wait = (float(x) for x in FINAL.search(out).groups())
    assert last < 0.95 * first and rate > 0 and 0 <= wait <= 100
    assert "s of warm-up" in out and out.endswith("ok: the loss fell\n")


def test_demo_on_dtensor_refuses_virtual_hosts_and_uneven_batches():
    for args in (
        ("--backend", "dtensor", "--hosts", "2"),
        ("--backend", "dtensor", "--batch", "9"),
    ):
        run = demo(*args, devices=2)
        assert run.returncode == 2, run.stdout + run.stderr
        assert run.stderr == (
            "demo: on dtensor every one of the --devices (2) gloo processes is a host: --hosts "
            f"({args[-1] if args[-2] == '--hosts' else 1}) must be 1 and --batch "
            f"({args[-1] if args[-2] == '--batch' else 256}) a multiple of the process count\n"
        )


def test_demo_on_xla_without_torch_xla_names_the_extra():
    run = demo("--backend", "xla", xla=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.startswith(
        "python -m torchshard demo: error: setup_cpu_emulation (emulated XLA devices) needs "
        "torch_xla, which is not installed; install the extra with `pip install "
        "'torchshard[xla]'`"
    )
