"""``torchshard.__version__`` (torchshard._core.version): the installed distribution's version
from its metadata, and ``0+unknown`` for a source tree imported without being installed. The
CLI's ``--version`` is tested in tests/tools/test_cli.py."""

import re
from importlib import metadata

import torchshard as ts
from torchshard._core import version


def test_the_version_is_the_installed_distributions():
    # The import name is torchshard; the distribution is torchshard-input, as the index's
    # "torchshard" is an unrelated project.
    assert version.DISTRIBUTION == "torchshard-input"
    assert version.__version__ == metadata.version("torchshard-input") == ts.__version__
    assert version.package_version() == version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version.__version__)


def test_a_distribution_without_metadata_reads_unknown(monkeypatch):
    assert version.UNKNOWN == "0+unknown"
    assert version.package_version("torchshard-no-such-distribution") == "0+unknown"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert version.package_version() == "0+unknown"  # a checkout on PYTHONPATH: no failure


def test_other_distributions_are_read_the_same_way():
    assert version.package_version("numpy") == metadata.version("numpy")
