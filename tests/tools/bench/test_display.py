"""The bench's display (torchshard._tools.bench._display): tables and progress, plain or with rich
on a terminal (no timing asserted)."""

from __future__ import annotations

import io
import sys

import pytest

from torchshard._tools.bench._display import Progress, print_tables
from torchshard._tools.bench._report import (
    Report,
    Timing,
)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _report():
    report = Report(meta={"machine": {"nproc": 2}})
    report.throughput("h2g", "case A", {"torchshard": Timing((0.5, 1.0, 1.0), 1)}, 10**9)
    report.figure("loader", "case B", "x", 12.5, "steps/s")
    report.ratio("h2g", "case A", "torchshard", "direct", 0.9, 0.95)
    report.ratio("h2g", "case A", "torchshard", "to+mark_sharding", 2.0, 1.5)
    report.notes.append("a note")
    return report


def test_rich_tables_on_a_terminal():
    out = _Terminal()
    print_tables(_report(), file=out)
    text = out.getvalue()
    for cell in ("torchshard / direct", "MISSED", "steps/s", "note: a note", "spread"):
        assert cell in text
    plain = _Terminal()
    print_tables(_report(), file=plain, plain=True)
    assert plain.getvalue() == _report().render() + "\n"


def test_plain_progress_lines():
    out = io.StringIO()
    with Progress(2, stream=out) as p:
        p.start("h2g")
        p.message("h2g case 1")
        p.advance()
        p.start("g2h")
        p.advance()
    lines = [line.split("s  ", 1) for line in out.getvalue().splitlines()]
    assert [(head[:9], tail) for head, tail in lines] == [
        ("[..] 0/2 ", "h2g: starting"),
        ("[..] 0/2 ", "h2g case 1"),
        ("[#.] 1/2 ", "h2g: done"),
        ("[#.] 1/2 ", "g2h: starting"),
        ("[##] 2/2 ", "g2h: done"),
    ]


def test_rich_progress_on_a_terminal():
    out = _Terminal()
    with Progress(1, stream=out) as p:
        p.start("sweep")
        p.message("sweep 1 KiB per host")
        p.advance()
    assert "1/1" in out.getvalue()


def test_rich_is_used_on_a_terminal_unless_plain(monkeypatch):
    from torchshard._tools.bench._display import use_rich

    pytest.importorskip("rich")
    assert use_rich(_Terminal(), plain=False) is True
    assert use_rich(_Terminal(), plain=True) is False
    assert use_rich(io.StringIO(), plain=False) is False  # not a terminal
    monkeypatch.setitem(sys.modules, "rich", None)
    assert use_rich(_Terminal(), plain=False) is False  # not installed


def test_plain_tables_go_to_stdout_by_default(capsys):
    print_tables(_report())
    assert capsys.readouterr().out == _report().render() + "\n"
