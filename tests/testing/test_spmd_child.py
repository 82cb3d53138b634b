"""Child runs of ``@pytest.mark.spmd`` items (torchshard.testing._spmd_child): which of a
child's reports are an item's (its own, and the collection errors above it: one child runs
every item of its count), and the child's JSON-lines report, written in this process. The
marker's items run in their children, in a project laid out in folders and imported by path
(as this repository is): tests/testing/test_spmd.py."""

from __future__ import annotations

import collections
import json
import types

import pytest
import pytest_projects

from torchshard.testing._spmd_child import ChildRun


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


def test_an_item_owns_its_reports_and_the_collection_errors_above_it():
    item = types.SimpleNamespace(target="tests/core/test_x.py::test_y[spmd4]")

    def concerns(nodeid, when="call"):
        return ChildRun._concerns(item, {"nodeid": nodeid, "when": when})

    assert concerns("tests/core/test_x.py::test_y[spmd4]")
    assert concerns("tests/core/test_x.py::test_y[spmd4]", "teardown")
    assert not concerns("tests/core/test_x.py::test_z[spmd4]")  # another item of the batch
    for above in ("tests/core/test_x.py", "tests/core", "tests", ""):
        assert concerns(above, "collect"), above
    assert not concerns("tests/core/test_other.py", "collect")
    assert not concerns("tests/co", "collect")  # a prefix of a name is not a folder above


# A project that runs on pytest-xdist by its own addopts (every test on both workers), asks
# for the plugin from its conftest, and is strict about markers and warnings.
XDIST_PROJECT = {
    "pytest.ini": (
        "[pytest]\naddopts = -n 2 --dist each --strict-markers\nfilterwarnings = error\n"
    ),
    "conftest.py": 'pytest_plugins = ["torchshard"]\n',
    "test_marked.py": """
        import json
        import os

        import pytest


        @pytest.mark.spmd(devices=[4, 8])
        @pytest.mark.parametrize("k", range(3))
        def test_counts(spmd_devices, k):
            assert int(os.environ["CPU_NUM_DEVICES"]) == spmd_devices
            with open(os.environ["RECORD"], "a") as f:
                f.write(json.dumps([spmd_devices, k, os.getpid()]) + "\\n")
    """,
}


@pytest.mark.xla
@pytest.mark.parametrize("dist", ["each", "load"])
def test_under_xdist_every_item_runs_once_per_worker_that_runs_it(tmp_path, dist):
    """-n 2 --dist each: each worker runs every item, the items of its other count in one
    child of its own, which runs them itself (before: the child inherited -n 2 --dist each and
    ran each item on two workers of its own; and the spmd marker, unregistered when the
    conftest asked for the plugin, failed --strict-markers at collection). -n 2 --dist load:
    each item runs once, in the child of the worker it was sent to (before: each worker's
    child ran every item of its count, so an item sent to one worker ran in both)."""
    project = pytest_projects.write(tmp_path / "project", XDIST_PROJECT)
    record = tmp_path / "record.jsonl"
    env = pytest_projects.environment(HOME=str(project), RECORD=str(record))
    run = pytest_projects.run(project, "-rfEs", f"--dist={dist}", env=env)
    out = "\n".join(run.outlines + run.errlines)
    assert run.ret == 0, out
    workers = 2 if dist == "each" else 1  # the workers that run each item
    run.assert_outcomes(passed=6 * workers)
    runs = [tuple(r) for r in map(json.loads, record.read_text().splitlines())]
    assert collections.Counter((count, k) for count, k, _ in runs) == {
        (count, k): workers for count in (4, 8) for k in range(3)
    }, out
    if dist == "each":  # one child per worker for count 4, each ran its 3 items
        assert len({pid for count, _, pid in runs if count == 4}) == 2
