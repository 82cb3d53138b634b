"""The stacks' imports, with the error that names what to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from torchshard._core.errors import MissingDependencyError

INSTALL_STACKS = "pip install 'torchshard[stacks]'"


def require(module: str, package: str, feature: str) -> ModuleType:
    """``module`` imported, or ``MissingDependencyError`` naming ``package`` and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(
            f"{feature} needs {package}, which is not installed or cannot be imported ({e}); "
            f"install it (`pip install {package}`, or `{INSTALL_STACKS}` for every stack "
            "torchshard integrates with)."
        ) from e
