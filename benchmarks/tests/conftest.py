"""Set-up of the lab's tests (``benchmarks/tests/``), run by the suite (``testpaths``) or alone
(``pytest benchmarks``).

The checkout's root goes on ``sys.path`` (the lab is imported as ``benchmarks``, from a checkout,
never installed), and ``tests/`` too, for the helpers the suite shares (``helpers.py``) and the
bench fixtures (``bench_helpers``: ``quick``, ``stub_measure``). The 8 emulated devices come from
the torchshard pytest plugin, as for the suite; without torch_xla the tests marked ``xla`` skip,
saying why, and every test must leave no mesh entered (as ``tests/conftest.py`` checks there).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from hypothesis import settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
for path in (str(ROOT), str(ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_helpers import quick, stub_measure  # noqa: E402

import torchshard as ts  # noqa: E402
from torchshard._backend.xla.env import INSTALL_XLA, xla_installed  # noqa: E402

__all__ = ["mesh8", "quick", "stub_measure"]

LAB = ROOT / "benchmarks"
XLA = xla_installed()
NO_XLA = f"needs torch_xla, which is not installed (`{INSTALL_XLA}`)"

# pyproject.toml's addopts pick the Hypothesis profile "ci", which tests/conftest.py registers;
# registered here too for a run of the lab alone (the same settings).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)


def pytest_configure(config):
    config.addinivalue_line("markers", f"xla: the test {NO_XLA.removeprefix('needs ')}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        in_lab = LAB in pathlib.Path(item.path).parents
        if in_lab and not XLA and item.get_closest_marker("xla") is not None:
            item.add_marker(pytest.mark.skip(reason=f"an XLA test: {NO_XLA}"))


@pytest.fixture
def mesh8():
    """Mesh (8,), axis "data"."""
    if not XLA:
        pytest.skip(f"an XLA mesh: {NO_XLA}")
    with ts.Mesh(np.arange(8), ("data",)) as m:
        yield m


@pytest.fixture(autouse=True)
def _no_leaked_context():
    """Every test leaves no mesh entered."""
    assert ts.current_mesh() is None
    yield
    assert ts.current_mesh() is None, "a test left a mesh entered"
