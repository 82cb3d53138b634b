"""The maintainers' benchmarks (the lab): design comparisons, soaks and sweeps, not in the wheel.

Run from a checkout's root: ``python -m benchmarks NAME [--devices N] [--quick] [--json PATH]
[--plot PATH] [--strict] [--plain] [--threads N]`` (``benchmarks/cli.py``), with the machinery of
``python -m torchshard bench`` (its options, the CPU emulation, the report, the tables, the
JSON). The registry below maps names to modules, in the order of ``all``: the wheel's benches
(``torchshard._tools.bench``, what users run) and the lab's own, so that ``python -m benchmarks
all`` is the whole run of ``docs/benchmarks.md``. A lab module exposes ``NAME``,
``DESCRIPTION`` and ``run(report)``, as the wheel's do; it may import anything of torchshard
(the wheel's bench modules included: the loop, the methods, the gloo workers), and the package
never imports the lab. Its tests are in ``benchmarks/tests/``, run by the suite (``pytest``).
"""

from __future__ import annotations

from torchshard._tools import bench as _wheel

BENCHES: dict[str, str] = {
    "h2g": _wheel.BENCHES["h2g"],
    "overhead": _wheel.BENCHES["overhead"],
    "g2h": "benchmarks.g2h",
    "dispatch": "benchmarks.dispatch",
    "dtensor": _wheel.BENCHES["dtensor"],
    "dtensor_dispatch": "benchmarks.dtensor_dispatch",
    "dtensor_loader": "benchmarks.dtensor_loader",
    "h2d": _wheel.BENCHES["h2d"],
    "loader": _wheel.BENCHES["loader"],
    "packing": _wheel.BENCHES["packing"],
    "cp_balance": _wheel.BENCHES["cp_balance"],
    "torchax": _wheel.BENCHES["torchax"],
    "loader_gil": "benchmarks.loader_gil",
    "soak": "benchmarks.soak",
    "ctrl_c": "benchmarks.ctrl_c",
    "sweep": "benchmarks.sweep",
    "ends": "benchmarks.ends",
    "epoch_check": "benchmarks.epoch_check",
    "plan_scale": "benchmarks.plan_scale",
    "exchange": "benchmarks.exchange",
    "deferred": "benchmarks.deferred",
}

# The lab's own benchmarks (the others are the wheel's, run here too).
OWN: frozenset[str] = frozenset(
    n for n, module in BENCHES.items() if module.startswith("benchmarks.")
)

# Benchmarks that run on DTensor processes only (no XLA emulation: they run on a plain install).
NEEDS_NO_XLA: frozenset[str] = _wheel.NEEDS_NO_XLA | {
    "dtensor_dispatch",
    "dtensor_loader",
    "epoch_check",
    "plan_scale",
    "exchange",
    "deferred",
}

# Benchmarks on the torchax backend (the wheel's: jax and torchax needed, left out of ``all``
# without them).
NEEDS_TORCHAX: frozenset[str] = _wheel.NEEDS_TORCHAX

# ``--plot PATH`` draws the sweep (and adds it to the run); ``dtensor_loader`` starts one gloo
# process per ``--devices`` (the CLI bounds their count).
PLOT: str | None = "benchmarks._plot"
GLOO_PER_DEVICE: frozenset[str] = frozenset({"dtensor_loader"})
