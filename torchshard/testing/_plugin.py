"""0.1.0's private path of the pytest plugin, kept as a shim: the gate's hooks.

An environment installed before the gate existed has the ``pytest11`` entry point
``torchshard = torchshard.testing._plugin``, and a conftest may list
``pytest_plugins = ["torchshard.testing._plugin"]``. Either registers this module, whose hooks
are the gate's (``_torchshard_pytestplugin``): they decide, as the gate does, whether the project
asked for the plugin, and then register its body, ``torchshard.testing._spmd``. Nothing in
torchshard imports this module.
"""

from __future__ import annotations

from _torchshard_pytestplugin import pytest_addoption as pytest_addoption
from _torchshard_pytestplugin import pytest_configure as pytest_configure
from _torchshard_pytestplugin import (
    pytest_load_initial_conftests as pytest_load_initial_conftests,
)
