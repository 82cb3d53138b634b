"""The loader's first-batch value check: what it adds to each epoch, on real gloo processes.

On several DTensor processes ``GlobalBatchLoader`` compares, by default, the values that
processes sharing a block pass at the first batch of every epoch (a blake2b checksum of each
process's block, one exchange; docs/design.md, "The value check"). Starts ``PROCESSES`` fresh
interpreters on a ``(PROCESSES,)`` mesh over ``data``; each method runs one short epoch
(``BATCHES`` batches, ``prefetch=0`` so that the epoch's time is the consumer's) of a
``host_sampler`` feed, in lockstep on every rank:

- ``default (first batch checked)``: ``set_value_check(None)``, the default.
- ``value check off``: ``set_value_check(False)``.

Figures: milliseconds per epoch (median over samples, rank 0), and ``first-batch check``, the
check's own cost per epoch: the median over samples of (default - off), both timed in each
sample. Cases: the block each process passes per batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torchshard._tools.bench._report import Report
from torchshard._tools.bench.dtensor import finish_gloo_worker, measure, run_gloo_workers

NAME = "epoch_check"
DESCRIPTION = "the loader's first-batch value check: its cost per epoch on gloo processes"
PROCESSES = 2
BATCHES = 2
CASES = {"[32,16] f32": (32, 16), "[256,1024] f32": (256, 1024), "[1024,4096] f32": (1024, 4096)}
CHECK = "first-batch check"


def run(report: Report) -> None:
    """Starts the worker processes and records their figures."""
    report.progress(f"{NAME}: {PROCESSES} gloo processes")
    env = {"TORCHSHARD_BENCH_QUICK": "1"} if report.quick else {}
    ms = run_gloo_workers(f"benchmarks.{NAME}", PROCESSES, env=env)
    for case, by_method in ms.items():
        for method, s in by_method.items():
            report.figure(NAME, case, method, s * 1e3, "ms/epoch")
    report.notes.append(
        f"{NAME}: epochs of {BATCHES} batches per process ({PROCESSES} processes over gloo on "
        f"loopback, prefetch=0); {CHECK} = median of (default - off) per sample"
    )


def _worker() -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import torchshard as ts

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = ts.create_device_mesh((world,), ("data",), backend="dtensor")
    quick = bool(os.environ.get("TORCHSHARD_BENCH_QUICK"))
    cases = dict(list(CASES.items())[:1]) if quick else CASES
    figures = {}
    with mesh:
        for case, (rows, cols) in cases.items():
            data: Any = list(torch.randn(rows * BATCHES * world, cols))
            sampler = ts.host_sampler(data, ts.P("data"))
            loader = ts.GlobalBatchLoader(
                DataLoader(data, batch_size=rows, sampler=sampler),
                partition=ts.P("data"),
                prefetch=0,
            )

            def epoch(check: bool | None, loader: Any = loader) -> Callable[[], Any]:
                def one() -> Any:
                    old = ts.set_value_check(check)
                    try:
                        return [b.shape for b in loader]
                    finally:
                        ts.set_value_check(old)

                return one

            methods = {
                "default (first batch checked)": epoch(None),
                "value check off": epoch(False),
            }
            diff = {CHECK: ("default (first batch checked)", "value check off")}
            figures[case] = measure(methods, diff)
    finish_gloo_worker(figures)


if __name__ == "__main__":
    _worker()
