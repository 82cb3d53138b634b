"""The pytest plugin's body (torchshard.testing._spmd), used from small separate test projects
that ask for it (the ini option ``spmd_devices``), each run in a fresh interpreter (the device
count is fixed per process): the fixtures, ``assert_sharded``'s failure, the marker (one item
per count, each count in its own process: the items of another count in one child run,
torchshard.testing._spmd_child; its checks), the errors when something else set the device
count, and the inert plugin without torch_xla. The checks that need a project asking for 8
devices share one run (``eight_devices``), laid out as this repository's tests are. How a
project asks, and projects that do not: tests/testing/test_torchshard_pytestplugin.py (the
gate); the old path: tests/testing/test_plugin.py."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest
import pytest_projects

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


# A project that asks for the plugin, run where torch_xla is hidden (``sys.modules["torch_xla"]
# = None``, as on a machine without it).
ASKED = """
    import os

    import pytest


    def test_unrelated():
        # The plugin set nothing up: no emulated XLA devices in this process.
        assert "PJRT_DEVICE" not in os.environ and "CPU_NUM_DEVICES" not in os.environ


    @pytest.mark.spmd(devices=[4, 8])
    def test_counts(spmd_devices):
        raise AssertionError("must not run without torch_xla")


    def test_mesh_fixture(make_mesh):
        raise AssertionError("must not run without torch_xla")
"""
HIDE_XLA = (
    "import sys; sys.modules['torch_xla'] = None; import pytest; "
    "raise SystemExit(pytest.main(sys.argv[1:]))"
)

BAD_COUNTS = """
    import pytest

    @pytest.mark.spmd(devices=[4, 4])
    def test_x():
        pass
"""

# Marked tests of 3 counts in a project laid out in folders (tests/core/test_marked.py).
MARKED = """
    import json
    import os

    import pytest

    import torchshard as ts
    from shared import VALUE  # a helper beside the conftest, found in the children too


    def _record(name, **fields):
        with open(os.environ[name], "a") as f:
            f.write(json.dumps(fields) + "\\n")


    @pytest.mark.spmd(devices=[4, 8])
    def test_counts(spmd_devices, make_mesh):
        assert VALUE == 7
        # A mesh must cover every device of the runtime, so this fails on a wrong count.
        mesh = make_mesh((spmd_devices,), ("data",))
        runtime = ts.create_device_mesh((-1,), ("data",)).size
        _record("SPMD_RECORD", count=spmd_devices, runtime=runtime, mesh=mesh.size,
                env=os.environ["CPU_NUM_DEVICES"], pid=os.getpid())


    @pytest.mark.spmd(devices=2)
    def test_child_failure(spmd_devices):
        _record("SPMD_PIDS", test="failure", pid=os.getpid())
        assert spmd_devices == 3, "boom in the child"


    @pytest.mark.spmd(devices=[2])
    def test_child_skip():
        _record("SPMD_PIDS", test="skip", pid=os.getpid())
        pytest.skip("nothing to do on 2 devices")
"""

# A second test file of the same basename (tests/mesh/test_marked.py).
SAME_BASENAME = """
    from shared import VALUE


    def test_here():
        assert VALUE == 7
"""


@pytest.fixture
def pytester(pytester):
    """A project that asks for the plugin with 8 devices (``spmd_devices = 8``)."""
    pytester.makeini("[pytest]\nspmd_devices = 8\n")
    return pytester


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory) -> tuple[pytest.RunResult, pathlib.Path]:
    """One run of a project that asks for 8 devices, for every check that needs no other
    configuration (and the folder the marked tests record into): passing tests and the docs'
    example (test_passing.py, test_readme.py), a wrong layout (test_wrong.py), a marker with
    bad counts (test_bad.py, a collection error: ``--continue-on-collection-errors`` runs the
    others), and marked tests of 3 counts laid out as this repository's tests are (folders, two
    test files of one basename, --import-mode=importlib, a conftest that puts the helpers'
    folder on sys.path)."""
    project = tmp_path_factory.mktemp("eight-devices")
    conftest = "import pathlib, sys\n\nsys.path.insert(0, str(pathlib.Path(__file__).parent))\n"
    pytest_projects.write(
        project,
        {
            "pytest.ini": "[pytest]\naddopts = --import-mode=importlib\nspmd_devices = 8\n",
            "test_passing.py": PASSING,
            "test_readme.py": _readme_example(),
            "test_wrong.py": WRONG_SPEC,
            "test_bad.py": BAD_COUNTS,
            "tests/conftest.py": conftest,
            "tests/shared.py": "VALUE = 7\n",
            "tests/core/test_marked.py": MARKED,
            "tests/mesh/test_marked.py": SAME_BASENAME,
        },
    )
    env = pytest_projects.environment(
        HOME=str(project),
        SPMD_RECORD=str(project / "record.jsonl"),
        SPMD_PIDS=str(project / "pids.jsonl"),
    )
    result = pytest_projects.run(project, "-v", "-rfEs", "--continue-on-collection-errors", env=env)
    return result, project


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _lines_of(result: pytest.RunResult) -> list[str]:
    return pytest_projects.lines_of(result)


@pytest.mark.xla
def test_make_mesh_and_assert_sharded_pass_and_the_readme_example_runs(eight_devices):
    result, _ = eight_devices
    # 7 pass here, 3 in tests/ (below); test_wrong.py's test and test_child_failure fail,
    # test_child_skip skips and test_bad.py is a collection error (below).
    result.assert_outcomes(passed=10, failed=2, skipped=1, errors=1)
    passing = ["rows_per_device", "mesh_was_left", "virtual_hosts_fixture", "no_emulation_left"]
    result.stdout.re_match_lines(
        [re.escape(f"test_passing.py::test_{name} PASSED") + ".*" for name in passing]
    )
    result.stdout.re_match_lines(
        [
            re.escape(
                "torchshard: 8 CPU-emulated SPMD devices (asked for by the ini option spmd_devices)"
            ),
            re.escape("test_readme.py::test_any_device_count[spmd4] PASSED") + ".*",
            re.escape("test_readme.py::test_any_device_count[spmd8] PASSED") + ".*",
        ]
    )
    result.stdout.re_match_lines([re.escape("test_readme.py::test_rows_per_device PASSED") + ".*"])


@pytest.mark.xla
def test_wrong_spec_fails_with_readable_diff(eight_devices):
    result, _ = eight_devices
    result.stdout.re_match_lines([re.escape("test_wrong.py::test_wrong_spec FAILED") + ".*"])
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


@pytest.mark.xla
def test_spmd_marker_rejects_bad_counts(eight_devices):
    result, _ = eight_devices
    result.stdout.re_match_lines([r"ERROR test_bad\.py.*"])
    assert (
        "@pytest.mark.spmd: devices must be a positive device count or a list of distinct ones, "
        "e.g. @pytest.mark.spmd(devices=[4, 8]), but got args=() kwargs={'devices': [4, 4]}."
    ) in "\n".join(_lines_of(result))


@pytest.mark.xla
def test_spmd_marker_runs_each_count_in_its_own_process(eight_devices):
    """Each child finds its items by their node ids, folders included, and one child runs all
    the items of its count."""
    result, project = eight_devices
    result.stdout.re_match_lines(
        [
            re.escape("tests/core/test_marked.py::test_counts[spmd4] PASSED") + ".*",
            re.escape("tests/core/test_marked.py::test_counts[spmd8] PASSED") + ".*",
        ],
        consecutive=True,
    )
    result.stdout.re_match_lines([re.escape("tests/mesh/test_marked.py::test_here PASSED") + ".*"])
    runs = sorted(_records(project / "record.jsonl"), key=lambda r: r["count"])
    assert [(r["count"], r["runtime"], r["mesh"], r["env"]) for r in runs] == [
        (4, 4, 4, "4"),
        (8, 8, 8, "8"),
    ]
    assert runs[0]["pid"] != runs[1]["pid"]  # 4 ran in a child; 8 in the process of count 8
    twos = _records(project / "pids.jsonl")
    assert [r["test"] for r in twos] == ["failure", "skip"]
    assert len({r["pid"] for r in twos} | {runs[0]["pid"], runs[1]["pid"]}) == 3  # one child
    text = "\n".join(_lines_of(result))
    assert (
        "tests/core/test_marked.py::test_child_failure[spmd2] ran in a child process with 2 "
        "emulated devices (this process has 8):" in text
    )
    assert "AssertionError: boom in the child" in text
    # The skip is reported at the test's own location, not inside the plugin.
    assert re.search(
        r"SKIPPED \[1\] tests/core/test_marked\.py:\d+: \[child\] nothing to do on 2 devices", text
    )


@pytest.mark.xla
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


@pytest.mark.xla
def test_conftest_changing_the_count_is_a_clear_error(pytester):
    pytester.makeconftest("import os\nos.environ['CPU_NUM_DEVICES'] = '2'\n")
    pytester.makepyfile(test_any="def test_any():\n    pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "torchshard pytest plugin: after loading the conftest files, PJRT_DEVICE=CPU and "
        "CPU_NUM_DEVICES=2, but the plugin set CPU and 8: a conftest or test module changed them."
    ) in "\n".join(result.stderr.lines)


def test_without_torch_xla_the_plugin_is_inert_and_spmd_tests_skip(tmp_path):
    project = pytest_projects.write(
        tmp_path, {"test_asked.py": ASKED, "pytest.ini": "[pytest]\nspmd_devices = 8\n"}
    )
    run = pytest_projects.run(project, "-W", "error", "-rs", python=("-c", HIDE_XLA))
    out = "\n".join(run.outlines)
    assert run.ret == 0, out + "\n".join(run.errlines)
    reason = (
        "torchshard plugin: torch_xla is not installed, so there are no emulated SPMD devices "
        "(`pip install 'torchshard-input[xla]'` (from a checkout: `pip install -e '.[xla]'`) "
        "installs it)"
    )
    assert f"{reason}; @pytest.mark.spmd tests skip" in out  # the report header
    assert "1 passed, 3 skipped" in out
    assert f"SKIPPED [2] test_asked.py:12: {reason}" in out  # the spmd4 and spmd8 items
    assert f"SKIPPED [1] test_asked.py:17: {reason}" in out  # make_mesh
