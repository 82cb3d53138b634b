"""The lab's command line (benchmarks.cli): ``python -m benchmarks NAME`` on the machinery of
``python -m torchshard bench`` (the wheel's command is tested in ``tests/tools/test_cli.py``):
its registry, ``--plot``, the gloo processes' bound, the quick benches of both registries on
any device count, and the bench commands the documentation shows."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import types

import pytest

import benchmarks
from benchmarks import BENCHES, cli
from torchshard._tools import bench as wheel
from torchshard._tools import cli as wheel_cli

ROOT = pathlib.Path(benchmarks.__file__).resolve().parents[1]


def _main(capsys, *argv):
    """The lab's command line in this process (the same code path as ``python -m
    benchmarks``, without a fresh interpreter); argparse's errors end in SystemExit(2)."""
    try:
        status = cli.main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), status, out, err)


def _one_line_error(result, message):
    """The command failed on its input: status 2, stderr exactly one line naming the lab's
    command, holding ``message``, and no traceback; nothing on stdout."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m benchmarks: error: "), lines[0]
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.fixture
def settings_restored():
    """The process-wide settings a bench run changes: quick mode and torch's threads."""
    import torch

    from torchshard._tools.bench import _report

    threads = torch.get_num_threads()
    yield
    _report.configure(quick=False)
    torch.set_num_threads(threads)


def test_the_lab_runs_the_wheel_s_benches_and_its_own():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,  # the lab runs from a checkout's root
    )
    assert result.returncode == 0, result.stderr
    assert "{" + ",".join([*BENCHES, "all"]) + "}" in result.stdout.replace("\n", "")
    assert "--plot PATH" in result.stdout
    assert {"h2g", "g2h", "sweep"} <= set(BENCHES)
    assert {n: BENCHES[n] for n in wheel.BENCHES} == wheel.BENCHES  # the same modules
    assert benchmarks.OWN == set(BENCHES) - set(wheel.BENCHES)
    assert benchmarks.OWN == {
        "g2h",
        "dispatch",
        "dtensor_dispatch",
        "dtensor_loader",
        "loader_gil",
        "soak",
        "ctrl_c",
        "sweep",
        "ends",
        "epoch_check",
        "plan_scale",
        "exchange",
        "deferred",
    }
    assert all(BENCHES[n] == f"benchmarks.{n}" for n in benchmarks.OWN)
    assert wheel.NEEDS_NO_XLA <= benchmarks.NEEDS_NO_XLA <= set(BENCHES)


@pytest.mark.xla
def test_bench_quick_json_and_plot(capsys, tmp_path, settings_restored):
    out, png = tmp_path / "bench.json", tmp_path / "sweep.png"
    args = ["--quick", "--plain", "--threads", "1", "--json", str(out), "--plot", str(png)]
    result = _main(capsys, "h2g", *args)  # the test process's 8 emulated devices
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    # --plot adds the sweep to the run; every figure printed is in the JSON, and back.
    assert data["settings"] == {
        "devices": 8,
        "quick": True,
        "benches": ["h2g", "sweep"],
        "torch_threads": 1,
    }
    assert data["machine"]["nproc"] >= 1 and data["machine"]["torch_xla"] == "2.9.0"
    figures = {(f["bench"], f["case"], f["method"]) for f in data["figures"]}
    assert figures == {
        ("h2g", f"{n}x[64,32] f32 {m}", method)
        for n in (1, 8)
        for m in ("(8,)", "(4,2)")
        for method in ("torchshard", "direct", "to+mark_sharding")
    } | {
        ("sweep", size, method)
        for size in ("1 KiB", "16 KiB")
        for method in ("torchshard", "direct", "to+mark_sharding", "memcpy")
    }
    for f in data["figures"]:
        assert f["unit"] == "GB/s" and f["value"] > 0 and f["spread"] >= 0
        assert 0 < f["median"] <= f["value"]  # the best round is at least as fast
        cells = (f["bench"], f["case"], f["method"], format(f["value"], ".4g"))
        line = re.compile(r"^" + r"\s+".join(re.escape(c) for c in cells) + r"\s")
        assert any(line.match(s) for s in result.stdout.splitlines()), f
    ratios = {(r["bench"], r["case"], r["numerator"], r["denominator"]) for r in data["ratios"]}
    assert ("h2g", "1x[64,32] f32 (8,)", "torchshard", "direct") in ratios
    assert ("sweep", "1 KiB", "torchshard", "memcpy") in ratios
    assert all(r["value"] > 0 for r in data["ratios"])
    assert result.stdout.rstrip().endswith(f"wrote {out}\nwrote {png}")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The plain progress: one line per step on stderr, ending with the last bench done.
    progress = [s for s in result.stderr.splitlines() if s.startswith("[")]
    assert progress[0].startswith("[..] 0/2") and progress[0].endswith("h2g: starting")
    assert progress[-1].startswith("[##] 2/2") and progress[-1].endswith("sweep: done")


@pytest.mark.xla
def test_bench_plot_without_matplotlib_fails_before_running(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # hidden: importing it fails
    result = _main(capsys, "g2h", "--quick", "--plot", str(tmp_path / "x.png"))
    assert result.returncode == 2
    assert result.stderr.endswith(
        "python -m benchmarks: error: bench --plot needs matplotlib, which is not "
        "installed; install the optional extra with `pip install 'torchshard-input[plot]'` "
        "(from a checkout: `pip install -e '.[plot]'`), or `pip install matplotlib`.\n"
    )
    assert "g2h" not in result.stdout


FAKE = "fake"


@pytest.fixture
def fake_bench(monkeypatch):
    """A lab bench named ``fake`` that records one figure and needs no devices."""
    from torchshard._backend.xla import env as xla_env
    from torchshard._tools.bench import _report

    module = types.ModuleType("benchmarks_test_fake_bench")
    module.runs = []

    def run(report):
        module.runs.append(report)
        report.figure(FAKE, "case", "a", 1.0, "GB/s")

    module.run = run
    monkeypatch.setattr(xla_env, "setup_cpu_emulation", lambda n: None)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(benchmarks.BENCHES, FAKE, module.__name__)
    yield module
    _report.configure(quick=False)


def test_bench_output_paths_are_checked_before_benchmarking(capsys, fake_bench, tmp_path):
    for option in ("--json", "--plot"):
        missing = tmp_path / "missing" / "out"
        result = _main(capsys, FAKE, "--plain", option, str(missing))
        _one_line_error(result, f"the folder {missing.parent} does not exist")
    assert fake_bench.runs == []
    out = tmp_path / "b.json"
    assert _main(capsys, FAKE, "--plain", "--json", str(out)).returncode == 0
    data = json.loads(out.read_text())
    assert set(data["seconds"]) == {FAKE} and data["seconds"][FAKE] >= 0


def test_bench_refuses_more_gloo_processes_than_it_runs(capsys):
    """``dtensor_loader`` starts one gloo process per device: past ``MAX_GLOO_PROCESSES`` the
    parser says so (``--quick`` runs two, whatever ``--devices``)."""
    top = wheel_cli.MAX_GLOO_PROCESSES
    for name in ("dtensor_loader", "all"):
        result = _main(capsys, name, "--devices", str(top + 1))
        _one_line_error(
            result,
            f"--devices {top + 1}: bench dtensor_loader starts one gloo process per device and "
            f"runs at most {top} (each a Python with torch); pass --devices {top} or fewer (or "
            "--quick, which runs 2)",
        )


def test_a_name_is_required(capsys):
    result = _main(capsys)
    _one_line_error(result, "the following arguments are required: name")


# -- --devices N: every command builds its meshes from the device count (issue 22) ----------

# The torch_xla benches that --quick keeps to seconds, the wheel's through `python -m torchshard
# bench` and the lab's through `python -m benchmarks`, all in one child with N emulated devices
# (one runtime start per count): each ended in "mesh Mesh({'data': 8}) covers devices [0..7],
# but the runtime has N devices" for N != 8. (loader, loader_gil and soak take minutes even
# with --quick.)
QUICK_XLA_BENCHES = ("h2g", "g2h", "overhead", "sweep", "dispatch", "ends")
BENCH_CHILD = """
import sys
from torchshard._tools import bench
from torchshard._tools.cli import main as wheel_main
from benchmarks.cli import main as lab_main
devices, out = sys.argv[1], sys.argv[2]
for i, name in enumerate(sys.argv[3:]):
    options = ["--devices", devices, name, "--quick", "--plain", "--threads", "1"]
    options += ["--json", f"{out}.{i}"]
    status = wheel_main(["bench", *options]) if name in bench.BENCHES else lab_main(options)
    if status:
        raise SystemExit(f"bench {name} --devices {devices}: exit status {status}")
"""


@pytest.mark.xla
@pytest.mark.parametrize("devices", [1, 3])
def test_the_quick_benches_run_on_any_device_count(tmp_path, devices):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-c", BENCH_CHILD, str(devices), str(out), *QUICK_XLA_BENCHES],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    runs = [
        json.loads((tmp_path / f"bench.json.{i}").read_text())
        for i in range(len(QUICK_XLA_BENCHES))
    ]
    assert [r["settings"]["benches"] for r in runs] == [[n] for n in QUICK_XLA_BENCHES]
    assert {r["settings"]["devices"] for r in runs} == {devices}
    cases = {f["case"] for r in runs for f in r["figures"]}
    rows = {1: 64, 3: 66}[devices]  # the quick rows, rounded up to a multiple of N
    grid = {1: "(1,1)", 3: "(3,1)"}[devices]
    assert f"1x[{rows},32] f32 ({devices},)" in cases and f"8x[{rows},32] f32 {grid}" in cases
    physical = {1: 256, 3: 288}[devices]  # a multiple of 2N and of 16 (L over N and 8 feeds)
    assert f"P={physical} L={physical // 2} W=1024 f32 ({devices},)" in cases
    short = {1: 24, 3: 24}[devices]
    assert f"3 x [{rows},32] f32 + [{short},32] ({devices},)" in cases
    assert all(f["value"] == f["value"] for r in runs for f in r["figures"])  # no NaN


# -- the documentation's commands -------------------------------------------------------------

COMMAND = re.compile(r"`(python -m (?:torchshard bench|benchmarks)(?: [^`]*)?)`")


def test_every_bench_command_the_documentation_shows_parses():
    """Each ``python -m torchshard bench ...`` and ``python -m benchmarks ...`` written in
    backticks in the README and docs/ names a bench of its registry, with options it takes
    (parsed, not run)."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    pages = [ROOT / "README.md", *docs]
    text = "\n".join(p.read_text() for p in pages)
    commands = sorted(set(COMMAND.findall(re.sub(r"\s*\n\s*", " ", text))))
    assert any(c.startswith("python -m benchmarks ") for c in commands)
    assert any(c.startswith("python -m torchshard bench") for c in commands)
    wheel_parser, lab_parser = wheel_cli.build_parser(), cli.build_parser()
    for command in commands:
        words = command.split()[2:]
        if words[0] == "torchshard":
            parser, argv = wheel_parser, words[1:]
        else:
            parser, argv = lab_parser, words[1:]
        if not argv or argv[-1] in ("NAME", "...") or "NAME" in argv:
            continue  # the synopsis, not a command
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"the documented command does not parse: {command}")
        assert parser is lab_parser or args.plot is None, f"--plot is the lab's: {command}"
