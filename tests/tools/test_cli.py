"""``python -m torchshard {layout,bench}`` in subprocesses (each command sets up its own devices),
with tiny sizes for bench (``--quick``); the spec parser in process."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

import torchshard as ts
from torchshard._tools import cli
from torchshard._tools.bench import BENCHES
from torchshard._tools.cli import parse_spec


def _run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "torchshard", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, **(env or {})},
    )


LAYOUT = """\
P(('data', 'model'), None) on Mesh({'data': 4, 'model': 2}): global shape (16, 8), 2 hosts

          0:8
      +----------+
  0:2 | device 0 |
      | host 0   |
      +----------+
  2:4 | device 1 |
      | host 0   |
      +----------+
  4:6 | device 2 |
      | host 0   |
      +----------+
  6:8 | device 3 |
      | host 0   |
      +----------+
 8:10 | device 4 |
      | host 1   |
      +----------+
10:12 | device 5 |
      | host 1   |
      +----------+
12:14 | device 6 |
      | host 1   |
      +----------+
14:16 | device 7 |
      | host 1   |
      +----------+

host 0: devices 0-3, local block shape (8, 8)
host 1: devices 4-7, local block shape (8, 8)
"""


def test_layout_command_prints_the_grid(tmp_path):
    png = tmp_path / "layout.png"
    args = ["layout", "--mesh", "4,2", "--axes", "data,model", "--spec", "('data','model'),None"]
    result = _run(*args, "--shape", "16,8", "--hosts", "2", "--plain", "--png", str(png))
    assert result.returncode == 0, result.stderr
    assert result.stdout == LAYOUT + f"wrote {png}\n"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_layout_command_with_rich_and_a_big_pod_mesh():
    # 256 devices: planning a pod layout without a pod (pure maths, no runtime needed).
    args = ["layout", "--mesh", "16,16", "--axes", "data,model", "--spec", "data,model"]
    result = _run(*args, "--shape", "64,32", "--hosts", "64")
    assert result.returncode == 0, result.stderr
    assert "P('data', 'model') on Mesh({'data': 16, 'model': 16}): global shape (64, 32)" in (
        result.stdout
    )
    assert "host 63: devices 252-255, local block shape (4, 8)" in result.stdout
    assert "[60:64, 30:32]" in result.stdout  # more than 8 column blocks: drawn as a table


def test_layout_command_prints_a_pods_runs_and_every_block_with_full(capsys):
    args = ["layout", "--mesh", "1024,4", "--axes", "data,model", "--spec", "('data','model')"]
    args += ["--shape", "4096,8", "--hosts", "1024", "--plain"]
    result = _main(capsys, *args)
    assert (result.returncode, result.stderr) == (0, "")
    assert "| ... 4,094 more blocks, each [+1, +0], devices +1 |" in result.stdout
    assert "... 1,022 more hosts, each devices +4" in result.stdout
    assert len(result.stdout.splitlines()) == 13
    full = _main(capsys, *args, "--full")
    assert (full.returncode, full.stderr) == (0, "")
    assert len(full.stdout.splitlines()) == 2 + 4 + 4096 + 1 + 1024
    assert "| [4095:4096, 0:8] | 4095    | 1023  |" in full.stdout
    rich = _main(capsys, *args[:-1])  # rich draws the same runs
    assert "... 4,094 more blocks, each [+1, +0], devices +1" in rich.stdout


def test_layout_command_errors_are_messages():
    result = _run(*"layout --mesh 4,2 --axes data,model --spec data --shape 16,8 --hosts 3".split())
    assert result.returncode == 2
    assert result.stderr == (
        "python -m torchshard layout: error: num_hosts must be a positive divisor of the 8 "
        "devices, but got 3; each host owns an equal, contiguous group of device ids.\n"
    )
    result = _run(
        *"layout --mesh 4,2 --axes data,model --spec __import__('os') --shape 16,8".split()
    )
    assert result.returncode == 2
    assert (
        "error: argument --spec: cannot read \"__import__('os')\" as a partition spec (it is not "
        "made of None, axis names and tuples of them)"
    ) in result.stderr


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("('data','model'),None", ts.P(("data", "model"), None)),
        ("'data'", ts.P("data")),
        ("data,None", ts.P("data", None)),
        ("(data, model)", ts.P(("data", "model"))),
        ("P('data', None)", ts.P("data", None)),
        ("", ts.P()),
        ("None", ts.P(None)),
    ],
)
def test_parse_spec(text, spec):
    assert parse_spec(text) == spec
    assert isinstance(parse_spec(text), ts.PartitionSpec)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            "__import__('os').system('true')",
            "it is not made of None, axis names and tuples of them",
        ),
        ("a.b", "it is not made of None, axis names and tuples of them"),
        (
            "1",
            (
                "PartitionSpec entry 0 must be None, an axis name or a tuple of axis names, "
                "but got 1 of type int"
            ),
        ),
        (
            "data,data",
            (
                "PartitionSpec ('data', 'data') uses mesh axis 'data' twice (entries 0 and "
                "1); each axis may split at most one dimension"
            ),
        ),
    ],
)
def test_parse_spec_rejects(text, why):
    with pytest.raises(
        argparse.ArgumentTypeError,
        match=re.escape(f"cannot read {text!r} as a partition spec ({why}); write the entries"),
    ):
        parse_spec(text)


def test_bench_choices_come_from_the_registry():
    result = _run("bench", "--help")
    assert result.returncode == 0
    assert "{" + ",".join([*BENCHES, "all"]) + "}" in result.stdout.replace("\n", "")
    # What users run; the maintainers' benches (g2h, sweep, ...) are the lab's (benchmarks/).
    assert set(BENCHES) == {
        "h2g",
        "overhead",
        "dtensor",
        "h2d",
        "loader",
        "packing",
        "cp_balance",
        "torchax",
    }
    assert "--plot" not in result.stdout


# -- input errors: exit status 2, one line on stderr, no traceback ---------------------------


def _one_line_error(result, command, message):
    """The command failed on its input: status 2, stderr exactly one line naming the command,
    holding ``message``, and no traceback; nothing on stdout."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"python -m torchshard {command}: error: "), lines[0]
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "command", "message"),
    [
        (
            ["demo", "--batch", "0"],
            "demo",
            "argument --batch: expected a positive int, but got '0'",
        ),
        (
            ["demo", "--batch", "-8"],
            "demo",
            "argument --batch: expected a positive int, but got '-8'",
        ),
        (
            ["bench", "--threads", "0"],
            "bench",
            "argument --threads: expected a positive int, but got '0'",
        ),
        (
            ["layout", "--mesh", "4,2", "--axes", "data,model", "--shape", "-16,8"],
            "layout",
            "argument --shape: every entry must be non-negative, but '-16,8' has -16",
        ),
        (
            ["demo", "--backend", "xla", "--batch", str(2**31)],  # before: a 32 TiB traceback
            "demo",
            (
                "--batch 2147483648: the demo's dataset is 64 batches of 136-byte examples, 17.0 "
                "TiB, held by this process and its 2 DataLoader worker(s): 51.0 TiB in all, above "
                "the demo's bound of 4.0 GiB; pass --batch 164,480 or less (or fewer --workers)"
            ),
        ),
    ],
    ids=[
        "demo-batch-0",
        "demo-batch-negative",
        "bench-threads-0",
        "layout-negative-shape",
        "demo-batch-2**31",
    ],
)
def test_bad_arguments_are_one_line_in_a_subprocess(args, command, message):
    _one_line_error(_run(*args), command, message)


def test_version_from_the_package_metadata():
    from importlib import metadata

    from torchshard._core.version import DISTRIBUTION, UNKNOWN, package_version

    assert DISTRIBUTION == "torchshard-input"  # the index's "torchshard" is another project
    try:
        installed = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # an environment installed under the old name
        installed = UNKNOWN
    assert ts.__version__ == installed
    if installed != UNKNOWN:
        assert re.fullmatch(r"\d+\.\d+\.\d+.*", ts.__version__)
    assert package_version("torchshard-no-such-distribution") == UNKNOWN
    result = _run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"torchshard {ts.__version__}\n"


# The rest runs the command line in this process (``main(argv)``): the same code path, without
# the cost of a fresh interpreter. argparse's errors end in SystemExit(2).


def _main(capsys, *argv):
    try:
        status = cli.main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), status, out, err)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--steps", "1"], "argument --steps: expected an int >= 2, but got '1'"),
        (["demo", "--workers", "-1"], "argument --workers: expected a non-negative int"),
        (
            ["demo", "--batch", "eight"],
            "argument --batch: expected a positive int, but got 'eight'",
        ),
        (["demo", "--lr", "nan"], "argument --lr: expected a finite number >= 0, but got 'nan'"),
        (["demo", "--lr", "inf"], "argument --lr: expected a finite number >= 0, but got 'inf'"),
        (["demo", "--lr", "-1e-3"], "argument --lr: expected a finite number >= 0, but got '-1e"),
        (["demo", "--lr", "-inf"], "argument --lr: expected a finite number >= 0, but got '-inf'"),
        (["demo", "--seed", "-1"], "argument --seed: expected a non-negative int, but got '-1'"),
        (
            ["demo", "--seed", str(2**63)],
            (
                "argument --seed: expected at most 9,223,372,036,854,775,807 (numpy's and torch's "
                "seeds are 64-bit)"
            ),
        ),
        (
            ["demo", "--workers", "100000"],
            (
                f"argument --workers: expected at most {4 * (os.cpu_count() or 1):,} (4 processes "
                "per core), but got '100000'"
            ),
        ),
        (["bench", "--threads", "-2"], "argument --threads: expected a positive int"),
        (["bench", "nosuch"], "argument name: invalid choice: 'nosuch'"),
        (
            ["layout", "--mesh", "0,2", "--axes", "a,b", "--shape", "4"],
            "every entry must be positive",
        ),
        (["layout", "--mesh", "4,2", "--axes", "a,b", "--shape", "8", "--hosts", "0"], "--hosts"),
        (["layout", "--mesh", "4", "--axes", "a", "--shape", "8", "--devices", "0"], "--devices"),
    ],
)
def test_argument_errors_are_one_line(capsys, args, message):
    _one_line_error(_main(capsys, *args), args[0], message)


def test_global_options_before_or_after_the_subcommand():
    parser = cli.build_parser()
    for command in (["demo"], ["bench"], ["layout", "--mesh", "4", "--axes", "a", "--shape", "8"]):
        assert parser.parse_args(command).devices == 8
        assert parser.parse_args(["--devices", "4", *command]).devices == 4
        assert parser.parse_args([*command, "--devices", "4"]).devices == 4
        # After the name wins, as the later of two values of one option does.
        assert parser.parse_args(["--devices", "2", *command, "--devices", "4"]).devices == 4


def test_a_huge_layout_is_refused_at_once(capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("describe_layout ran")

    monkeypatch.setattr(ts, "describe_layout", never)
    result = _main(capsys, *"layout --mesh 2048,2048 --axes data,model --shape 16,8".split())
    _one_line_error(
        result,
        "layout",
        "a 2048 x 2048 mesh has 4,194,304 devices; layout describes at most 65,536",
    )


def test_layout_png_errors_and_overwrite(capsys, tmp_path):
    args = ["layout", "--mesh", "2", "--axes", "data", "--spec", "data", "--shape", "4", "--plain"]
    missing = tmp_path / "no" / "such" / "layout.png"
    result = _main(capsys, *args, "--png", str(missing))
    _one_line_error(
        result, "layout", f"cannot write {missing}: the folder {missing.parent} does not exist"
    )
    result = _main(capsys, *args, "--png", str(tmp_path))
    _one_line_error(result, "layout", f"{tmp_path} is a folder; give a file name")
    # An existing file (the README's picture, say) is never replaced without --overwrite.
    existing = tmp_path / "layout.png"
    existing.write_bytes(b"keep me")
    result = _main(capsys, *args, "--png", str(existing))
    _one_line_error(result, "layout", f"{existing} exists; pass --overwrite to replace it")
    assert existing.read_bytes() == b"keep me"
    result = _main(capsys, *args, "--png", str(existing), "--overwrite")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(f"wrote {existing}\n")
    assert existing.read_bytes()[:4] == b"\x89PNG"
    # Any writable path, inside the repository or not, relative or absolute.
    fresh = tmp_path / "sub"
    fresh.mkdir()
    result = _main(capsys, *args, "--png", str(fresh / "a.png"))
    assert result.returncode == 0, result.stderr
    assert (fresh / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_the_documented_layout_commands_do_not_write_the_tracked_picture():
    root = pathlib.Path(__file__).parents[2]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    lines = [line for page in pages for line in page.read_text().splitlines()]
    commands = [line for line in lines if "torchshard layout" in line and "--png" in line]
    assert commands
    assert not [c for c in commands if "docs/layout.png" in c and "--overwrite" not in c]


# -- bench: the default, --strict, --quick, output paths (a fake bench, in this process) -----

FAKE = "fake"


@pytest.fixture
def fake_bench(monkeypatch):
    """A bench named ``fake`` that records one ratio per target given in ``calls``' list."""
    from torchshard._tools import bench
    from torchshard._tools.bench import _report

    module = types.ModuleType("torchshard_test_fake_bench")
    module.runs = []
    module.ratios = [(1.2, 1.0), (0.8, 1.0), (0.5, None)]  # (value, target): ok, MISSED, none

    def run(report):
        module.runs.append(report)
        report.figure(FAKE, "case", "a", 1.0, "GB/s")
        for i, (value, target) in enumerate(module.ratios):
            report.ratio(FAKE, f"case {i}", "a", "b", value, target)

    module.run = run
    # The fake bench needs no devices: no XLA emulation (which needs torch_xla).
    from torchshard._backend.xla import env as xla_env

    monkeypatch.setattr(xla_env, "setup_cpu_emulation", lambda n: None)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(bench.BENCHES, FAKE, module.__name__)
    yield module
    _report.configure(quick=False)


def test_bench_strict_exits_1_on_a_missed_target(capsys, fake_bench):
    result = _main(capsys, "bench", FAKE, "--plain", "--strict")
    assert result.returncode == 1
    assert "1.200x  >= 1 ok" in result.stdout
    assert "0.800x  >= 1 MISSED" in result.stdout
    assert result.stderr.splitlines()[-1] == (
        "bench: target missed: fake case 1: a / b = 0.800x, target >= 1"
    )
    # Without --strict a missed target is shown, and the status is 0.
    assert _main(capsys, "bench", FAKE, "--plain").returncode == 0
    # With every target met, --strict exits 0.
    fake_bench.ratios = [(1.2, 1.0), (0.5, None)]
    assert _main(capsys, "bench", FAKE, "--plain", "--strict").returncode == 0


def test_bench_quick_judges_no_target(capsys, fake_bench, tmp_path):
    out = tmp_path / "b.json"
    result = _main(capsys, "bench", FAKE, "--plain", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "MISSED" not in result.stdout and " ok" not in result.stdout
    assert "0.800x" in result.stdout
    assert "no target is judged" in result.stdout
    ratios = json.loads(out.read_text())["ratios"]
    assert [(r["target"], r["ok"]) for r in ratios] == [(1.0, None), (1.0, None), (None, None)]
    result = _main(capsys, "bench", FAKE, "--quick", "--strict")
    _one_line_error(result, "bench", "--strict judges the targets, and --quick measures nothing")
    assert len(fake_bench.runs) == 1


@pytest.mark.xla  # the XLA default bench / emulation
def test_bench_without_a_name_runs_the_short_default(capsys, fake_bench, monkeypatch):
    monkeypatch.setattr(cli, "DEFAULT_BENCH", FAKE)
    result = _main(capsys, "bench", "--plain")
    assert result.returncode == 0, result.stderr
    assert len(fake_bench.runs) == 1
    notice = result.stderr.splitlines()[0]
    assert notice.startswith(f"bench: no name given, so running the short default, {FAKE} ")
    n = len(BENCHES)  # the fake included
    assert f"`bench all` runs all {n} one after another" in notice
    assert "h2g" in notice and "many minutes" in notice


def test_bench_output_paths_are_checked_before_benchmarking(capsys, fake_bench, tmp_path):
    missing = tmp_path / "missing" / "out"
    result = _main(capsys, "bench", FAKE, "--plain", "--json", str(missing))
    _one_line_error(result, "bench", f"the folder {missing.parent} does not exist")
    # --plot is the lab's (python -m benchmarks, in a checkout): the wheel says so, at once.
    result = _main(capsys, "bench", FAKE, "--plain", "--plot", str(tmp_path / "sweep.png"))
    _one_line_error(
        result,
        "bench",
        "--plot draws the sweep, which is one of the maintainers' benchmarks, not in the "
        "package: in a checkout of the repository, run `python -m benchmarks sweep --plot "
        f"{tmp_path / 'sweep.png'}` from its root",
    )
    assert fake_bench.runs == []
    out = tmp_path / "b.json"
    assert _main(capsys, "bench", FAKE, "--plain", "--json", str(out)).returncode == 0
    data = json.loads(out.read_text())
    assert set(data["seconds"]) == {FAKE} and data["seconds"][FAKE] >= 0


@pytest.mark.parametrize(("in_no_xla", "emulated"), [(True, False), (False, True)])
def test_the_dtensor_benches_set_up_no_xla_emulation(
    capsys, monkeypatch, fake_bench, in_no_xla, emulated
):
    """A DTensor-only bench runs on a plain install: the CLI sets up no XLA emulation for it
    (which would need torch_xla); every other bench still gets it."""
    from torchshard._backend.xla import env as xla_env
    from torchshard._tools import bench

    calls = []
    monkeypatch.setattr(xla_env, "setup_cpu_emulation", lambda n: calls.append(n))
    names = bench.NEEDS_NO_XLA | {FAKE} if in_no_xla else bench.NEEDS_NO_XLA
    monkeypatch.setattr(bench, "NEEDS_NO_XLA", frozenset(names))
    assert _main(capsys, "bench", FAKE, "--plain", "--quick").returncode == 0
    assert bool(calls) is emulated
    assert "dtensor" in bench.NEEDS_NO_XLA and "h2d" in bench.NEEDS_NO_XLA


def test_bench_threads_is_bounded(capsys):
    """``bench --threads 100000`` ran away (load ~800 on 2 cores) and ``2**40`` was a
    traceback from torch: both are usage errors now, before anything runs."""
    top = cli.MAX_THREADS
    assert top == cli.THREADS_PER_CORE * (os.cpu_count() or 1)
    for n in (100_000, 2**40, top + 1):
        result = _main(capsys, "bench", "h2g", "--threads", str(n))
        _one_line_error(
            result,
            "bench",
            f"argument --threads: expected at most {top:,} (4 per core), but got '{n}'",
        )


def test_layout_png_is_a_png_and_bounded(capsys, tmp_path):
    """``layout --png x.xyz`` wrote something and exited 0; a 256 x 256 mesh's picture passed
    3 GB of RSS (the text grid is capped, the picture was not)."""
    args = ["layout", "--axes", "data", "--spec", "data", "--plain"]
    odd = tmp_path / "x.xyz"
    result = _main(capsys, *args, "--mesh", "2", "--shape", "4", "--png", str(odd))
    _one_line_error(
        result,
        "layout",
        f"--png {odd}: expected a file name ending in .png (the picture is a PNG), e.g. "
        f"{tmp_path / 'x'}.png",
    )
    assert not odd.exists()
    big = ["layout", "--mesh", "256,256", "--axes", "data,model", "--spec", "data,model"]
    result = _main(capsys, *big, "--shape", "256,256", "--png", str(tmp_path / "big.png"))
    _one_line_error(
        result,
        "layout",
        "--png: a 256 x 256 mesh has 65,536 devices; the picture draws at most 1,024 (one box "
        "each), so leave out --png for the text layout or draw a smaller mesh with the same "
        "axes",
    )
    assert not (tmp_path / "big.png").exists()


def test_bench_without_a_name_runs_dtensor_where_torch_xla_is_missing(monkeypatch):
    """Before: ``bench`` with no name failed asking for the xla extra on a plain install."""
    from torchshard._backend.xla import env
    from torchshard._tools import cli
    from torchshard._tools.bench import BENCHES, NEEDS_NO_XLA

    monkeypatch.setattr(env, "xla_installed", lambda: False)
    assert cli.default_bench() == "dtensor"
    assert cli.bench_names(None) == ["dtensor"]
    assert cli.bench_names("all") == [n for n in BENCHES if n in NEEDS_NO_XLA and n != "torchax"]
    assert cli._default_bench_notice(BENCHES).startswith(
        "bench: no name given, so running the short default, dtensor (host -> global on DTensor "
        "gloo processes, and the agreement check's cost)."
    )
    monkeypatch.setattr(env, "xla_installed", lambda: True)
    assert cli.bench_names(None) == ["h2g"]
    assert cli.bench_names("all") == [n for n in BENCHES if n != "torchax"]


def test_bench_backend_torchax_runs_the_torchax_benches_alone():
    from torchshard._tools import cli

    assert cli.bench_names(None, backend="torchax") == ["torchax"]
    assert cli.bench_names("all", backend="torchax") == ["torchax"]
    assert cli.bench_names("torchax", backend="torchax") == ["torchax"]
    assert cli.bench_names(None, backend="dtensor") == ["dtensor"]
    assert cli.bench_names(None, backend="xla") == ["h2g"]
    with pytest.raises(cli.UsageError, match="bench h2g runs on torch_xla, not on torchax"):
        cli.bench_names("h2g", backend="torchax")


def test_demo_on_torchax_is_one_host():
    from torchshard._tools.demo import check_sizes

    assert check_sizes(8, 1, 256, backend="torchax") is None
    why = check_sizes(8, 2, 256, backend="torchax")
    assert why.startswith("--hosts 2: the torchax demo is one JAX process")


@pytest.mark.xla  # the XLA default bench / emulation
def test_bench_json_on_a_full_disk_is_one_line(capsys, monkeypatch):
    """``bench --json /dev/full`` ended in a traceback from ``write_json`` (ENOSPC); then (issue
    22) in one line, but after the whole run (minutes for ``bench all``). Now refused before
    any bench runs: a device that refuses every write refuses an empty one too."""
    from torchshard._tools import bench as bench_pkg

    ran = []
    fake = types.ModuleType("torchshard_fake_bench")
    fake.run = lambda report: ran.append(report)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchshard_fake_bench", fake)
    monkeypatch.setitem(bench_pkg.BENCHES, "fake", "torchshard_fake_bench")
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    result = _main(capsys, "bench", "fake", "--plain", "--json", "/dev/full")
    _one_line_error(result, "bench", "cannot write /dev/full: No space left on device")
    assert ran == []
    # /dev/null and a pipe take an empty write: accepted (nothing is written before the run)
    cli.check_output_path("/dev/null")


def test_an_output_file_on_a_full_file_system_is_refused_before_the_run(tmp_path, monkeypatch):
    full = types.SimpleNamespace(f_blocks=1000, f_bavail=0)
    monkeypatch.setattr(os, "fstatvfs", lambda fd: full)
    with pytest.raises(cli.UsageError) as info:
        cli.check_output_path(str(tmp_path / "out.json"))
    assert str(info.value) == (
        f"cannot write {tmp_path / 'out.json'}: the file system holding {tmp_path} is full (0 "
        "bytes available)"
    )
    assert not (tmp_path / "out.json").exists()
    monkeypatch.setattr(os, "fstatvfs", lambda fd: types.SimpleNamespace(f_blocks=0, f_bavail=0))
    cli.check_output_path(str(tmp_path / "out.json"))  # a file system that reports no sizes


def _layout_into(stdout, *extra):
    import torchshard

    root = str(pathlib.Path(torchshard.__file__).resolve().parents[1])
    args = ["layout", "--mesh", "64,2", "--axes", "data,model", "--shape", "1024,8", *extra]
    return subprocess.run(
        [sys.executable, "-m", "torchshard", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
        check=False,
    )


def test_layout_into_a_pipe_its_reader_closed_is_one_line():
    """``layout ... | head -1`` (the reader gone before the end): with rich, exit 1 and no
    message (rich's own handler ends the process); plain, ``error: [Errno 32] Broken pipe``
    with exit status 2, as if the input were wrong. Now one line naming standard output,
    exit 1, both ways."""
    for extra in ((), ("--plain",)):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before anything is written
        try:
            out = _layout_into(write, *extra)
        finally:
            os.close(write)
        assert out.returncode == 1, out.stderr
        assert out.stderr == (
            "python -m torchshard layout: error: could not write standard output: Broken pipe "
            "(its reader closed it before the end, as `| head` does)\n"
        )


def test_layout_onto_a_full_device_is_an_output_error():
    """``layout > /dev/full``: exit status 2 and ``[Errno 28] No space left on device``, as if
    the input were wrong; now an output error (exit 1) naming standard output."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        out = _layout_into(full, "--plain")
    assert (out.returncode, out.stderr) == (
        1,
        (
            "python -m torchshard layout: error: could not write standard output: No space left on "
            "device\n"
        ),
    )


def test_layout_with_stdout_closed_is_one_line(tmp_path):
    """``layout ... >&-`` was an AttributeError traceback from rich (``sys.stdout`` is None)."""
    import torchshard

    root = str(pathlib.Path(torchshard.__file__).resolve().parents[1])
    args = ["layout", "--mesh", "4,2", "--axes", "data,model", "--spec", "data", "--shape", "8,4"]
    out = subprocess.run(
        [sys.executable, "-m", "torchshard", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.close(1),
        env={**os.environ, "PYTHONPATH": root},
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (
        "python -m torchshard layout: error: standard output is closed, so there is nowhere to "
        "print to; redirect it to a file or to /dev/null instead of closing it."
    )


# -- --devices N: every command builds its meshes from the device count (issue 22) ----------
# The quick torch_xla benches on 1 and 3 devices, this command's and the lab's in one child per
# count: benchmarks/tests/test_cli.py, test_the_quick_benches_run_on_any_device_count.

HUGE = 10**18


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
@pytest.mark.parametrize(
    ("mesh", "axes", "spec", "shape"),
    [
        ("8", "data", "data", f"{HUGE}"),
        ("8", "data", "None,data", f"4,{HUGE}"),
        ("4,2", "data,model", "data,model", f"{HUGE},{HUGE}"),
        ("4,2", "data,model", "('data','model'),None", f"{HUGE + 1},16"),
    ],
)
def test_a_layout_of_a_huge_dimension_shows_every_device(capsys, plain, mesh, axes, spec, shape):
    """A dimension of 10**18 (int maths, no float rounding): every device's block is drawn,
    device 7's last one ending at the dimension's size."""
    args = ["layout", "--mesh", mesh, "--axes", axes, "--spec", spec, "--shape", shape]
    result = _main(capsys, *args, *(["--plain"] if plain else []))
    assert (result.returncode, result.stderr) == (0, "")
    grid, _, hosts = result.stdout.partition("host 0: devices 0-7")
    assert sorted(set(re.findall(r"device (\d)\b", grid))) == [str(d) for d in range(8)]
    assert hosts.startswith(", local block shape")
    if plain and spec == "data":
        assert "875000000000000000:1000000000000000000 | device 7 |" in grid
