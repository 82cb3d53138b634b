"""Optional dependencies: ``rich`` (terminal tables, progress) and ``matplotlib`` (PNGs).

``rich`` is used when it is installed (plain text otherwise); matplotlib is the optional extra
``plot``, and a feature that needs it says so. Standard library only.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from torchshard._core.errors import MissingDependencyError
from torchshard._core.version import pip_install


def has_rich() -> bool:
    """Whether ``rich`` can be imported."""
    try:
        return importlib.util.find_spec("rich") is not None
    except ValueError:  # a module set to None in sys.modules (tests hide it that way)
        return False


def require_matplotlib(feature: str) -> Any:
    """``matplotlib`` (with the Agg canvas importable), or a clear error naming ``feature``."""
    try:
        import matplotlib
        import matplotlib.backends.backend_agg
        import matplotlib.figure
    except ImportError:
        raise MissingDependencyError(
            f"{feature} needs matplotlib, which is not installed; install the optional extra "
            f"with {pip_install('plot')}, or `pip install matplotlib`."
        ) from None
    return matplotlib


def require_rich(feature: str) -> Any:
    """``rich``, or a clear error naming ``feature``."""
    try:
        import rich
    except ImportError:
        raise MissingDependencyError(
            f"{feature} needs rich, which is not installed; install the optional extra with "
            f"{pip_install('pretty')}, or `pip install rich`."
        ) from None
    return rich
