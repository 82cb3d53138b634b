"""torchshard's pytest plugin: CPU-emulated SPMD devices, mesh fixtures, per-count runs.

Opt-in. The ``pytest11`` entry point ``torchshard`` is the gate, ``_torchshard_pytestplugin``
(outside this package, so that it imports no torch): it registers this module (as
``torchshard-spmd``) only when a project asks for it (the ini option ``spmd_devices = N``,
``--spmd-devices N``, ``-p torchshard`` or a conftest's ``pytest_plugins = ["torchshard"]``),
with the device count it read, and calls ``enable``; every other pytest run in the environment
is left alone. This module never imports the gate (the gate imports it, when asked), and has no
hook of the gate's: registered by itself, it does nothing. Without torch_xla (a plain install,
DTensor only) the plugin, asked for, is inert: it sets nothing up and fails nothing;
``@pytest.mark.spmd`` items and tests using ``make_mesh`` or ``spmd_devices`` skip, saying that
torch_xla is not installed.

- The device count (the gate's): ``--spmd-devices N``, else the ini option ``spmd_devices``,
  else 8 (``-p torchshard``). ``enable`` sets ``PJRT_DEVICE=CPU`` and ``CPU_NUM_DEVICES`` and
  enables SPMD from the gate's ``pytest_load_initial_conftests``, which pytest calls for
  entry-point plugins *before* it imports any conftest file, so a conftest may import torch_xla
  freely. If torch_xla's runtime already started with another count (another plugin created a
  device, or pytest runs inside a process that did), the run stops with a usage error that says
  so.
- Fixtures: ``spmd_devices`` (the count), ``make_mesh(shape, axis_names)`` (creates a mesh and
  enters it until the test ends), ``virtual_hosts(n)`` (enters the multi-host emulation until
  the test ends).
- ``@pytest.mark.spmd(devices=[4, 8])``: one test item per count (ids ``spmd4``, ``spmd8``).
  The count is fixed per process, so an item whose count differs from this process's runs in a
  child pytest process started with that count; the item matching this process runs directly.

Every hook below does nothing unless the gate enabled the plugin. The old private path
``torchshard.testing._plugin`` (0.1.0's entry point) is a shim with the gate's hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from torchshard._core.topology import Topology
    from torchshard._mesh.mesh import Mesh

PARAM = "_torchshard_spmd_devices"  # the hidden parameter of @pytest.mark.spmd items
_COUNT = pytest.StashKey[int]()
_INERT = pytest.StashKey[str]()  # why the plugin set nothing up (torch_xla not installed)
_ASKED = pytest.StashKey[str]()  # how the project asked (for the report header)


def _on(config: pytest.Config) -> bool:
    """Whether the project asked for the plugin (and it was enabled)."""
    return _COUNT in config.stash or _INERT in config.stash


def pytest_configure(config: pytest.Config) -> None:
    if not _on(config):
        return
    config.addinivalue_line(
        "markers",
        "spmd(devices=[4, 8]): run the test once per emulated device count, each in a process "
        "with that count (torchshard plugin)",
    )
    if config.option.spmd_report and not config.pluginmanager.has_plugin("torchshard-spmd-report"):
        from torchshard.testing._spmd_child import ChildReportWriter

        config.pluginmanager.register(
            ChildReportWriter(config.option.spmd_report), "torchshard-spmd-report"
        )


def enable(config: pytest.Config, count: int, how: str) -> None:
    """Sets ``count`` emulated devices up (the gate calls it when the project asked, ``how``
    saying how: ``"--spmd-devices"``, ``"-p torchshard"``, ...; idempotent)."""
    if _on(config):
        return
    config.stash[_ASKED] = how
    from torchshard._backend.xla.env import INSTALL_XLA, xla_installed

    if not xla_installed():
        config.stash[_INERT] = (
            "torchshard plugin: torch_xla is not installed, so there are no emulated SPMD "
            f"devices ({INSTALL_XLA} installs it)"
        )
        return
    from torchshard._backend.xla.env import EmulationError, setup_cpu_emulation

    try:
        setup_cpu_emulation(count, force=True)
    except EmulationError as e:
        raise pytest.UsageError(
            f"torchshard pytest plugin: {e}\nSomething started torch_xla before the plugin "
            "could configure it: another plugin, or the process that runs pytest (pytester's "
            "in-process runs included; use runpytest_subprocess). Set --spmd-devices (or the "
            "ini option spmd_devices) to the runtime's count, or run tests that need other "
            "counts with @pytest.mark.spmd(devices=[...])."
        ) from None
    config.stash[_COUNT] = count


def _verify(config: pytest.Config, when: str) -> None:
    """Conftests and test modules may not change the count behind the plugin's back."""
    import os

    from torchshard._backend.xla.env import runtime_devices, runtime_started

    if _INERT in config.stash or not _on(config):
        return
    count = config.stash[_COUNT]
    env = (os.environ.get("PJRT_DEVICE"), os.environ.get("CPU_NUM_DEVICES"))
    if env != ("CPU", str(count)):
        raise pytest.UsageError(
            f"torchshard pytest plugin: {when}, PJRT_DEVICE={env[0]} and CPU_NUM_DEVICES={env[1]}"
            f", but the plugin set CPU and {count}: a conftest or test module changed them. The "
            "plugin owns the emulated device count: set --spmd-devices or the ini option "
            "spmd_devices instead, and use @pytest.mark.spmd(devices=[...]) for other counts."
        )
    if runtime_started() and runtime_devices() != ("CPU", count):
        kind, actual = runtime_devices()
        raise pytest.UsageError(
            f"torchshard pytest plugin: {when}, torch_xla's runtime has {actual} {kind} "
            f"device(s), but the plugin configured {count} CPU devices."
        )


def pytest_sessionstart(session: pytest.Session) -> None:
    _verify(session.config, "after loading the conftest files")


def pytest_collection_finish(session: pytest.Session) -> None:
    _verify(session.config, "after collecting the tests")


def pytest_report_header(config: pytest.Config) -> str | None:
    if not _on(config):
        return None
    if _INERT in config.stash:
        return f"{config.stash[_INERT]}; @pytest.mark.spmd tests skip"
    return (
        f"torchshard: {config.stash[_COUNT]} CPU-emulated SPMD devices (asked for by "
        f"{config.stash.get(_ASKED, 'pytest_plugins')})"
    )


OFF = (
    "the torchshard pytest plugin is off in this project: turn it on with the ini option "
    "spmd_devices = 8 (e.g. in [tool.pytest.ini_options]), --spmd-devices 8 or -p torchshard"
)


def _skip_if_inert(config: pytest.Config) -> None:
    if not _on(config):
        pytest.fail(OFF, pytrace=False)
    reason = config.stash.get(_INERT, None)
    if reason is not None:
        pytest.skip(reason)


# -- @pytest.mark.spmd --------------------------------------------------------------------


def _marker_counts(marker: pytest.Mark) -> list[int]:
    if "devices" in marker.kwargs:
        devices = marker.kwargs["devices"]
    elif len(marker.args) == 1:
        devices = marker.args[0]
    else:
        devices = None
    counts = [devices] if isinstance(devices, int) else devices
    ok = (
        isinstance(counts, (list, tuple))
        and counts
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts)
        and len(set(counts)) == len(counts)
    )
    if not ok:
        pytest.fail(
            "@pytest.mark.spmd: devices must be a positive device count or a list of distinct "
            f"ones, e.g. @pytest.mark.spmd(devices=[4, 8]), but got args={marker.args!r} "
            f"kwargs={marker.kwargs!r}.",
            pytrace=False,
        )
    return list(counts)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("spmd")
    if marker is None or not _on(metafunc.config):
        return
    counts = _marker_counts(marker)
    metafunc.fixturenames.append(PARAM)
    metafunc.parametrize(PARAM, counts, ids=[f"spmd{n}" for n in counts])


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, which needs the original items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _on(config):
        return
    reason = config.stash.get(_INERT, None)
    if reason is not None:
        for item in items:
            if item.get_closest_marker("spmd") is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        return
    count = config.stash[_COUNT]
    for i, item in enumerate(items):
        callspec = getattr(item, "callspec", None)
        wanted = callspec.params.get(PARAM) if callspec is not None else None
        if wanted is not None and wanted != count:
            from torchshard.testing._spmd_child import ChildRun

            items[i] = ChildRun.from_item(item, wanted, count)


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spmd_devices(pytestconfig: pytest.Config) -> int:
    """The number of CPU-emulated devices of this test process (skips without torch_xla)."""
    _skip_if_inert(pytestconfig)
    return pytestconfig.stash[_COUNT]


@pytest.fixture
def make_mesh(pytestconfig: pytest.Config) -> Iterator[Callable[..., Mesh]]:
    """A factory: ``make_mesh(shape, axis_names, *, devices=None)`` creates a mesh with
    ``torchshard.create_device_mesh`` and enters it; the test leaves it when it ends.

    Example:
        >>> def test_rows(make_mesh):
        ...     mesh = make_mesh((4, 2), ("data", "model"))
        ...     assert torchshard.current_mesh() is mesh
    """
    from torchshard._mesh.build import create_device_mesh

    _skip_if_inert(pytestconfig)
    with contextlib.ExitStack() as stack:

        def make(shape: Any, axis_names: Any, *, devices: Any = None) -> Mesh:
            return stack.enter_context(create_device_mesh(shape, axis_names, devices=devices))

        yield make


@pytest.fixture
def virtual_hosts() -> Iterator[Callable[..., Topology]]:
    """A factory: ``virtual_hosts(num_hosts, *, process_index=0)`` enters
    ``torchshard.testing.virtual_hosts`` until the test ends and returns its ``Topology``."""
    from torchshard.testing._virtual import virtual_hosts as emulate

    with contextlib.ExitStack() as stack:

        def enter(num_hosts: int, *, process_index: int = 0) -> Topology:
            return stack.enter_context(emulate(num_hosts, process_index=process_index))

        yield enter
