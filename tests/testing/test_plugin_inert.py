"""The pytest plugin where it must stay out of the way: in a project that did not ask for it
(installed, it imports nothing heavy and changes nothing), without torch_xla (a plain install,
on any torch), and with ``-p no:torchshard`` in this repository. Each run is a fresh
interpreter (torch_xla is hidden with ``sys.modules["torch_xla"] = None``, as on a machine
without it)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
GATE = REPO / "_torchshard_pytestplugin.py"
HIDE_XLA = (
    "import sys; sys.modules['torch_xla'] = None; import pytest; "
    "raise SystemExit(pytest.main(sys.argv[1:]))"
)


def _emulation_var(name: str) -> bool:
    """What the plugin (torchshard's CPU emulation) and torch_xla set in a process."""
    return name.startswith(("PJRT_", "XLA_")) or name in ("CPU_NUM_DEVICES", "TF_CPP_MIN_LOG_LEVEL")


ASKED = """
    import os

    import pytest


    def test_unrelated():
        # The plugin set nothing up: no emulated XLA devices in this process.
        assert "PJRT_DEVICE" not in os.environ and "CPU_NUM_DEVICES" not in os.environ


    @pytest.mark.spmd(devices=[4, 8])
    def test_counts(spmd_devices):
        raise AssertionError("must not run without torch_xla")


    def test_mesh_fixture(make_mesh):
        raise AssertionError("must not run without torch_xla")
"""

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


@functools.cache
def _site() -> pathlib.Path:
    """A folder with this checkout's entry point (a dist-info whose ``pytest11`` entry point
    ``torchshard`` is the gate), first on the children's path: pytest loads the first entry
    point of a name, so the runs below see this checkout's plugin also where the environment
    has torchshard installed from an older checkout (whose entry point imports torch)."""
    site = pathlib.Path(tempfile.mkdtemp(prefix="torchshard-site-"))
    info = site / "torchshard_input-0.1.0.dist-info"
    info.mkdir()
    metadata = "Metadata-Version: 2.1\nName: torchshard-input\nVersion: 0.1.0\n"
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(f"[pytest11]\ntorchshard = {_pyproject_gate()}\n")
    return site


def _pyproject_gate() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["pytest11"]["torchshard"]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without what this suite's plugin and torch_xla set in it,
    with this checkout (and its entry point) first on the path."""
    env = {k: v for k, v in os.environ.items() if not _emulation_var(k)}
    env.pop("PYTHONWARNINGS", None)
    path = [str(_site()), str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra)
    return env


def test_the_entry_point_is_the_gate():
    """pyproject.toml's entry point names the gate, a top-level module it installs; where this
    checkout is the installed one, the installed entry point names it too (an environment
    installed before the gate existed names torchshard.testing._plugin: reinstall)."""
    assert _pyproject_gate() == "_torchshard_pytestplugin"
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


def _run_unrelated(tmp_path, *args, ini: str | None = None, conftest: str | None = None):
    (tmp_path / "test_unrelated.py").write_text(textwrap.dedent(UNRELATED))
    if ini is not None:
        (tmp_path / "pytest.ini").write_text(ini)
    if conftest is not None:
        (tmp_path / "conftest.py").write_text(conftest)
    seen = tmp_path / "seen.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", *args],
        cwd=tmp_path,
        env=_env(SEEN=str(seen)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(seen.read_text()), run.stdout


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
    ("args", "ini", "how"),
    [
        (("-p", "torchshard"), None, "-p torchshard"),
        (("--spmd-devices=4",), None, "--spmd-devices"),
        ((), "[pytest]\nspmd_devices = 2\n", "the ini option spmd_devices"),
        (("-o", "spmd_devices=2"), None, "the ini option spmd_devices"),
    ],
)
def test_a_project_that_asks_gets_the_plugin(tmp_path, args, ini, how):
    seen, out = _run_unrelated(tmp_path, *args, ini=ini)
    assert seen["active"] is True and "torchshard" in seen["modules"]
    import torchshard._backend.xla.env as env

    if env.xla_installed():
        count = {"--spmd-devices=4": "4"}.get(args[0] if args else "", "8")
        if ini or "-o" in args:
            count = "2"
        assert "CPU_NUM_DEVICES" in seen["environment"] and "PJRT_DEVICE" in seen["environment"]
        assert f"torchshard: {count} CPU-emulated SPMD devices (asked for by {how})" in out
    else:
        assert seen["environment"] == []
        assert "torchshard plugin: torch_xla is not installed" in out


def test_a_conftest_that_lists_the_plugin_turns_it_on(tmp_path):
    seen, out = _run_unrelated(tmp_path, conftest='pytest_plugins = ["torchshard"]\n')
    assert seen["active"] is True and "torchshard" in seen["modules"]
    assert "(asked for by pytest_plugins)" in out or "torch_xla is not installed" in out


def test_without_torch_xla_the_plugin_is_inert_and_spmd_tests_skip(tmp_path):
    (tmp_path / "test_asked.py").write_text(textwrap.dedent(ASKED))
    (tmp_path / "pytest.ini").write_text("[pytest]\nspmd_devices = 8\n")
    run = subprocess.run(
        [sys.executable, "-c", HIDE_XLA, "-W", "error", "-p", "no:cacheprovider", "-rs"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    reason = (
        "torchshard plugin: torch_xla is not installed, so there are no emulated SPMD devices "
        "(`pip install 'torchshard-input[xla]'` (from a checkout: `pip install -e '.[xla]'`) "
        "installs it)"
    )
    assert f"{reason}; @pytest.mark.spmd tests skip" in out  # the report header
    assert "1 passed, 3 skipped" in out
    assert f"SKIPPED [2] test_asked.py:12: {reason}" in out  # the spmd4 and spmd8 items
    assert f"SKIPPED [1] test_asked.py:17: {reason}" in out  # make_mesh


def test_no_torchshard_keeps_the_ini_option_known_in_this_repo():
    """``-p no:torchshard`` (on a real TPU): no required plugin is missing, and the ini option
    ``spmd_devices`` stays known, so ``filterwarnings = error`` finds nothing to fail."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:torchshard", "-q", "tests/core/test_spec.py"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert " passed" in run.stdout and "warning" not in run.stdout.lower()


def test_stateful_dataloader_runs_under_filterwarnings_error():
    """torchdata's StatefulDataLoader calls ``torch.set_vital``, which torch 2.15 deprecates:
    pyproject.toml ignores that one warning (by message, category and module) and no other."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    batches = [b.tolist() for b in StatefulDataLoader(list(range(6)), batch_size=3)]
    assert batches == [[0, 1, 2], [3, 4, 5]]
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["filterwarnings"] == [
        "error",
        (
            "ignore:'set_vital' is deprecated:UserWarning:"
            "torchdata.stateful_dataloader.stateful_dataloader"
        ),
        "ignore:.*TPUs have no 64-bit floats",  # torchshard's Float64Warning (test_validate.py)
    ]
