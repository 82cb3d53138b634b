"""Timing, figures, ratios and their rendering (table, JSON)."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Figure:
    """One measured quantity of one method in one case."""

    bench: str
    case: str
    method: str
    value: float
    unit: str


@dataclasses.dataclass
class Ratio:
    """``numerator / denominator`` of two methods' figures in one case (>1: numerator better)."""

    bench: str
    case: str
    numerator: str
    denominator: str
    value: float
    target: float | None = None

    @property
    def ok(self) -> bool | None:
        """Whether the target is met (None without a target)."""
        return None if self.target is None else self.value >= self.target


@dataclasses.dataclass
class Report:
    """Everything a bench run measured."""

    figures: list[Figure] = dataclasses.field(default_factory=list)
    ratios: list[Ratio] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    progress: Callable[[str], None] = lambda _msg: None

    def figure(self, bench: str, case: str, method: str, value: float, unit: str) -> None:
        """Records a figure."""
        self.figures.append(Figure(bench, case, method, value, unit))

    def ratio(
        self,
        bench: str,
        case: str,
        numerator: str,
        denominator: str,
        value: float,
        target: float | None = None,
    ) -> None:
        """Records a ratio."""
        self.ratios.append(Ratio(bench, case, numerator, denominator, value, target))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every figure and ratio."""
        return {
            "figures": [dataclasses.asdict(f) for f in self.figures],
            "ratios": [dataclasses.asdict(r) | {"ok": r.ok} for r in self.ratios],
            "notes": list(self.notes),
        }

    def write_json(self, path: str) -> None:
        """Writes ``to_json()`` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    def render(self) -> str:
        """A plain-text table of figures and ratios."""
        lines = []
        if self.figures:
            rows = [("bench", "case", "method", "value", "unit")]
            rows += [(f.bench, f.case, f.method, f"{f.value:.4g}", f.unit) for f in self.figures]
            lines += _table(rows)
        if self.ratios:
            lines.append("")
            rows = [("bench", "case", "ratio", "value", "target")]
            for r in self.ratios:
                target = "" if r.target is None else f">= {r.target:g} " + (
                    "ok" if r.ok else "MISSED"
                )
                rows.append(
                    (r.bench, r.case, f"{r.numerator} / {r.denominator}", f"{r.value:.3f}x", target)
                )
            lines += _table(rows)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def compare(
    methods: dict[str, Callable[[], Any]],
    *,
    rounds: int = 15,
    min_seconds: float = 0.03,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Median seconds per call of each method, measured in interleaved rounds.

    Every round times each method once, in a shuffled order, so that machine noise and
    allocator state spread evenly over the methods; the median over rounds is reported.
    """
    rng = random.Random(seed)
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    # Calls per sample so that one sample lasts about min_seconds.
    reps = {}
    for name, fn in methods.items():
        t0 = time.perf_counter()
        fn()
        dt = max(time.perf_counter() - t0, 1e-6)
        reps[name] = max(1, int(min_seconds / dt))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn, n = methods[name], reps[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(s) for name, s in samples.items()}
