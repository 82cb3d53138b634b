"""The demo (torchshard._tools.demo, `python -m torchshard demo`): it runs end to end in a
subprocess; in this process, its argument checks, the backend it picks and what it prints,
with the training stubbed. The DTensor demo is tested in test_demo_dtensor.py."""

import os
import re
import subprocess
import sys
import types

import pytest

from torchshard._tools import demo as demo_module
from torchshard._tools._demo_common import Result

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


def refused(capsys, *args, devices=None):
    """``demo`` with arguments it refuses before any device starts, run in this process (the
    checks are the command line's own; test_cli.py runs the real entry point in a subprocess):
    ``(status, stdout, stderr)``."""
    from torchshard._tools import cli

    top = [] if devices is None else ["--devices", str(devices)]
    try:
        status = cli.main([*top, "demo", *args])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out, err)


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
    ("args", "hosts"), [(("--steps", "100"), 1), (("--steps", "100", "--hosts", "2"), 2)]
)
def test_demo_trains_and_the_loss_falls(args, hosts):
    """100 steps: the fewest the demo judges (``MIN_JUDGED_STEPS``)."""
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
@pytest.mark.parametrize(
    ("devices", "hosts", "mesh", "steps"), [(1, 1, (1, 1), 12), (3, 3, (3, 1), 2)]
)
def test_demo_trains_on_any_device_count(devices, hosts, mesh, steps):
    """``--devices N`` builds the mesh from N ((N / 2, 2), or (N, 1) for odd N) and rounds
    the default batch up to a multiple of N: on 1 and 3 devices it ended in a traceback (a
    (4, 2) mesh on a runtime of N devices). So few steps are not judged: ``--devices 3 --steps
    2`` reported "FAILED: the loss did not fall" (exit 1) from two losses that say nothing."""
    run = demo("--steps", str(steps), "--hosts", str(hosts), "--workers", "0", devices=devices)
    assert run.returncode == 0, run.stdout + run.stderr
    batch = demo_module.default_batch(devices)
    assert batch == {1: 256, 3: 258}[devices]
    assert run.stdout.startswith(
        f"mesh {{'data': {mesh[0]}, 'model': {mesh[1]}}}, {hosts} host(s) x 0 DataLoader "
        f"worker(s), global batch {batch} ({batch // hosts} per host), {steps} steps\n"
    )
    assert run.stdout.endswith(
        f"not judged: {steps} steps are too few to tell whether the loss falls (over so few, it "
        "moves by chance as much as by learning); pass --steps 100 or more for a verdict (the "
        "default is 300)\n"
    )
    assert "FAILED" not in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--hosts", "8", "--devices", "4"),
            (
                "--hosts 8 needs a device count that it divides (each virtual host owns as many "
                "devices), but there are 4 devices; pass --devices 8 or --hosts 4"
            ),
        ),
        (
            ("--hosts", "3", "--devices", "8"),
            (
                "--hosts 3 needs a device count that it divides (each virtual host owns as many "
                "devices), but there are 8 devices; pass --devices 6 or --hosts 2"
            ),
        ),
        (
            ("--devices", "512"),
            (
                "--devices 512: the demo trains with torch's autograd, which handles at most 127 "
                "devices of a kind (its device index is 8 bits); pass --devices 127 or fewer "
                "(bench runs on more)"
            ),
        ),
        (
            ("--devices", "3", "--batch", "256"),
            (
                "--batch 256 must be a multiple of the 3 devices (each gets as many rows); pass "
                "--batch 258, or leave it out"
            ),
        ),
    ],
    ids=["more-hosts-than-devices", "hosts-not-dividing", "too-many-devices", "uneven-batch"],
)
def test_combinations_that_cannot_work_are_refused_by_the_parser(capsys, args, message):
    """Before any device starts: one line, exit status 2, no traceback (``--hosts 8
    --devices 4`` ended in create_device_mesh's ValueError)."""
    run = refused(capsys, "--backend", "xla", *args)
    assert (run.returncode, run.stdout) == (2, ""), run.stderr
    assert run.stderr == f"python -m torchshard demo: error: {message}\n"


@pytest.mark.xla
def test_demo_fails_when_the_loss_does_not_fall():
    # No DataLoader worker processes (each starts an interpreter): the verdict is the point.
    run = demo("--steps", "100", "--lr", "0", "--workers", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED: the loss did not fall" in run.stderr


def test_demo_on_dtensor_refuses_virtual_hosts_uneven_batches_and_too_many_processes(capsys):
    for args, message in (
        (
            ("--hosts", "2"),
            (
                "--hosts 2: on dtensor every one of the --devices (2) gloo processes is a host of "
                "its own, so --hosts must be 1 (leave it out)"
            ),
        ),
        (
            ("--batch", "9"),
            (
                "--batch 9 must be a multiple of the 2 devices (each gets as many rows); pass "
                "--batch 10, or leave it out"
            ),
        ),
        (
            ("--devices", "512"),
            (
                "--devices 512: the dtensor demo starts one gloo process per device and runs at "
                "most 32 (each a Python with torch); pass --devices 32 or fewer, or --backend xla "
                "to emulate more devices"
            ),
        ),
    ):
        run = refused(capsys, "--backend", "dtensor", *args, devices=2)
        assert (run.returncode, run.stdout) == (2, ""), run.stderr
        assert run.stderr == f"python -m torchshard demo: error: {message}\n"


def test_demo_on_xla_without_torch_xla_names_the_extra():
    run = demo("--backend", "xla", xla=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.startswith(
        "python -m torchshard demo: error: setup_cpu_emulation (emulated XLA devices) needs "
        "torch_xla, which is not installed; install the extra with `pip install "
        "'torchshard-input[xla]'` (from a checkout: `pip install -e '.[xla]'`)"
    )


# -- in this process: the checks, the backend and the report, with the training stubbed ------


def _args(**kwargs):
    base = {"steps": 100, "hosts": 1, "batch": None, "workers": 0, "lr": 3e-3, "seed": 0}
    base.update({"devices": 8, "backend": "xla"})
    base.update(kwargs)
    return types.SimpleNamespace(**base)


RESULT = Result(2.0, 1.0, 12.5, 3200.0, 0.125, 1.5, 0.8)


def test_resolve_backend(monkeypatch):
    from torchshard._backend.xla import env

    assert demo_module.resolve_backend("xla") == "xla"
    assert demo_module.resolve_backend("dtensor") == "dtensor"
    monkeypatch.setattr(env, "xla_installed", lambda: True)
    assert demo_module.resolve_backend("auto") == "xla"
    monkeypatch.setattr(env, "xla_installed", lambda: False)
    assert demo_module.resolve_backend("auto") == "dtensor"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 1}, "demo: --steps must be at least 2\n"),
        (
            {"hosts": 3},
            (
                "demo: --hosts 3 needs a device count that it divides (each virtual host owns as "
                "many devices), but there are 8 devices; pass --devices 6 or --hosts 2\n"
            ),
        ),
        (
            {"batch": 12},
            (
                "demo: --batch 12 must be a multiple of the 8 devices (each gets as many rows); "
                "pass --batch 16, or leave it out\n"
            ),
        ),
        (
            {"backend": "dtensor", "devices": 3, "hosts": 3},
            (
                "demo: --hosts 3: on dtensor every one of the --devices (3) gloo processes is a "
                "host of its own, so --hosts must be 1 (leave it out)\n"
            ),
        ),
    ],
)
def test_bad_settings_exit_2_before_training(capsys, monkeypatch, kwargs, message):
    """``main`` checks against the runtime's device count (a TPU's chips need not be
    ``--devices``): here a stubbed 8."""
    monkeypatch.setattr(demo_module, "device_count", lambda: 8)
    monkeypatch.setattr(demo_module, "train", lambda **kw: pytest.fail("trained"))
    assert demo_module.main(_args(**kwargs)) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", message)


def test_the_report_and_the_status(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(demo_module, "device_count", lambda: 8)
    monkeypatch.setattr(demo_module, "train", lambda **kw: calls.append(kw) or RESULT)
    assert demo_module.main(_args(hosts=2)) == 0
    assert calls[0]["hosts"] == 2 and calls[0]["steps"] == 100 and calls[0]["batch_size"] == 256
    out, err = capsys.readouterr()
    assert out == (
        "loss 2.0000 -> 1.0000 (mean of the first and last steps); 12.5 steps/s, 3,200 "
        "examples/s after 1.5 s of compilation; input wait 12.5% of step time after each "
        "epoch's first batch (loader.stats; 0.8 s waited for those: the DataLoader workers' "
        "start)\n"
        "ok: the loss fell\n"
    )
    assert FINAL.search(out) and err == ""
    flat = Result(2.0, 1.95, 12.5, 3200.0, 0.125, 1.5)  # less than 5 % lower: not a fall
    monkeypatch.setattr(demo_module, "train", lambda **kw: flat)
    assert demo_module.main(_args()) == 1
    assert capsys.readouterr().err == "FAILED: the loss did not fall\n"


def test_too_few_steps_are_not_judged(capsys, monkeypatch):
    """Below ``MIN_JUDGED_STEPS`` neither a rise nor a fall is evidence: exit 0, saying so.
    Before: ``--steps 2`` failed (exit 1) on two losses 3 % apart."""
    from torchshard._tools._demo_common import MIN_JUDGED_STEPS

    assert MIN_JUDGED_STEPS == 100
    monkeypatch.setattr(demo_module, "device_count", lambda: 8)
    rose = Result(2.3170, 2.4, 0.5, 117.0, float("nan"), 7.7, 0.1)  # 2 steps: no input wait
    monkeypatch.setattr(demo_module, "train", lambda **kw: rose)
    assert demo_module.main(_args(steps=2)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out == (
        "loss 2.3170 -> 2.4000 (mean of the first and last steps); 0.5 steps/s, 117 examples/s "
        "after 7.7 s of compilation; input wait not measured, as no step ended after an epoch's "
        "first batch (loader.stats; 0.1 s waited for those: the DataLoader workers' start)\n"
        "not judged: 2 steps are too few to tell whether the loss falls (over so few, it moves by "
        "chance as much as by learning); pass --steps 100 or more for a verdict (the default is "
        "300)\n"
    )
    assert demo_module.main(_args(steps=99)) == 0
    assert demo_module.main(_args(steps=100)) == 1  # judged: the loss rose
    assert capsys.readouterr().err.endswith("FAILED: the loss did not fall\n")


def test_a_diverged_loss_is_named(capsys, monkeypatch):
    monkeypatch.setattr(demo_module, "device_count", lambda: 8)
    nan = Result(2.3, float("nan"), 12.5, 3200.0, 0.125, 1.5)
    monkeypatch.setattr(demo_module, "train", lambda **kw: nan)
    assert demo_module.main(_args(lr=1e30)) == 1
    assert capsys.readouterr().err == (
        "FAILED: the loss is nan (the training diverged; --lr 1e+30 may be too large)\n"
    )


def test_a_batch_whose_data_would_not_fit_is_refused(capsys, monkeypatch):
    """``--batch 2**31``: a 32 TiB allocation traceback from the dataset; the bound is on the
    data over every copy (each process and DataLoader worker holds one)."""
    from torchshard._tools._demo_common import MAX_DATA_BYTES, data_copies

    assert data_copies(8, 1, 2, backend="xla") == (3, "this process and its 2 DataLoader worker(s)")
    assert data_copies(8, 2, 2, backend="xla")[0] == 3  # one worker per host
    assert data_copies(4, 1, 2, backend="dtensor") == (
        8,
        "the 4 gloo processes and their 4 worker(s)",
    )
    monkeypatch.setattr(demo_module, "device_count", lambda: 8)
    monkeypatch.setattr(demo_module, "train", lambda **kw: pytest.fail("trained"))
    assert demo_module.main(_args(batch=2**31, workers=0)) == 2
    assert capsys.readouterr().err == (
        "demo: --batch 2147483648: the demo's dataset is 64 batches of 136-byte examples, 17.0 "
        "TiB, held by this process and its 0 DataLoader worker(s): 17.0 TiB in all, above the "
        "demo's bound of 4.0 GiB; pass --batch 493,440 or less\n"
    )
    most = 493_440
    assert 64 * most * 136 <= MAX_DATA_BYTES < 64 * (most + 8) * 136
    assert demo_module.check_sizes(8, 1, most, backend="xla") is None
