"""Test set-up. The 8 CPU-emulated SPMD devices come from torchshard's own pytest plugin
(``torchshard.testing._spmd``, registered by its gate, the entry point ``pytest11``, as the ini
option ``spmd_devices`` in pyproject.toml asks), which configures torch_xla before this file is
imported.

Without torch_xla (a plain install: torch and DTensor only) the XLA tests skip, saying why: a
test module that imports torch_xla is skipped whole when collected (``xla_module`` below), and
the ``mesh8``/``mesh42`` fixtures and the ``xla`` marker skip single tests of mixed modules;
the pure and DTensor tests run. ``-p no:torchshard`` (a real TPU) keeps the ini option and the
``spmd`` marker known, and skips ``@pytest.mark.spmd`` tests."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from hypothesis import settings

import torchshard as ts
from torchshard._backend.xla.env import INSTALL_XLA, xla_installed

# The test modules live in folders that mirror the package (tests/core/, tests/place/, ...) and
# are imported by path (--import-mode=importlib, pyproject.toml), which leaves sys.path alone;
# the helpers they share (helpers.py, data_helpers.py, sharding_oracle.py, strategies.py,
# _multiproc.py and the gloo case modules) stay here, in tests/, imported by name. The gloo
# workers find the case modules the same way: they run tests/_multiproc.py, whose folder is
# their sys.path[0].
HELPERS = str(pathlib.Path(__file__).resolve().parent)
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

XLA = xla_installed()
NO_XLA = f"needs torch_xla, which is not installed ({INSTALL_XLA})"
NO_PLUGIN = "needs the torchshard pytest plugin, disabled by -p no:torchshard"

# Hypothesis profiles, chosen with --hypothesis-profile (pyproject.toml's addopts picks "ci").
# "ci": the same examples on every run (derandomized, no example database), so that a red run
# is reproduced by running it again; a failure prints the reproduction blob. "explore": new
# random examples each run, for hunting bugs locally (pytest --hypothesis-profile=explore).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)


def pytest_addoption(parser, pluginmanager):
    if pluginmanager.is_blocked("torchshard"):  # -p no:torchshard: keep its ini option known
        kind = {"type": "int"} if pytest.version_tuple >= (8, 4) else {}
        parser.addini("spmd_devices", "unused: the torchshard plugin is disabled", **kind)


def pytest_configure(config):
    config.addinivalue_line("markers", f"xla: the test {NO_XLA.removeprefix('needs ')}")
    if config.pluginmanager.is_blocked("torchshard"):
        config.addinivalue_line("markers", f"spmd(devices): {NO_PLUGIN}")


def pytest_collection_modifyitems(config, items):
    plugin = not config.pluginmanager.is_blocked("torchshard")
    for item in items:
        if not XLA and item.get_closest_marker("xla") is not None:
            item.add_marker(pytest.mark.skip(reason=f"an XLA test: {NO_XLA}"))
        if not plugin and item.get_closest_marker("spmd") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_PLUGIN))


def xla_module(module):
    """Skips a whole test module (at collection) when torch_xla is not installed; call it
    first thing in a module that imports torch_xla (``xla_module(__name__)``)."""
    if not XLA:
        pytest.skip(f"{module}: XLA tests: {NO_XLA}", allow_module_level=True)


@pytest.fixture
def mesh8():
    """Mesh (8,), axis "data"."""
    if not XLA:
        pytest.skip(f"an XLA mesh: {NO_XLA}")
    with ts.Mesh(np.arange(8), ("data",)) as m:
        yield m


@pytest.fixture
def mesh42():
    """Mesh (4, 2), axes ("data", "model")."""
    if not XLA:
        pytest.skip(f"an XLA mesh: {NO_XLA}")
    with ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model")) as m:
        yield m


@pytest.fixture(autouse=True)
def _no_leaked_context():
    """Every test leaves no mesh entered and no virtual topology installed."""
    from torchshard.testing._virtual import is_virtual

    assert ts.current_mesh() is None and not is_virtual()
    yield
    assert ts.current_mesh() is None, "a test left a mesh entered"
    assert not is_virtual(), "a test left virtual_hosts installed"


@pytest.fixture
def fresh_deprecations():
    """Forgets which once-per-process deprecation warnings were issued, before and after."""
    from torchshard._core import deprecation as _deprecation

    _deprecation.reset()
    yield
    _deprecation.reset()


@pytest.fixture(scope="session")
def pools():
    """Pools of real gloo worker processes (``tests/_multiproc.py``), one per world size,
    started on first use and shared by every test module, stopped at the end of the session."""
    from _multiproc import Pools

    p = Pools()
    yield p
    p.close()
