"""Child runs of ``@pytest.mark.spmd`` items whose device count differs from this process's.

torch_xla fixes the device count when its runtime starts, so such an item is replaced by a
``ChildRun`` item with the same node id, which reports the child's outcome for its node id (its
failure text, skip reason or xfail) as its own. One child runs every item of a count: the first
``ChildRun`` of count N to run starts ``python -m pytest <node ids> --spmd-devices=N`` in the
project's root with the node ids of all the session's ``ChildRun`` items of that count, where
they match the child's count and run directly; the others of that count read its reports (a
child interpreter costs torch's and torch_xla's imports, seconds). Under pytest-xdist the
items of the count are those this worker is still to run (all of them with ``--dist each``; with
``load`` and its kin, those queued for it, and an item sent later starts a child for the count's
items queued by then; with ``worksteal``, whose queued items may move to another worker, the
item alone): no item runs in two workers' children. The child writes its test reports as JSON
lines (``--spmd-report``, ``ChildReportWriter``). No fixture of the items is set up in this
process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest

from torchshard._core.errors import ChildFailedError, at

_TAIL = 60  # lines of the child's output shown when it ran no test


@dataclass(frozen=True)
class _Child:
    """One child run: the node ids it ran, its command, its exit status and output, and its
    reports."""

    targets: list[str]
    command: list[str]
    returncode: int
    output: str
    records: list[dict[str, Any]]


# The session's (or xdist worker's) child runs, by device count.
_CHILDREN = pytest.StashKey[dict[int, list[_Child]]]()


class ChildRun(pytest.Item):
    """A marked test item run in a child pytest process with another device count."""

    def __init__(
        self, *, devices: int, current: int, target: str, where: Any, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.devices = devices
        self.current = current
        self.target = target
        self._where = where

    @classmethod
    def from_item(cls, item: pytest.Item, devices: int, current: int) -> ChildRun:
        """The child run replacing ``item`` (same parent, name, node id, markers); ``current``
        is this process's device count."""
        if item.parent is None:
            raise TypeError(at(item.nodeid, "a marked test item must have a parent node."))
        new = cls.from_parent(
            item.parent,
            name=item.name,
            devices=devices,
            current=current,
            target=item.nodeid,
            where=item.reportinfo(),
        )
        new.own_markers.extend(item.own_markers)
        new.keywords.update(item.keywords)
        return new

    def reportinfo(self) -> Any:
        return self._where

    def _pending(self) -> list[pytest.Item]:
        """The items this process runs from this one on: the session's, or under pytest-xdist
        those its worker was sent and has not run yet (this one alone where that queue cannot
        be read, or may be stolen by another worker: ``--dist worksteal``)."""
        config = self.config
        if not hasattr(config, "workerinput"):  # no xdist worker: the session runs every item
            return list(self.session.items)
        if config.getoption("dist", None) == "worksteal":
            return [self]
        for plugin in config.pluginmanager.get_plugins():
            torun = getattr(plugin, "torun", None)
            if type(plugin).__name__ != "WorkerInteractor" or torun is None:
                continue
            try:
                with torun.lock() as queue:
                    indices = [plugin.item_index, plugin.nextitem_index, *queue]
            except (AttributeError, TypeError):  # another xdist: a child per item, still once
                return [self]
            items = self.session.items
            return [items[i] for i in indices if type(i) is int and 0 <= i < len(items)]
        return [self]

    def _batch(self, done: set[str]) -> list[str]:
        """The node ids the child of this item's count runs: the ``ChildRun`` items of that
        count this process runs from this one on, in their order, less those a child ran
        (``done``)."""
        targets = [
            item.target
            for item in self._pending()
            if isinstance(item, ChildRun) and item.devices == self.devices
        ]
        targets = list(dict.fromkeys(t for t in targets if t not in done))
        return targets if self.target in targets else [self.target, *targets]

    def _command(self, targets: list[str], report: str, basetemp: str) -> list[str]:
        config = self.config
        cmd = [sys.executable, "-m", "pytest", *targets, f"--spmd-devices={self.devices}"]
        cmd += [f"--spmd-report={report}", f"--basetemp={basetemp}", "-p", "no:cacheprovider"]
        cmd += ["--rootdir", str(config.rootpath), "-q", "--no-header"]
        if config.inipath is not None:
            cmd += ["-c", str(config.inipath)]
        for plugin in config.known_args_namespace.plugins or ():
            if plugin != "no:cacheprovider":
                cmd += ["-p", plugin]
        for w in config.known_args_namespace.pythonwarnings or ():
            cmd += ["-W", w]
        if config.pluginmanager.hasplugin("xdist"):
            # One process: this run (or its xdist worker) already spreads the items; the
            # project's addopts (-n 2 --dist each) would start workers of the child's own,
            # each running (--dist each: all of) its items again and writing the reports.
            cmd += ["-n", "0", "--dist", "no"]
        return cmd

    def _child(self) -> _Child:
        """The child run of this item's count: started by the first item of the count to run
        (for every item of the count this process is still to run), read by the others."""
        children = self.config.stash.setdefault(_CHILDREN, {}).setdefault(self.devices, [])
        for child in children:
            if self.target in child.targets:
                return child
        # The first of its count, or one no child ran (an xdist worker was sent it later).
        targets = self._batch({t for child in children for t in child.targets})
        with tempfile.TemporaryDirectory(prefix="torchshard-spmd-") as tmp:
            report = os.path.join(tmp, "reports.jsonl")
            cmd = self._command(targets, report, os.path.join(tmp, "basetemp"))
            proc = subprocess.run(
                cmd,
                cwd=self.config.rootpath,
                stdin=subprocess.DEVNULL,  # an xdist worker's stdin is its channel to the run
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                check=False,
            )
            records = []
            if os.path.exists(report):
                with open(report) as f:
                    records = [json.loads(line) for line in f if line.strip()]
        found = _Child(targets, cmd, proc.returncode, proc.stdout, records)
        children.append(found)
        return found

    def _concerns(self, record: dict[str, Any]) -> bool:
        """Whether a report of the child is this item's: its own, or a collection error of a
        node above it (its module, its folder, the session)."""
        nodeid = record["nodeid"]
        if nodeid == self.target:
            return True
        above = nodeid == "" or self.target.startswith((f"{nodeid}::", f"{nodeid.rstrip('/')}/"))
        return record["when"] == "collect" and above

    def runtest(self) -> None:
        child = self._child()
        cmd, records = child.command, [r for r in child.records if self._concerns(r)]
        mine = [r for r in records if r["nodeid"] == self.target]
        for r in mine:  # the child's captured output, shown as this item's
            for title, content in r["sections"]:
                key, _, when = title.removeprefix("Captured ").rpartition(" ")
                self.add_report_section(when or "call", f"{key or title} (child)", content)
        header = (
            f"{self.target} ran in a child process with {self.devices} emulated devices "
            f"(this process has {self.current}):\n  {' '.join(cmd)}\n"
        )
        failed = [r for r in records if r["outcome"] == "failed"]
        if failed:
            text = "\n".join(f"[child, {r['when']}]\n{r['longrepr']}" for r in failed)
            raise ChildFailedError(f"{header}\n{text}")
        if not mine:
            tail = "\n".join(child.output.splitlines()[-_TAIL:])
            raise ChildFailedError(
                f"{header}\nthe child ran no test with this node id (exit status "
                f"{child.returncode}); the end of its output:\n{tail}"
            )
        for r in mine:
            if r["outcome"] == "skipped":
                if r["wasxfail"] is not None:
                    pytest.xfail(f"[child] {r['wasxfail']}")
                reason = r["reason"].removeprefix("Skipped: ")
                # Reported at the test's own location, as a skip marker would be.
                raise pytest.skip.Exception(f"[child] {reason}", _use_item_location=True)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ChildFailedError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


class ChildReportWriter:
    """Writes each test and collection report of a child run as one JSON line."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        self._write(
            {
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "longrepr": report.longreprtext if report.failed else "",
                "reason": reason,
                "wasxfail": getattr(report, "wasxfail", None),
                "sections": [list(sec) for sec in report.sections],
            }
        )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._write(
                {
                    "nodeid": report.nodeid,
                    "when": "collect",
                    "outcome": "failed",
                    "longrepr": report.longreprtext,
                    "reason": "",
                    "wasxfail": None,
                    "sections": [],
                }
            )
