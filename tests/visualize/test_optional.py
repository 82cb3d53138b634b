"""The optional libraries (torchshard._visualize.optional): rich when installed, plain text
otherwise; matplotlib for PNGs, and the errors that name the extra to install."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import torchshard as ts
from torchshard._visualize import optional
from torchshard._visualize.optional import MissingDependencyError

MESH42 = np.arange(8).reshape(4, 2)


def test_save_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    layout = ts.describe_layout(ts.Mesh(np.arange(8), ("data",)), ts.P("data"), (8,), num_hosts=1)
    with pytest.raises(
        MissingDependencyError,
        match=re.escape(
            "ShardingLayout.save_png needs matplotlib, which is not installed; install the "
            "optional extra with `pip install 'torchshard-input[plot]'` (from a checkout: "
            "`pip install -e '.[plot]'`), or `pip install matplotlib`."
        ),
    ):
        layout.save_png(str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_has_rich_follows_what_can_be_imported(monkeypatch):
    pytest.importorskip("rich")
    assert optional.has_rich() is True
    monkeypatch.setitem(sys.modules, "rich", None)  # hidden, as the tests hide it
    assert optional.has_rich() is False


def test_require_rich_returns_rich_or_names_the_extra(monkeypatch):
    rich = pytest.importorskip("rich")
    assert optional.require_rich("visualize_sharding(use_rich=True)") is rich
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(
        MissingDependencyError,
        match=re.escape(
            "visualize_sharding(use_rich=True) needs rich, which is not installed; install the "
            "optional extra with `pip install 'torchshard-input[pretty]'` (from a checkout: "
            "`pip install -e '.[pretty]'`), or `pip install rich`."
        ),
    ):
        optional.require_rich("visualize_sharding(use_rich=True)")


def test_require_matplotlib_returns_matplotlib_or_names_the_extra(monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    assert optional.require_matplotlib("bench --plot") is matplotlib
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # no Agg canvas
    with pytest.raises(
        MissingDependencyError,
        match=re.escape(
            "bench --plot needs matplotlib, which is not installed; install the optional extra "
            "with `pip install 'torchshard-input[plot]'` (from a checkout: `pip install -e "
            "'.[plot]'`), or `pip install matplotlib`."
        ),
    ) as caught:
        optional.require_matplotlib("bench --plot")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert issubclass(MissingDependencyError, ImportError)
