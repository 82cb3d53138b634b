"""The optional libraries (torchshard._core.optional): whether one can be imported, importing
it, and the ``MissingDependencyError`` that names what to install: the library and the extra,
from the distribution's real name (rich and matplotlib have an extra each, the stacks share
one)."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import torchshard as ts
from torchshard._core import optional
from torchshard._core.optional import MissingDependencyError


def test_a_missing_stack_names_what_to_install():
    with pytest.raises(
        ts.errors.MissingDependencyError,
        match=re.escape(
            "torchshard.integrations.nothing needs no-such-stack, which is not installed or "
            "cannot be imported (No module named 'no_such_stack_x'); install it (`pip install "
            "no-such-stack`, or `pip install 'torchshard-input[stacks]'` (from a checkout: "
            "`pip install -e '.[stacks]'`) for every stack torchshard integrates with)."
        ),
    ) as caught:
        optional.require(
            "no_such_stack_x",
            "torchshard.integrations.nothing",
            extra="stacks",
            package="no-such-stack",
        )
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)  # a stack's error chains


def test_a_present_module_is_returned():
    import json

    assert optional.require("json", "x", extra="stacks") is json
    assert optional.require("json", "x", extra="plot", also=("json.decoder",)) is json


def test_the_package_named_is_the_top_level_module_unless_given():
    with pytest.raises(MissingDependencyError, match=r"^f needs no_such_lib_x, which is not "):
        optional.require("no_such_lib_x.sub", "f", extra="plot")


def test_a_missing_submodule_it_also_needs_raises_the_same_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "json.decoder", None)
    with pytest.raises(
        MissingDependencyError,
        match=re.escape("f needs json, which is not installed; install the optional extra"),
    ):
        optional.require("json", "f", extra="plot", also=("json.decoder",))


def test_available_follows_what_can_be_imported(monkeypatch):
    assert optional.available("json") is True
    assert optional.available("no_such_lib_x") is False
    assert optional.available("no_such_lib_x.sub") is False  # its package is missing
    monkeypatch.setitem(sys.modules, "json", None)  # hidden, as the tests hide a library
    assert optional.available("json") is False


def test_available_finds_rich_unless_hidden(monkeypatch):
    pytest.importorskip("rich")
    assert optional.available("rich") is True
    monkeypatch.setitem(sys.modules, "rich", None)  # hidden, as the tests hide it
    assert optional.available("rich") is False


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
