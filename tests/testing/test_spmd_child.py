"""Child runs of ``@pytest.mark.spmd`` items (torchshard.testing._spmd_child): an item whose
device count differs from this process's runs in a child pytest by its node id, and reports the
child's outcome as its own; in a project laid out in folders and imported by path (as this
repository is), and the child's JSON-lines report, written in this process."""

from __future__ import annotations

import json
import re
import textwrap
import types

import pytest

pytest_plugins = ["pytester"]

MARKED = """
    import json
    import os

    import pytest

    import torchshard as ts
    from shared import VALUE  # a helper beside the conftest, found in the children too


    @pytest.mark.spmd(devices=[4, 8])
    def test_counts(spmd_devices, make_mesh):
        assert VALUE == 7
        # A mesh must cover every device of the runtime, so this fails on a wrong count.
        mesh = make_mesh((spmd_devices,), ("data",))
        runtime = ts.create_device_mesh((-1,), ("data",)).size
        with open(os.environ["SPMD_RECORD"], "a") as f:
            f.write(json.dumps({"count": spmd_devices, "runtime": runtime, "mesh": mesh.size,
                                "env": os.environ["CPU_NUM_DEVICES"], "pid": os.getpid()}) + "\\n")


    @pytest.mark.spmd(devices=2)
    def test_child_failure(spmd_devices):
        assert spmd_devices == 3, "boom in the child"


    @pytest.mark.spmd(devices=[2])
    def test_child_skip():
        pytest.skip("nothing to do on 2 devices")
"""


SAME_BASENAME = """
    from shared import VALUE


    def test_here():
        assert VALUE == 7
"""


def _lines_of(result: pytest.RunResult) -> list[str]:
    return [line.rstrip() for line in result.stdout.lines]


@pytest.mark.xla
def test_spmd_marker_runs_each_count_in_its_own_process(pytester, tmp_path, monkeypatch):
    """The project is laid out as this repository's tests are (folders, two test files of one
    basename, --import-mode=importlib, a conftest that puts the helpers' folder on sys.path):
    each child finds its item by the node id, folders included."""
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("SPMD_RECORD", str(record))
    pytester.makeini("[pytest]\naddopts = --import-mode=importlib\nspmd_devices = 8\n")
    tests = pytester.path / "tests"
    for folder in ("core", "mesh"):
        (tests / folder).mkdir(parents=True)
    (tests / "conftest.py").write_text(
        "import pathlib, sys\n\nsys.path.insert(0, str(pathlib.Path(__file__).parent))\n"
    )
    (tests / "shared.py").write_text("VALUE = 7\n")
    (tests / "core" / "test_marked.py").write_text(textwrap.dedent(MARKED))
    (tests / "mesh" / "test_marked.py").write_text(textwrap.dedent(SAME_BASENAME))
    result = pytester.runpytest_subprocess("-v", "-rs")
    result.assert_outcomes(passed=3, failed=1, skipped=1)
    result.stdout.re_match_lines(
        [
            re.escape("tests/core/test_marked.py::test_counts[spmd4] PASSED") + ".*",
            re.escape("tests/core/test_marked.py::test_counts[spmd8] PASSED") + ".*",
        ],
        consecutive=True,
    )
    result.stdout.re_match_lines([re.escape("tests/mesh/test_marked.py::test_here PASSED") + ".*"])
    runs = sorted(
        (json.loads(line) for line in record.read_text().splitlines()), key=lambda r: r["count"]
    )
    assert [(r["count"], r["runtime"], r["mesh"], r["env"]) for r in runs] == [
        (4, 4, 4, "4"),
        (8, 8, 8, "8"),
    ]
    assert runs[0]["pid"] != runs[1]["pid"]  # 4 ran in a child; 8 in the process of count 8
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


def _report(**fields):
    base = {
        "nodeid": "tests/core/test_x.py::test_y[spmd4]",
        "when": "call",
        "outcome": "passed",
        "failed": False,
        "skipped": False,
        "longrepr": None,
        "longreprtext": "",
        "sections": [],
    }
    base.update(fields)
    return types.SimpleNamespace(**base)


def test_the_child_writes_one_json_line_per_report(tmp_path):
    from torchshard.testing._spmd_child import ChildReportWriter

    path = tmp_path / "reports.jsonl"
    writer = ChildReportWriter(str(path))
    writer.pytest_runtest_logreport(_report(sections=[("Captured stdout call", "hi\n")]))
    writer.pytest_runtest_logreport(
        _report(
            when="setup",
            outcome="skipped",
            skipped=True,
            longrepr=("f.py", 3, "Skipped: not on 2 devices"),
        )
    )
    writer.pytest_runtest_logreport(
        _report(outcome="failed", failed=True, longreprtext="AssertionError: boom")
    )
    writer.pytest_collectreport(_report(outcome="passed", failed=False))  # passed: not written
    writer.pytest_collectreport(
        _report(nodeid="tests/core/test_x.py", failed=True, longreprtext="ImportError: no")
    )
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["when"], r["outcome"]) for r in records] == [
        ("call", "passed"),
        ("setup", "skipped"),
        ("call", "failed"),
        ("collect", "failed"),
    ]
    assert records[0]["sections"] == [["Captured stdout call", "hi\n"]]
    assert records[0]["longrepr"] == "" and records[0]["wasxfail"] is None
    assert records[1]["reason"] == "Skipped: not on 2 devices"
    assert records[2]["longrepr"] == "AssertionError: boom"
    assert records[3] == {
        "nodeid": "tests/core/test_x.py",
        "when": "collect",
        "outcome": "failed",
        "longrepr": "ImportError: no",
        "reason": "",
        "wasxfail": None,
        "sections": [],
    }
