"""``torchshard.__version__``: the installed distribution's version, from its metadata.

Read with ``importlib.metadata`` (the version in ``pyproject.toml`` at install time). A source
tree that is imported without being installed (``PYTHONPATH`` on a checkout) has no metadata:
its version reads ``0+unknown`` rather than failing the import.
"""

from __future__ import annotations

from importlib import metadata

# The distribution's name on the package index (docs/design.md, "The distribution's name"):
# the index's "torchshard" is another project. The import name stays ``torchshard``.
DISTRIBUTION = "torchshard-input"
UNKNOWN = "0+unknown"


def pip_install(extra: str) -> str:
    """The command that installs this project with ``extra``, from the index and from a
    checkout, as a message says it: ``pip install 'torchshard-input[xla]'`` (from a
    checkout: ``pip install -e '.[xla]'``)."""
    return (
        f"`pip install '{DISTRIBUTION}[{extra}]'` (from a checkout: `pip install -e '.[{extra}]'`)"
    )


def package_version(distribution: str = DISTRIBUTION) -> str:
    """The version of ``distribution`` from its installed metadata, or ``UNKNOWN``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN


__version__ = package_version()
