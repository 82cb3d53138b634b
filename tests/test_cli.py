"""``python -m torchshard {layout,bench}`` in subprocesses (each command sets up its own devices),
with tiny sizes for bench (``--quick``); the spec parser in process."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

import torchshard as ts
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


def test_layout_command_errors_are_messages():
    result = _run(*"layout --mesh 4,2 --axes data,model --spec data --shape 16,8 --hosts 3".split())
    assert result.returncode == 2
    assert result.stderr == (
        "python -m torchshard layout: error: num_hosts must be a positive divisor of the mesh's "
        "8 devices, but got 3; each host owns an equal, contiguous group of device ids.\n"
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
    assert {"h2g", "g2h", "sweep"} <= set(BENCHES)


@pytest.mark.xla
def test_bench_quick_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "sweep.png"
    args = ["--quick", "--plain", "--threads", "1", "--json", str(out), "--plot", str(png)]
    result = _run("bench", "h2g", *args)
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
def test_bench_plot_without_matplotlib_fails_before_running(tmp_path):
    # A sitecustomize that hides matplotlib from the child process.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    result = _run(
        "bench",
        "g2h",
        "--quick",
        "--plot",
        str(tmp_path / "x.png"),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 2
    assert result.stderr.endswith(
        "python -m torchshard bench: error: bench --plot needs matplotlib, which is not "
        "installed; install the optional extra with `pip install 'torchshard[plot]'` (or `pip "
        "install matplotlib`).\n"
    )
    assert "g2h" not in result.stdout
