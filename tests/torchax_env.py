"""The torchax backend's tests: whether JAX and torchax are here, and JAX's 8 CPU devices.

Without them (the main and plain venvs) the tests skip, saying what to install. With them
(CI's torchax job), JAX is given 8 CPU devices before it first starts in this process
(``XLA_FLAGS``, read once when JAX makes its CPU client); the multi-process tests start their
own JAX processes (``_jax_multiproc.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest

DEVICES = 8
NO_TORCHAX = (
    "needs jax and torchax, which are not installed "
    "(pip install 'torchshard-input[torchax]'; from a checkout: pip install -e '.[torchax]')"
)


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


TORCHAX = _found("jax") and _found("torchax")
needs_torchax = pytest.mark.skipif(not TORCHAX, reason=NO_TORCHAX)


def jax8() -> Any:
    """``jax`` with 8 CPU devices in this process (skips the test when JAX already started
    with another count)."""
    if not TORCHAX:
        pytest.skip(NO_TORCHAX)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
        ).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import torchax  # noqa: F401 -- the backend's own import, here first

    if jax.device_count() != DEVICES:
        pytest.skip(f"JAX started with {jax.device_count()} devices in this process, not 8")
    return jax
