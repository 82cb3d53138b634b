"""Benchmarks: each compares methods in one run and reports figures and ratios.

A benchmark module exposes ``NAME``, ``DESCRIPTION`` and ``run(report)``; the registry below
maps command names to modules. ``python -m torchshard bench <name>`` runs them.
"""

from __future__ import annotations

BENCHES: dict[str, str] = {
    "h2g": "torchshard._bench.h2g",
    "g2h": "torchshard._bench.g2h",
    "dispatch": "torchshard._bench.dispatch",
    "dtensor": "torchshard._bench.dtensor",
    "dtensor_dispatch": "torchshard._bench.dtensor_dispatch",
}
