"""Timing, figures, ratios and their plain rendering (table, JSON).

Measurement method (``measure``; ``compare`` returns each method's best round):

1. Warm-up: every method runs ``warmup`` times (compilation, allocator, caches).
2. Calibration: each method is timed three times on its own; the fastest call sets how many
   calls make one sample (about ``min_seconds``), so that a sample is long enough for the
   timer and short enough to interleave often.
3. Rounds: each round times one sample of every method, in a freshly shuffled order, after a
   ``gc.collect()`` and with the garbage collector off during the samples (as ``timeit``
   does). Interleaving spreads slow phases of a shared machine (other processes, frequency
   changes) evenly over the methods instead of penalising whichever ran during them.
4. Statistics. A figure is the best (fastest) round, as ``timeit`` advises: other processes
   only ever slow a sample down, so the fastest round is the closest to the method's own cost;
   the median is kept too, and the interquartile range over the median is the figure's
   ``spread`` (how disturbed the run was). A ratio between two methods is the median of the
   per-round ratios (``paired_ratio``): both samples of a round ran within milliseconds of
   each other, so the drift of the machine cancels out of each pair.

   Why (10 repetitions of the h2g case 1x[1024,2048] f32 on mesh (8,), 15 rounds each, on the
   shared 2-core machine with a load average of 4.5): the relative standard deviation across
   repetitions of torchshard's time was 2.35 for the median and 0.46 for the best round; of
   the ratio torchshard / direct, 0.31 as a ratio of medians, 0.06 as a ratio of best rounds
   and 0.07 as the median of paired ratios; of torchshard / to+mark_sharding, 0.44, 0.22 and
   0.18.

``configure(quick=True)`` (the CLI's ``--quick``) cuts every measurement to a minimum (3 rounds,
1 warm-up call, one call per sample) and tells benches, through ``Report.quick``, to use tiny
sizes: for tests of the command line, not for figures.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class _Settings:
    quick: bool = False


_SETTINGS = _Settings()


def configure(*, quick: bool) -> None:
    """Sets process-wide measurement options (read by ``measure`` and ``Report.quick``)."""
    _SETTINGS.quick = quick


@dataclasses.dataclass
class Figure:
    """One measured quantity of one method in one case. For timed figures ``value`` comes from
    the best round, ``median`` from the median round, and ``spread`` is the interquartile range
    of the rounds over their median (0.08: the middle half of the rounds lies within 8%)."""

    bench: str
    case: str
    method: str
    value: float
    unit: str
    spread: float | None = None
    median: float | None = None


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


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call of one method: one sample per round, in round order."""

    samples: tuple[float, ...]
    calls: int  # calls per sample

    @property
    def best(self) -> float:
        """The fastest round's seconds per call."""
        return min(self.samples)

    @property
    def median(self) -> float:
        """The median seconds per call."""
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """The first and third quartiles of the samples."""
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q1, q3

    @property
    def spread(self) -> float:
        """The interquartile range relative to the median."""
        q1, q3 = self.quartiles
        return (q3 - q1) / self.median if self.median > 0 else 0.0


@dataclasses.dataclass
class Report:
    """Everything a bench run measured, plus ``meta`` (machine, settings) for the JSON."""

    figures: list[Figure] = dataclasses.field(default_factory=list)
    ratios: list[Ratio] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    progress: Callable[[str], None] = lambda _msg: None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def quick(self) -> bool:
        """True under ``--quick``: benches should use tiny sizes (CLI tests)."""
        return _SETTINGS.quick

    @property
    def verdicts(self) -> bool:
        """Whether targets are judged: not under ``--quick``, whose tiny sizes and 3 rounds
        measure noise (the target stays in the JSON, its ``ok`` is null)."""
        return not _SETTINGS.quick

    def figure(
        self,
        bench: str,
        case: str,
        method: str,
        value: float,
        unit: str,
        *,
        spread: float | None = None,
        median: float | None = None,
    ) -> None:
        """Records a figure."""
        self.figures.append(Figure(bench, case, method, value, unit, spread, median))

    def throughput(
        self, bench: str, case: str, timings: dict[str, Timing], nbytes: int
    ) -> dict[str, float]:
        """Records ``nbytes`` / time of each method in GB/s: best round, median, spread."""
        out = {}
        for method, t in timings.items():
            out[method] = nbytes / t.best / 1e9
            self.figure(
                bench,
                case,
                method,
                out[method],
                "GB/s",
                spread=t.spread,
                median=nbytes / t.median / 1e9,
            )
        return out

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
        """A JSON-ready dict of every figure and ratio, the notes and ``meta``."""
        return {
            **self.meta,
            "figures": [dataclasses.asdict(f) for f in self.figures],
            "ratios": [
                dataclasses.asdict(r) | {"ok": r.ok if self.verdicts else None} for r in self.ratios
            ],
            "notes": list(self.notes),
        }

    def write_json(self, path: str) -> None:
        """Writes ``to_json()`` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    def figure_rows(self) -> list[tuple[str, ...]]:
        """Header and rows of the figure table."""
        rows: list[tuple[str, ...]] = [
            ("bench", "case", "method", "value", "median", "spread", "unit")
        ]
        for f in self.figures:
            spread = "" if f.spread is None else f"{100 * f.spread:.0f}%"
            median = "" if f.median is None else f"{f.median:.4g}"
            rows.append((f.bench, f.case, f.method, f"{f.value:.4g}", median, spread, f.unit))
        return rows

    def ratio_rows(self) -> list[tuple[str, ...]]:
        """Header and rows of the ratio table."""
        rows: list[tuple[str, ...]] = [("bench", "case", "ratio", "value", "target")]
        for r in self.ratios:
            target = ""
            if r.target is not None and self.verdicts:
                target = f">= {r.target:g} " + ("ok" if r.ok else "MISSED")
            rows.append(
                (r.bench, r.case, f"{r.numerator} / {r.denominator}", f"{r.value:.3f}x", target)
            )
        return rows

    def render(self) -> str:
        """A plain-text table of figures and ratios."""
        lines = []
        if self.figures:
            lines += _table(self.figure_rows())
        if self.ratios:
            lines.append("")
            lines += _table(self.ratio_rows())
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


def _time_once(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(
    methods: dict[str, Callable[[], Any]],
    *,
    rounds: int = 15,
    min_seconds: float = 0.03,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, Timing]:
    """Seconds per call of each method, in interleaved, shuffled rounds (module docstring)."""
    if _SETTINGS.quick:
        rounds, warmup, min_seconds = min(rounds, 3), min(warmup, 1), 0.0
    rng = random.Random(seed)
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    calls = {}
    for name, fn in methods.items():
        best = min(_time_once(fn) for _ in range(3))
        calls[name] = max(1, min(int(min_seconds / max(best, 1e-7)), 100_000))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    gc_enabled = gc.isenabled()
    try:
        for _ in range(rounds):
            rng.shuffle(order)
            gc.collect()
            gc.disable()
            for name in order:
                fn, n = methods[name], calls[name]
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[name].append((time.perf_counter() - t0) / n)
            if gc_enabled:
                gc.enable()
    finally:
        if gc_enabled:
            gc.enable()
    return {name: Timing(tuple(s), calls[name]) for name, s in samples.items()}


def compare(
    methods: dict[str, Callable[[], Any]],
    *,
    rounds: int = 15,
    min_seconds: float = 0.03,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Seconds per call of each method: its best round of ``measure`` (module docstring)."""
    timings = measure(methods, rounds=rounds, min_seconds=min_seconds, warmup=warmup, seed=seed)
    return {name: t.best for name, t in timings.items()}


def paired_ratio(timings: dict[str, Timing], numerator: str, denominator: str) -> float:
    """How many times faster ``numerator`` is than ``denominator``: the median over rounds of
    ``time(denominator) / time(numerator)`` (>1: numerator faster)."""
    num, den = timings[numerator].samples, timings[denominator].samples
    return statistics.median(d / n for n, d in zip(num, den, strict=True) if n > 0)
