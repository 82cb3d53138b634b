"""The plugin's gate (``_torchshard_pytestplugin``, the ``pytest11`` entry point ``torchshard``,
a top-level module outside the package): in a project that did not ask for the plugin it stays
out of the way (installed, it imports nothing heavy and changes nothing); a project asks by the
ini option, ``-o``, ``--spmd-devices``, ``-p torchshard`` or a conftest's ``pytest_plugins``,
and gets the device count it asked for (the command line over the ini file); a bad count is a
usage error before torch is imported; ``-p no:torchshard`` in this repository. Each run is a
fresh interpreter (tests/pytest_projects.py). That the gate and the plugin import no circle:
tests/cross/test_layers.py."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
import tomllib

import pytest
import pytest_projects

REPO = pytest_projects.REPO
GATE = REPO / "_torchshard_pytestplugin.py"

# A project that knows nothing of torchshard: what its test process sees.
UNRELATED = """
    import json
    import os
    import sys

    HEAVY = ("torch", "torch_xla", "torchshard", "numpy")


    def test_records_what_it_sees(pytestconfig):
        seen = {
            "environment": sorted(
                k for k in os.environ if k.startswith(("PJRT_", "XLA_")) or k == "CPU_NUM_DEVICES"
            ),
            "modules": [m for m in HEAVY if m in sys.modules],
            "gate": pytestconfig.pluginmanager.get_plugin("torchshard").__name__,
            "active": pytestconfig.pluginmanager.has_plugin("torchshard-spmd"),
            "options": pytestconfig.getoption("spmd_devices"),
        }
        with open(os.environ["SEEN"], "w") as f:
            json.dump(seen, f)
"""

# Beside it, in a project that asks: the count the fixture reports, and the runtime's.
COUNT = """
    import os

    import torchshard as ts


    def test_count(spmd_devices):
        want = int(os.environ["WANT"])
        assert spmd_devices == want
        assert ts.create_device_mesh((-1,), ("data",)).size == want
"""

# pytest in a process that then says whether torch was imported (a usage error ends the run
# before any test could record it).
REPORTS_TORCH = (
    "import sys, pytest; code = pytest.main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules); raise SystemExit(code)"
)


def test_the_entry_point_is_the_gate():
    """pyproject.toml's entry point names the gate, a top-level module it installs; where this
    checkout is the installed one, the installed entry point names it too (an environment
    installed before the gate existed names torchshard.testing._plugin: reinstall)."""
    assert pytest_projects.pyproject_gate() == "_torchshard_pytestplugin"
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["py-modules"] == ["_torchshard_pytestplugin"]
    try:
        dist = importlib.metadata.distribution("torchshard-input")
    except importlib.metadata.PackageNotFoundError:
        return  # installed under the old name from another checkout (or not at all)
    (ep,) = [e for e in dist.entry_points if e.group == "pytest11"]
    assert ep.value == "_torchshard_pytestplugin", "stale install: pip install -e '.[xla,test]'"


def test_the_gate_imports_only_the_standard_library_and_pytest():
    tree = ast.parse(GATE.read_text())
    top = set()
    for node in tree.body:  # module level; torchshard is imported inside _decide, when asked
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add((node.module or "").split(".")[0])
    assert top - set(sys.stdlib_module_names) == {"pytest"}


def _run_unrelated(tmp_path, *args, ini=None, conftest=None, want=None):
    """The unrelated project (and, with ``want``, the count test, expecting ``want``
    devices), run with ``args``."""
    files = {"test_unrelated.py": UNRELATED}
    if want is not None:
        files["test_count.py"] = COUNT
    if ini is not None:
        files["pytest.ini"] = ini
    if conftest is not None:
        files["conftest.py"] = conftest
    project = pytest_projects.write(tmp_path, files)
    seen = tmp_path / "seen.json"
    extra = {"WANT": str(want)} if want is not None else {}
    env = pytest_projects.environment(SEEN=str(seen), **extra)
    run = pytest_projects.run(project, "-W", "error", *args, env=env)
    out = "\n".join(run.outlines)
    assert run.ret == 0, out + "\n".join(run.errlines)
    return json.loads(seen.read_text()), out


def test_an_unrelated_project_sees_no_torchshard(tmp_path):
    """Installed but not asked for: no torch import, no environment variable, no header."""
    seen, out = _run_unrelated(tmp_path)
    assert seen == {
        "environment": [],
        "modules": [],
        "gate": "_torchshard_pytestplugin",
        "active": False,
        "options": None,
    }
    assert "torchshard" not in out.split("collected")[0].replace("torchshard-input", "")


@pytest.mark.parametrize(
    ("args", "ini", "how", "count"),
    [
        (("-p", "torchshard"), None, "-p torchshard", 8),
        (("--spmd-devices=4",), None, "--spmd-devices", 4),
        ((), "[pytest]\nspmd_devices = 4\n", "the ini option spmd_devices", 4),
        (("-o", "spmd_devices=2"), None, "the ini option spmd_devices", 2),
        # The command line over the ini file.
        (("--spmd-devices=2",), "[pytest]\nspmd_devices = 4\n", "--spmd-devices", 2),
    ],
    ids=["p", "command-line", "ini", "o", "command-line-over-ini"],
)
def test_a_project_that_asks_gets_the_plugin_with_its_count(tmp_path, args, ini, how, count):
    seen, out = _run_unrelated(tmp_path, "-rs", *args, ini=ini, want=count)
    assert seen["active"] is True and "torchshard" in seen["modules"]
    import torchshard._backend.xla.env as env

    if env.xla_installed():
        assert "CPU_NUM_DEVICES" in seen["environment"] and "PJRT_DEVICE" in seen["environment"]
        assert f"torchshard: {count} CPU-emulated SPMD devices (asked for by {how})" in out
        assert "2 passed" in out  # the count test: the fixture's count and the runtime's
    else:
        assert seen["environment"] == []
        assert "torchshard plugin: torch_xla is not installed" in out


def test_a_conftest_that_lists_the_plugin_turns_it_on(tmp_path):
    seen, out = _run_unrelated(tmp_path, conftest='pytest_plugins = ["torchshard"]\n')
    assert seen["active"] is True and "torchshard" in seen["modules"]
    assert "(asked for by pytest_plugins)" in out or "torch_xla is not installed" in out


@pytest.mark.parametrize(
    ("args", "ini", "error"),
    [
        (("--spmd-devices=0",), None, "--spmd-devices must be a positive device count, but got 0"),
        (
            (),
            "[pytest]\nspmd_devices = -2\n",
            "ini option spmd_devices must be a positive device count, but got -2",
        ),
    ],
    ids=["command-line", "ini"],
)
def test_a_count_that_is_no_positive_int_is_a_usage_error_before_torch_is_imported(
    tmp_path, args, ini, error
):
    files = {"test_unrelated.py": UNRELATED} | ({"pytest.ini": ini} if ini else {})
    project = pytest_projects.write(tmp_path, files)
    run = pytest_projects.run(project, *args, python=("-c", REPORTS_TORCH))
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: torchshard: {error}." in run.errlines, run.errlines
    assert run.outlines[-1] == "torch imported: False"


def test_no_torchshard_keeps_the_ini_option_known_in_this_repo():
    """``-p no:torchshard`` (on a real TPU): no required plugin is missing, and the ini option
    ``spmd_devices`` stays known, so ``filterwarnings = error`` finds nothing to fail."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:torchshard", "-q", "tests/core/test_spec.py"],
        cwd=REPO,
        env=pytest_projects.environment(),
        capture_output=True,
        text=True,
        timeout=pytest_projects.TIMEOUT,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert " passed" in run.stdout and "warning" not in run.stdout.lower()
