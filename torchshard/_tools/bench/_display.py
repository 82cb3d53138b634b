"""What a bench run shows while and after it runs: a progress bar on stderr and the tables.

With ``rich`` installed and a terminal, a live bar (benches done, the current case, elapsed
time) and coloured tables; otherwise one plain line per step on stderr and plain tables, which
is also what pipes, files and CI logs get.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Any

from torchshard._core.optional import available
from torchshard._tools.bench._report import Report


def use_rich(stream: IO[str], *, plain: bool) -> bool:
    """Whether to draw with rich on ``stream``: installed, a terminal, not ``--plain``."""
    return not plain and available("rich") and stream.isatty()


class Progress:
    """Progress over ``total`` benches; ``message`` is the ``Report.progress`` callback."""

    def __init__(self, total: int, *, stream: IO[str] | None = None, plain: bool = False) -> None:
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self.name = ""
        self.t0 = time.perf_counter()
        self._rich: Any = None
        self._task: Any = None
        if use_rich(self.stream, plain=plain):
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
            )

    def __enter__(self) -> Progress:
        if self._rich is not None:
            self._rich.start()
            self._task = self._rich.add_task("bench", total=self.total)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._rich is not None:
            self._rich.stop()

    def start(self, name: str) -> None:
        """A bench starts."""
        self.name = name
        self.message(f"{name}: starting")

    def message(self, text: str) -> None:
        """The current step (a bench's ``report.progress(...)``)."""
        if self._rich is not None:
            self._rich.update(self._task, description=text)
            return
        elapsed = time.perf_counter() - self.t0
        bar = "#" * self.done + "." * (self.total - self.done)
        print(f"[{bar}] {self.done}/{self.total} {elapsed:6.1f}s  {text}", file=self.stream)
        self.stream.flush()

    def advance(self) -> None:
        """The current bench is done."""
        self.done += 1
        if self._rich is not None:
            self._rich.update(self._task, advance=1)
        else:
            self.message(f"{self.name}: done")


def print_tables(report: Report, *, file: IO[str] | None = None, plain: bool = False) -> None:
    """The figure and ratio tables (rich on a terminal, else ``Report.render()``)."""
    file = sys.stdout if file is None else file
    if not use_rich(file, plain=plain):
        print(report.render(), file=file)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file)
    if report.figures:
        table = Table(title="figures (best of interleaved rounds; median; spread = IQR / median)")
        justified = ("left", "left", "left", "right", "right", "right", "left")
        for name, justify in zip(report.figure_rows()[0], justified, strict=True):
            table.add_column(name, justify=justify)
        for row in report.figure_rows()[1:]:
            table.add_row(*row)
        console.print(table)
    if report.ratios:
        table = Table(title="ratios (median of per-round ratios; >1: numerator faster)")
        for name in report.ratio_rows()[0]:
            table.add_column(name)
        for r, row in zip(report.ratios, report.ratio_rows()[1:], strict=True):
            style = "" if r.ok is None or not report.verdicts else ("green" if r.ok else "bold red")
            table.add_row(*row, style=style)
        console.print(table)
    for note in report.notes:
        console.print(f"note: {note}")
