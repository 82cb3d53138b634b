"""Optional dependencies: whether one can be imported, importing it, and the error that names what
to install.

One helper for every optional library torchshard uses: ``rich`` (terminal tables, extra ``pretty``),
matplotlib (PNGs, extra ``plot``), the stacks of ``torchshard.integrations`` (lightning, accelerate,
torchtitan: extra ``stacks``), psutil (``python -m benchmarks soak``, extra ``test``). Each is
imported only when a feature asks for it; the error is ``MissingDependencyError`` and its install
command comes from ``version.pip_install`` (the distribution's real name, ``torchshard-input``, and
the command from a checkout). Standard library only."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType

from torchshard._core.errors import MissingDependencyError
from torchshard._core.version import pip_install

# The extras of pyproject.toml that bring several libraries: the error offers the library
# itself first, then the extra for all of them.
BUNDLES = {"stacks": "every stack torchshard integrates with"}
# What the PNG writers import from matplotlib besides the package (they draw off screen).
MATPLOTLIB_AGG = ("matplotlib.backends.backend_agg", "matplotlib.figure")


def available(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def missing(feature: str, package: str, extra: str, error: ImportError) -> MissingDependencyError:
    """The error of ``feature``, which needs ``package`` (installed by the extra ``extra``),
    when importing it raised ``error``."""
    if extra in BUNDLES:
        return MissingDependencyError(
            f"{feature} needs {package}, which is not installed or cannot be imported "
            f"({error}); install it (`pip install {package}`, or {pip_install(extra)} for "
            f"{BUNDLES[extra]})."
        )
    return MissingDependencyError(
        f"{feature} needs {package}, which is not installed; install the optional extra with "
        f"{pip_install(extra)}, or `pip install {package}`."
    )


def require(
    module: str,
    feature: str,
    *,
    extra: str,
    package: str | None = None,
    also: Sequence[str] = (),
) -> ModuleType:
    """``module`` imported (and the modules ``also``, which ``feature`` needs too), or
    ``MissingDependencyError`` naming ``feature``, ``package`` (the distribution to install;
    by default ``module``'s top-level name) and the extra ``extra``.

    The error of a library that is one extra's (``plot``, ``pretty``) hides the import error it
    replaces; that of a stack (``stacks``) quotes it and chains it, since a stack that is
    installed may fail to import (built for another torch).

    Example:
        >>> from torchshard._core.optional import require
        >>> require("json", "a feature", extra="test").__name__
        'json'
    """
    package = package or module.split(".")[0]
    try:
        found = importlib.import_module(module)
        for name in also:
            importlib.import_module(name)
    except ImportError as e:
        error = missing(feature, package, extra, e)
        if extra in BUNDLES:
            raise error from e
        raise error from None
    return found


def require_matplotlib(feature: str) -> ModuleType:
    """``matplotlib``, with the Agg canvas importable, or the error naming ``feature``."""
    return require("matplotlib", feature, extra="plot", also=MATPLOTLIB_AGG)


def require_rich(feature: str) -> ModuleType:
    """``rich``, or the error naming ``feature``."""
    return require("rich", feature, extra="pretty")
