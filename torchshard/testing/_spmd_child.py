"""Child runs of ``@pytest.mark.spmd`` items whose device count differs from this process's.

torch_xla fixes the device count when its runtime starts, so such an item is replaced by a
``ChildRun`` item with the same node id: it starts ``python -m pytest <node id>
--spmd-devices=N`` in the project's root, where the item matches the child's count and runs
directly, and reports the child's outcome (its failure text, skip reason or xfail) as its own.
The child writes its test reports as JSON lines (``--spmd-report``, ``ChildReportWriter``).
No fixture of the item is set up in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from torchshard._core.errors import ChildFailedError, at

_TAIL = 60  # lines of the child's output shown when it ran no test


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

    def _command(self, report: str, basetemp: str) -> list[str]:
        config = self.config
        cmd = [sys.executable, "-m", "pytest", self.target, f"--spmd-devices={self.devices}"]
        cmd += [f"--spmd-report={report}", f"--basetemp={basetemp}", "-p", "no:cacheprovider"]
        cmd += ["--rootdir", str(config.rootpath), "-q", "--no-header"]
        if config.inipath is not None:
            cmd += ["-c", str(config.inipath)]
        for plugin in config.known_args_namespace.plugins or ():
            if plugin != "no:cacheprovider":
                cmd += ["-p", plugin]
        for w in config.known_args_namespace.pythonwarnings or ():
            cmd += ["-W", w]
        return cmd

    def runtest(self) -> None:
        with tempfile.TemporaryDirectory(prefix="torchshard-spmd-") as tmp:
            report = os.path.join(tmp, "reports.jsonl")
            cmd = self._command(report, os.path.join(tmp, "basetemp"))
            proc = subprocess.run(
                cmd,
                cwd=self.config.rootpath,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                check=False,
            )
            records = []
            if os.path.exists(report):
                with open(report) as f:
                    records = [json.loads(line) for line in f if line.strip()]
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
            tail = "\n".join(proc.stdout.splitlines()[-_TAIL:])
            raise ChildFailedError(
                f"{header}\nthe child ran no test with this node id (exit status "
                f"{proc.returncode}); the end of its output:\n{tail}"
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
