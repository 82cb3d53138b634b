"""The benches users run (``python -m torchshard bench``): is torchshard the bottleneck here?

A benchmark module exposes ``NAME``, ``DESCRIPTION`` and ``run(report)``; the registry below
maps command names to modules (one line each, so that merges stay simple). ``python -m
torchshard bench <name>`` runs one, ``bench all`` runs every one in this order; the command's
choices come from this dict. The bench modules import torchshard's public modules only (and
this package's framework: ``_report``, ``_display``, ``_machine``, ``_devices``); torch_xla's
and torch's own calls are their baselines.

The maintainers' benchmarks (design comparisons, the soak, the sweep and its plot) are not in
the wheel: they are the lab at the repository root, ``python -m benchmarks`` (``benchmarks/``),
which runs these too with the same machinery.
"""

from __future__ import annotations

BENCHES: dict[str, str] = {
    "h2g": "torchshard._tools.bench.h2g",
    "overhead": "torchshard._tools.bench.overhead",
    "dtensor": "torchshard._tools.bench.dtensor",
    "h2d": "torchshard._tools.bench.h2d",
    "loader": "torchshard._tools.bench.loader",
    "packing": "torchshard._tools.bench.packing",
    "cp_balance": "torchshard._tools.bench.cp_balance",
    "torchax": "torchshard._tools.bench.torchax_h2g",
}

# Benchmarks that run on DTensor processes only: no XLA emulation is set up for them, so they
# run on a plain install (no torch_xla).
NEEDS_NO_XLA: frozenset[str] = frozenset({"dtensor", "h2d", "cp_balance", "torchax"})

# Benchmarks on the torchax backend (JAX's devices): they need jax and torchax (the extra
# ``torchax``; ``bench all`` leaves them out without it), and ``--devices`` is JAX's CPU count.
NEEDS_TORCHAX: frozenset[str] = frozenset({"torchax"})

# The module that draws ``--plot`` (none in the wheel: the lab's sweep has it), and the benches
# that start one gloo process per ``--devices`` (none here; the CLI bounds their count).
PLOT: str | None = None
GLOO_PER_DEVICE: frozenset[str] = frozenset()
