"""Small pytest projects, each run in a fresh interpreter, for the tests of the plugin, its gate
and its old path (tests/testing/): the environment without what this suite's plugin and
torch_xla set in it, this checkout's entry point first on the path, and the run's result as
pytester's ``RunResult`` (``assert_outcomes``, ``stdout.re_match_lines``).

A run of its own costs a fresh interpreter and, where the project asks for the plugin, torch's
and torch_xla's imports (seconds each): the tests run one project for every check that needs
the same configuration."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SHIM = "torchshard.testing._plugin"  # 0.1.0's entry point: the gate's hooks, re-exported
TIMEOUT = 300


def pyproject_gate() -> str:
    """The module pyproject.toml's ``pytest11`` entry point ``torchshard`` names (the gate)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["pytest11"]["torchshard"]


def emulation_var(name: str) -> bool:
    """What the plugin (torchshard's CPU emulation) and torch_xla set in a process."""
    return name.startswith(("PJRT_", "XLA_")) or name in ("CPU_NUM_DEVICES", "TF_CPP_MIN_LOG_LEVEL")


@functools.cache
def site(entry_point: str | None = None) -> pathlib.Path:
    """A folder with a dist-info whose ``pytest11`` entry point ``torchshard`` names
    ``entry_point`` (by default the gate, as pyproject.toml says), first on the children's
    path: pytest loads the first entry point of a name, so the runs see this checkout's plugin
    also where the environment has torchshard installed from an older checkout (whose entry
    point imports torch), and an entry point that names the old path where one is asked for."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="torchshard-site-"))
    info = folder / "torchshard_input-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchshard-input\nVersion: 0.1.0\n"
    )
    entry = entry_point or pyproject_gate()
    (info / "entry_points.txt").write_text(f"[pytest11]\ntorchshard = {entry}\n")
    return folder


def environment(*, entry_point: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment without what this suite's plugin and torch_xla set in it,
    with this checkout (and its entry point) first on the path."""
    env = {k: v for k, v in os.environ.items() if not emulation_var(k)}
    for name in ("PYTHONWARNINGS", "PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        env.pop(name, None)
    path = [str(site(entry_point)), str(REPO)]
    path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["PY_COLORS"] = "0"
    env.update(extra)
    return env


def write(project: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    """Writes ``files`` (``{relative path: text}``, the text dedented) into ``project``."""
    for name, text in files.items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return project


def run(
    project: pathlib.Path,
    *args: str,
    env: dict[str, str] | None = None,
    python: tuple[str, ...] = ("-m", "pytest"),
) -> pytest.RunResult:
    """``python -m pytest ARGS`` (or ``python PYTHON ARGS``) in ``project``, in a fresh
    interpreter with ``environment()`` (or ``env``)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *python, "-p", "no:cacheprovider", *args],
        cwd=project,
        env=environment(HOME=str(project)) if env is None else env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    return pytest.RunResult(
        proc.returncode,
        proc.stdout.splitlines(),
        proc.stderr.splitlines(),
        time.monotonic() - start,
    )


def lines_of(result: pytest.RunResult) -> list[str]:
    """The run's output lines, without trailing spaces."""
    return [line.rstrip() for line in result.stdout.lines]
