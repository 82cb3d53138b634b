"""``torchshard.__version__``: the installed distribution's version, from its metadata.

Read with ``importlib.metadata`` (the version in ``pyproject.toml`` at install time). A source
tree that is imported without being installed (``PYTHONPATH`` on a checkout) has no metadata:
its version reads ``0+unknown`` rather than failing the import.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "torchshard"
UNKNOWN = "0+unknown"


def package_version(distribution: str = DISTRIBUTION) -> str:
    """The version of ``distribution`` from its installed metadata, or ``UNKNOWN``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN


__version__ = package_version()
