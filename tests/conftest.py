"""Test set-up. The 8 CPU-emulated SPMD devices come from torchshard's own pytest plugin
(``torchshard.testing._plugin``, entry point ``pytest11``; ini ``spmd_devices`` in
pyproject.toml), which configures torch_xla before this file is imported."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

import torchshard as ts

# Hypothesis profiles, chosen with --hypothesis-profile (pyproject.toml's addopts picks "ci").
# "ci": the same examples on every run (derandomized, no example database), so that a red run
# is reproduced by running it again; a failure prints the reproduction blob. "explore": new
# random examples each run, for hunting bugs locally (pytest --hypothesis-profile=explore).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)


@pytest.fixture
def mesh8():
    """Mesh (8,), axis "data"."""
    with ts.Mesh(np.arange(8), ("data",)) as m:
        yield m


@pytest.fixture
def mesh42():
    """Mesh (4, 2), axes ("data", "model")."""
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
