"""The pytest plugin where it must stay out of the way: without torch_xla (a plain install, on
any torch), and with ``-p no:torchshard`` in this repository. Each run is a fresh interpreter
(torch_xla is hidden with ``sys.modules["torch_xla"] = None``, as on a machine without it)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]
HIDE_XLA = (
    "import sys; sys.modules['torch_xla'] = None; import pytest; "
    "raise SystemExit(pytest.main(sys.argv[1:]))"
)

UNRELATED = """
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


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    env.pop("PYTHONWARNINGS", None)
    return env


def test_without_torch_xla_the_plugin_is_inert_and_spmd_tests_skip(tmp_path):
    (tmp_path / "test_unrelated.py").write_text(textwrap.dedent(UNRELATED))
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
        "(`pip install 'torchshard[xla]'` installs it)"
    )
    assert f"{reason}; @pytest.mark.spmd tests skip" in out  # the report header
    assert "1 passed, 3 skipped" in out
    assert f"SKIPPED [2] test_unrelated.py:12: {reason}" in out  # the spmd4 and spmd8 items
    assert f"SKIPPED [1] test_unrelated.py:17: {reason}" in out  # make_mesh


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
    ]
