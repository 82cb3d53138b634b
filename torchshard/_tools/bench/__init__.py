"""Benchmarks: each compares methods in one run and reports figures and ratios.

A benchmark module exposes ``NAME``, ``DESCRIPTION`` and ``run(report)``; the registry below
maps command names to modules (one line each, so that merges stay simple). ``python -m
torchshard bench <name>`` runs one, ``bench all`` runs every one in this order; the command's
choices come from this dict.
"""

from __future__ import annotations

BENCHES: dict[str, str] = {
    "h2g": "torchshard._tools.bench.h2g",
    "overhead": "torchshard._tools.bench.overhead",
    "g2h": "torchshard._tools.bench.g2h",
    "dispatch": "torchshard._tools.bench.dispatch",
    "dtensor": "torchshard._tools.bench.dtensor",
    "dtensor_dispatch": "torchshard._tools.bench.dtensor_dispatch",
    "dtensor_loader": "torchshard._tools.bench.dtensor_loader",
    "h2d": "torchshard._tools.bench.h2d",
    "loader": "torchshard._tools.bench.loader",
    "soak": "torchshard._tools.bench.soak",
    "sweep": "torchshard._tools.bench.sweep",
    "ends": "torchshard._tools.bench.ends",
    "epoch_check": "torchshard._tools.bench.epoch_check",
}

# Benchmarks that run on DTensor processes only: no XLA emulation is set up for them, so they
# run on a plain install (no torch_xla).
NEEDS_NO_XLA: frozenset[str] = frozenset(
    {"dtensor", "dtensor_dispatch", "dtensor_loader", "epoch_check", "h2d"}
)
