"""The torchshard pytest plugin's gate: the ``pytest11`` entry point ``torchshard``.

Installing torchshard registers this module with every pytest run in the environment, so it
stays out of the way: it imports only the standard library and pytest, adds its options, and
does nothing else until a project asks for the plugin. A project asks with any of

- the ini option ``spmd_devices = N`` (``[tool.pytest.ini_options]``, ``pytest.ini``, ...; or
  ``-o spmd_devices=N``),
- ``--spmd-devices N`` on the command line (or in ``addopts``),
- ``-p torchshard``, or a conftest's ``pytest_plugins = ["torchshard"]`` (then set up after
  that conftest is imported, in ``pytest_configure``).

Then, and only then, it reads the device count (``--spmd-devices``, else the ini option, else
``DEFAULT_DEVICES``), imports torchshard's plugin (``torchshard.testing._spmd``: the CPU
emulation of the SPMD devices, set up before any conftest imports torch_xla; the fixtures; the
``@pytest.mark.spmd`` marker), registers it and enables it with that count. An unrelated
project's tests run untouched: no torch import, no environment variable set. A module outside
the ``torchshard`` package (like hypothesis's ``_hypothesis_pytestplugin``): importing any
``torchshard.*`` module runs ``torchshard/__init__.py``, which imports torch.

The plugin never imports this module, so the two have no circle. 0.1.0's entry point,
``torchshard.testing._plugin``, is a shim that re-exports these hooks (an environment installed
then, a conftest's ``pytest_plugins = ["torchshard.testing._plugin"]``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pytest

ENTRY_POINT = "torchshard"  # the entry point's name: `-p no:torchshard` blocks it
ACTIVE = "torchshard-spmd"  # the name the gate registers torchshard's plugin under
SHIM = "torchshard.testing._plugin"  # 0.1.0's entry point: the gate's hooks, re-exported
DEFAULT_DEVICES = 8
_ASKED = pytest.StashKey[str]()  # how the project asked (once decided)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchshard", "torchshard: CPU-emulated SPMD devices")
    try:
        group.addoption(
            "--spmd-devices",
            dest="spmd_devices",
            type=int,
            default=None,
            metavar="N",
            help=f"turn the torchshard plugin on with N CPU-emulated XLA devices (default: ini "
            f"spmd_devices; with -p torchshard alone, {DEFAULT_DEVICES}); fixed for the process",
        )
        group.addoption("--spmd-report", dest="spmd_report", default=None, help=argparse.SUPPRESS)
    except ValueError:  # added already: the plugin is registered twice (entry point + conftest)
        return
    help_ = (
        "turns the torchshard plugin on with this many CPU-emulated XLA devices (unset: the "
        "plugin does nothing)"
    )
    if pytest.version_tuple >= (8, 4):  # int ini options (so TOML may say spmd_devices = 8)
        parser.addini("spmd_devices", help_, type="int", default=None)
    else:
        parser.addini("spmd_devices", help_, default=None)


def _ini_set(config: pytest.Config) -> bool:
    try:
        value = config.getini("spmd_devices")
    except ValueError:  # not a known option: a conftest removed it; the plugin stays off
        return False
    except pytest.UsageError:  # set, but not an int: torchshard's plugin reports it
        return True
    return value not in (None, "")


def _named_explicitly(config: pytest.Config) -> bool:
    """Whether this module was registered otherwise than as the entry point (``-p`` with the
    module's name, a conftest's ``pytest_plugins``); also for the shim ``SHIM``, which
    re-exports these hooks for an environment whose entry point still names it."""
    pm = config.pluginmanager
    for name in (__name__, SHIM):
        module = sys.modules.get(name)
        if module is None or not pm.is_registered(module):
            continue
        if pm.get_name(module) not in (ENTRY_POINT, ACTIVE):
            return True
    return False


def _declared(config: pytest.Config) -> bool:
    """Whether a loaded conftest (or plugin) declares ``pytest_plugins = ["torchshard"]``."""
    for plugin in config.pluginmanager.get_plugins():
        names = getattr(plugin, "pytest_plugins", ())
        if isinstance(names, str):
            names = [names]
        if isinstance(names, list | tuple) and {ENTRY_POINT, __name__} & set(names):
            return True
    return False


def asked(config: pytest.Config, options: Any) -> str | None:
    """How the project asked for the plugin (``None``: it did not)."""
    if getattr(options, "spmd_devices", None) is not None:
        return "--spmd-devices"
    if _ini_set(config):
        return "the ini option spmd_devices"
    plugins = getattr(options, "plugins", None) or []
    if ENTRY_POINT in plugins or __name__ in plugins:
        return f"-p {ENTRY_POINT}"
    if _named_explicitly(config) or _declared(config):
        return "pytest_plugins"
    return None


def device_count(config: pytest.Config, options: Any) -> int:
    """The emulated device count the project asked for: ``--spmd-devices``, else the ini
    option ``spmd_devices``, else ``DEFAULT_DEVICES`` (``-p torchshard``, ``pytest_plugins``)."""
    value = getattr(options, "spmd_devices", None)
    where = "--spmd-devices"
    if value is None:
        where = "ini option spmd_devices"
        try:
            value = config.getini("spmd_devices")
        except ValueError as e:  # pytest's own coercion of the ini text to an int
            raise pytest.UsageError(
                f"torchshard: {where} must be a positive device count ({e})."
            ) from None
        if value in (None, ""):  # asked with -p torchshard (or pytest_plugins): the default
            return DEFAULT_DEVICES
    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if count < 1:
        raise pytest.UsageError(
            f"torchshard: {where} must be a positive device count, but got {value!r}."
        )
    return count


def _decide(config: pytest.Config, options: Any) -> None:
    if _ASKED in config.stash:
        return
    how = asked(config, options)
    if how is None:
        return
    count = device_count(config, options)
    config.stash[_ASKED] = how
    from torchshard.testing import _spmd  # torch and torchshard: only when asked

    # Enabled before it is registered: registered inside pytest_configure (a conftest's
    # pytest_plugins), its own pytest_configure runs at once, and must find it enabled to
    # register the spmd marker (else --strict-markers refuses every marked test module).
    _spmd.enable(config, count, how)
    if not config.pluginmanager.is_registered(_spmd):
        config.pluginmanager.register(_spmd, ACTIVE)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Runs before the first conftest is imported (entry-point and -p plugins only), so the
    # emulation is set up before a conftest can import torch_xla.
    _decide(early_config, early_config.known_args_namespace)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Asked before any conftest (options, ini), or by a conftest (pytest_plugins, or this
    # plugin loaded late): then set up now, after those conftests were imported.
    _decide(config, config.option)
