"""``python -m benchmarks --plot``: throughput against batch size, from the ``sweep`` figures of
one run."""

from __future__ import annotations

from typing import Any

from benchmarks.sweep import METHODS, NAME, label_bytes, size_label
from torchshard._core.optional import require_matplotlib
from torchshard._tools.bench._report import Report

BENCH = NAME  # the bench whose figures it draws, added to a run that asks for --plot

_STYLE: dict[str, dict[str, Any]] = {
    "torchshard": {"color": "C0", "marker": "o", "linewidth": 2.2},
    "direct": {"color": "C1", "marker": "s", "linestyle": "--"},
    "to+mark_sharding": {"color": "C3", "marker": "^", "linestyle": "--"},
    "memcpy": {"color": "0.4", "marker": "", "linestyle": ":"},
}
_LABEL = {
    "torchshard": "torchshard host_to_global_array",
    "direct": "torch_xla _global_tensor_from_cpu_shards (direct)",
    "to+mark_sharding": "torch_xla .to() + mark_sharding",
    "memcpy": "host memcpy of the same bytes (local ceiling)",
}


def check_plot_available() -> None:
    """Raises ``MissingDependencyError`` before a run whose ``--plot`` could not be drawn."""
    require_matplotlib("bench --plot")


def plot_sweep(report: Report, path: str) -> None:
    """Writes a PNG of GB/s against bytes per host for every method of the sweep."""
    require_matplotlib("bench --plot")
    from matplotlib.figure import Figure

    series: dict[str, list[tuple[int, float, float]]] = {m: [] for m in METHODS}  # x, best, med
    for f in report.figures:
        if f.bench == NAME and f.method in series:
            median = f.median if f.median is not None else f.value
            series[f.method].append((label_bytes(f.case), f.value, median))
    if not any(series.values()):
        raise ValueError("bench --plot: the report holds no sweep figures to plot.")
    fig = Figure(figsize=(8.5, 5.2))
    ax: Any = fig.add_subplot()
    sizes: set[int] = set()
    for method, points in series.items():
        if not points:
            continue
        points.sort()
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        down = [max(p[1] - p[2], 0.0) for p in points]  # from the best round to the median
        sizes.update(xs)
        ax.errorbar(
            xs, ys, yerr=[down, [0.0] * len(xs)], label=_LABEL[method], capsize=2, **_STYLE[method]
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(sizes)
    ax.set_xticks(ticks, [size_label(n) for n in ticks])
    devices = report.meta.get("settings", {}).get("devices", 8)
    ax.set_xlabel(f"batch bytes per host (float32, dim 0 split over {devices} devices)")
    ax.set_ylabel("GB/s (best round; bars down to the median round)")
    machine = report.meta.get("machine", {})
    where = ", ".join(
        str(v)
        for v in (
            f"{machine.get('nproc')} cores" if machine.get("nproc") else None,
            machine.get("cpu_model"),
            f"{devices} CPU-emulated devices",
        )
        if v
    )
    ax.set_title(f"host -> global throughput, mesh ({devices},)\n{where}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
