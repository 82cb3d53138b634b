"""The pytest plugin, used from small separate test projects that ask for it (the ini option
``spmd_devices``; pytester, in subprocesses: the device count is fixed per process, so every run
gets a fresh interpreter). Projects that do not ask: tests/testing/test_plugin_inert.py."""

from __future__ import annotations

import pathlib
import re
import sys
import textwrap

import pytest

pytestmark = pytest.mark.xla  # every test here runs on torch_xla

pytest_plugins = ["pytester"]

PASSING = """
    import numpy as np

    import torchshard as ts
    from torchshard.testing import assert_global_equal, assert_sharded


    def test_rows_per_device(make_mesh, spmd_devices):
        assert spmd_devices == 8
        mesh = make_mesh((4, 2), ("data", "model"))
        assert ts.current_mesh() is mesh
        x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
        g = ts.host_to_global_array(x, partition=ts.P("data"))
        assert_sharded(g, ts.P("data"))
        assert_sharded(g, ("data", None), mesh)
        assert_global_equal(g, x)


    def test_mesh_was_left(make_mesh):
        assert ts.current_mesh() is None
        outer = make_mesh((8,), ("data",))
        inner = make_mesh((2, 4), ("x", "y"))
        assert ts.current_mesh() is inner and inner is not outer


    def test_virtual_hosts_fixture(make_mesh, virtual_hosts):
        make_mesh((4, 2), ("data", "model"))
        topo = virtual_hosts(2, process_index=1)
        assert (ts.process_count(), ts.process_index()) == (2, 1)
        assert topo.device_process == (0, 0, 0, 0, 1, 1, 1, 1)


    def test_no_emulation_left():
        assert ts.process_count() == 1
"""

WRONG_SPEC = """
    import numpy as np

    import torchshard as ts
    from torchshard.testing import assert_sharded


    def test_wrong_spec(make_mesh):
        make_mesh((4, 2), ("data", "model"))
        g = ts.host_to_global_array(np.zeros((16, 8), np.float32), partition=ts.P("data"))
        assert_sharded(g, ts.P("data", "model"))
"""


def _readme_example() -> str:
    """The example test of docs/testing.md ("Testing SPMD code on a laptop")."""
    text = (pathlib.Path(__file__).parents[2] / "docs" / "testing.md").read_text()
    block = text.split("<!-- example:plugin -->", 1)[1]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def pytester(pytester):
    """A project that asks for the plugin with 8 devices (``spmd_devices = 8``)."""
    pytester.makeini("[pytest]\nspmd_devices = 8\n")
    return pytester


def _lines_of(result: pytest.RunResult) -> list[str]:
    return [line.rstrip() for line in result.stdout.lines]


def test_make_mesh_and_assert_sharded_pass_and_the_readme_example_runs(pytester):
    pytester.makepyfile(test_passing=textwrap.dedent(PASSING), test_readme=_readme_example())
    result = pytester.runpytest_subprocess("-v")
    result.assert_outcomes(passed=7)
    result.stdout.re_match_lines(
        [
            re.escape(
                "torchshard: 8 CPU-emulated SPMD devices (asked for by the ini option spmd_devices)"
            ),
            re.escape("test_readme.py::test_any_device_count[spmd4] PASSED") + ".*",
            re.escape("test_readme.py::test_any_device_count[spmd8] PASSED") + ".*",
        ]
    )


def test_wrong_spec_fails_with_readable_diff(pytester):
    pytester.makepyfile(test_wrong=textwrap.dedent(WRONG_SPEC))
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    expected = [
        (
            "E       AssertionError: tensor of shape (16, 8) is not sharded as "
            "P('data', 'model') on Mesh({'data': 4, 'model': 2})."
        ),
        (
            "E       Expected dim 0 in 4 blocks, dim 1 in 2 blocks; "
            "torch_xla holds dim 0 in 4 blocks, dim 1 whole."
        ),
        "E       8 of 8 devices hold another block:",
        "E         device  expected      actual",
        "E         0       [0:4, 0:4]    [0:4, 0:8]",
        "E         1       [0:4, 4:8]    [0:4, 0:8]",
        "E         7       [12:16, 4:8]  [12:16, 0:8]",
    ]
    lines = _lines_of(result)
    missing = [e for e in expected if e not in lines]
    assert not missing, "\n".join(lines)


def test_spmd_marker_rejects_bad_counts(pytester):
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.spmd(devices=[4, 4])
        def test_x():
            pass
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    assert (
        "@pytest.mark.spmd: devices must be a positive device count or a list of distinct ones, "
        "e.g. @pytest.mark.spmd(devices=[4, 8]), but got args=() kwargs={'devices': [4, 4]}."
    ) in "\n".join(_lines_of(result))


def test_ini_option_and_command_line_option(pytester):
    pytester.makeini("[pytest]\nspmd_devices = 4\n")
    pytester.makepyfile(
        test_count="""
        import os

        import torchshard as ts

        def test_count(spmd_devices):
            want = int(os.environ.get("WANT", "4"))
            assert spmd_devices == want
            assert ts.create_device_mesh((-1,), ("data",)).size == want
        """
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANT", "2")
        pytester.runpytest_subprocess("--spmd-devices=2").assert_outcomes(passed=1)


def test_runtime_started_with_another_count_is_a_clear_error(pytester):
    pytester.makepyfile(test_any="def test_any():\n    pass\n")
    code = (
        "import os\n"
        "os.environ['PJRT_DEVICE'] = 'CPU'\n"
        "os.environ['CPU_NUM_DEVICES'] = '2'\n"
        "import torch_xla.runtime as xr\n"
        "xr.global_runtime_device_count()\n"
        "import pytest\n"
        "raise SystemExit(pytest.main(['-p', 'no:cacheprovider']))\n"
    )
    result = pytester.run(sys.executable, "-c", code)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = "\n".join(result.stderr.lines)
    assert (
        "torch_xla's runtime already started with 2 CPU device(s), but 8 emulated CPU devices "
        "were requested."
    ) in err, err


def test_conftest_changing_the_count_is_a_clear_error(pytester):
    pytester.makeconftest("import os\nos.environ['CPU_NUM_DEVICES'] = '2'\n")
    pytester.makepyfile(test_any="def test_any():\n    pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "torchshard pytest plugin: after loading the conftest files, PJRT_DEVICE=CPU and "
        "CPU_NUM_DEVICES=2, but the plugin set CPU and 8: a conftest or test module changed them."
    ) in "\n".join(result.stderr.lines)


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
