"""0.1.0's private path of the plugin, ``torchshard.testing._plugin``, now a shim with the
gate's hooks: an environment whose entry point still names it, and a conftest that lists it
(``pytest_plugins``, without entry-point autoloading: the plugin then sets up in
``pytest_configure``, after that conftest ran), get the plugin as before; nothing in torchshard
imports it. Each run is a fresh interpreter."""

from __future__ import annotations

import ast
import json

import pytest
import pytest_projects

pytest_plugins = ["pytester"]

# What a test of the project sees of the plugin, and the devices it gets.
RECORDS = """
    import json
    import os

    import torchshard as ts


    def test_count(pytestconfig, spmd_devices, make_mesh):
        with open(os.environ["SEEN"], "w") as f:
            json.dump(
                {
                    "entry point": pytestconfig.pluginmanager.get_plugin("torchshard").__name__,
                    "active": pytestconfig.pluginmanager.has_plugin("torchshard-spmd"),
                },
                f,
            )
        assert spmd_devices == 8
        assert make_mesh((-1,), ("data",)).size == 8
"""


@pytest.mark.xla  # the run sets up the emulated devices
def test_an_entry_point_that_names_the_old_path_gets_the_plugin(tmp_path):
    """An environment installed with 0.1.0's entry point (``torchshard =
    torchshard.testing._plugin``): the shim registers as ``torchshard`` and its hooks, the
    gate's, set the plugin up when the project asks (here by the ini option)."""
    project = pytest_projects.write(
        tmp_path, {"pytest.ini": "[pytest]\nspmd_devices = 8\n", "test_old.py": RECORDS}
    )
    seen = tmp_path / "seen.json"
    env = pytest_projects.environment(entry_point=pytest_projects.SHIM, SEEN=str(seen))
    result = pytest_projects.run(project, env=env)
    result.assert_outcomes(passed=1)
    assert json.loads(seen.read_text()) == {
        "entry point": "torchshard.testing._plugin",
        "active": True,
    }
    result.stdout.fnmatch_lines(
        ["torchshard: 8 CPU-emulated SPMD devices (asked for by the ini option spmd_devices)"]
    )


def test_nothing_in_torchshard_imports_the_shim():
    """The shim is for the old entry point and conftests only: the gate names it (to tell how a
    project asked), and no module imports it."""
    paths = [*sorted((pytest_projects.REPO / "torchshard").rglob("*.py"))]
    paths.append(pytest_projects.REPO / "_torchshard_pytestplugin.py")
    importers = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if pytest_projects.SHIM in names:
                importers.append(f"{path.relative_to(pytest_projects.REPO)}:{node.lineno}")
    assert importers == []


@pytest.fixture
def pytester(pytester):
    """A project that asks for the plugin with 8 devices (``spmd_devices = 8``)."""
    pytester.makeini("[pytest]\nspmd_devices = 8\n")
    return pytester


@pytest.mark.xla  # the run sets up the emulated devices
def test_plugin_loaded_late_from_a_conftest(pytester, monkeypatch):
    # Without entry-point autoloading, a conftest can still load the plugin; it then sets up the
    # devices in pytest_configure, after that conftest ran.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest('pytest_plugins = ["torchshard.testing._plugin"]\n')
    pytester.makepyfile(
        test_late="""
        import torchshard as ts

        def test_count(spmd_devices, make_mesh):
            assert spmd_devices == 8
            assert make_mesh((-1,), ("data",)).size == 8
        """
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


@pytest.mark.xla  # the run sets up the emulated devices
def test_plugin_loaded_late_after_a_conftest_started_torch_xla(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(
        "import os\n"
        "os.environ['PJRT_DEVICE'] = 'CPU'\n"
        "os.environ['CPU_NUM_DEVICES'] = '4'\n"
        "import torch_xla.runtime as xr\n"
        "xr.global_runtime_device_count()\n"
        'pytest_plugins = ["torchshard.testing._plugin"]\n'
    )
    pytester.makepyfile(test_any="def test_any():\n    pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = "\n".join(result.stderr.lines)
    assert (
        "torchshard pytest plugin: torch_xla's runtime already started with 4 CPU device(s), but "
        "8 emulated CPU devices were requested."
    ) in err, err
