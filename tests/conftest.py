"""Test set-up. The 8 CPU-emulated SPMD devices come from torchshard's own pytest plugin
(``torchshard.testing._plugin``, entry point ``pytest11``; ini ``spmd_devices`` in
pyproject.toml), which configures torch_xla before this file is imported."""

from __future__ import annotations

import numpy as np
import pytest

import torchshard as ts


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
    from torchshard._topology import is_virtual

    assert ts.current_mesh() is None and not is_virtual()
    yield
    assert ts.current_mesh() is None, "a test left a mesh entered"
    assert not is_virtual(), "a test left virtual_hosts installed"


@pytest.fixture
def fresh_deprecations():
    """Forgets which once-per-process deprecation warnings were issued, before and after."""
    from torchshard import _deprecation

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
