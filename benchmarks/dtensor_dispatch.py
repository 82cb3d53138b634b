"""In-step dispatch on DTensors, on real gloo processes: torchshard's gather against DTensor's own.

``InputDispatcher.physical_to_logical_batch`` on the DTensor backend turns the row-target key
into gather indices (an all-gather of the ``[P]`` int64 key, then the same scatter on every
rank) and gathers the rows with ``InStep.take_rows``: each rank copies the logical rows it
holds into an ``[L, W]`` tensor that is ``-0.0`` elsewhere, and a ``Partial`` -> ``Shard(0)``
redistribute sums them over the ranks (reduce-scatter), so only logical rows move. Methods, on
``PROCESSES`` processes and a ``(PROCESSES,)`` mesh, each from the assembled physical batch to
the logical batch split over ``data``:

- ``torchshard``: ``physical_to_logical_batch``.
- ``DTensor index_select``: the same key conversion, then ``torch.index_select`` with the
  indices as a replicated DTensor (DTensor all-gathers the ``[P, W]`` batch, padding rows
  included) and a redistribute to ``Shard(0)`` (a local slice).

Cases: ``[P, 1024]`` float32 for P = 256 and 1024, with L = P/2 and L = P/8 logical rows (every
feed reads; each pads ``P/n - L/n`` rows). Figures are microseconds per call (median over
samples, rank 0). Bytes: the data each rank receives, ``(n-1)/n * P * W * 4`` for the
all-gather; a ring reduce-scatter of the ``[L, W]`` sum receives ``(n-1)/n * L * W * 4`` (gloo
may implement it as an all-reduce, which moves twice that).
"""

from __future__ import annotations

from typing import Any

from torchshard._tools.bench._report import Report
from torchshard._tools.bench.dtensor import finish_gloo_worker, measure, run_gloo_workers

NAME = "dtensor_dispatch"
DESCRIPTION = "DTensor in-step dispatch on gloo processes: take_rows vs DTensor's index_select"
PROCESSES = (2, 4)
WIDTH = 1024
CASES = {f"P={p} L={p // k}": (p, p // k) for p in (256, 1024) for k in (2, 8)}


def run(report: Report) -> None:
    """Starts the worker processes (2, then 4) and records their figures and ratios."""
    for n in PROCESSES:
        report.progress(f"dtensor_dispatch: {n} gloo processes")
        secs = run_gloo_workers("benchmarks.dtensor_dispatch", n)
        for case, by_method in secs.items():
            name = f"{n} processes, {case}"
            for method, s in by_method.items():
                report.figure(NAME, name, method, s * 1e6, "us/call")
            report.ratio(
                NAME,
                name,
                "torchshard",
                "DTensor index_select",
                by_method["DTensor index_select"] / by_method["torchshard"],
            )
    report.notes.append(
        f"dtensor_dispatch: [P, {WIDTH}] float32 over gloo on loopback; all-gather bytes per "
        "rank (n-1)/n*P*W*4, the reduce-scatter's (n-1)/n*L*W*4"
    )


def _worker() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    import torchshard as ts
    from torchshard._backend.registry import lookup
    from torchshard._step.dispatch import row_targets_to_indices

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ts.create_device_mesh((world,), ("data",), backend="dtensor")
    backend = lookup(mesh)
    key = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY
    figures = {}
    with mesh:
        for case, (physical, logical) in CASES.items():
            d = ts.InputDispatcher(logical, global_physical_batch_size=physical)
            fl = d.feed_logical_batch_size
            x = np.random.default_rng(rank).standard_normal((fl, WIDTH), dtype=np.float32)
            g = ts.host_to_global_array(
                d.logical_to_physical_batch({"x": x}), partition=d.partition_spec
            )

            def ours(g: Any = g, d: Any = d) -> Any:
                return d.physical_to_logical_batch(g)["x"].to_local()

            def theirs(g: Any = g, logical: int = logical) -> Any:
                index = row_targets_to_indices(backend.step.full_local(g[key]), logical)
                index = DTensor.from_local(index, mesh.native, [Replicate()], run_check=False)
                out = torch.index_select(g["x"], 0, index)
                return ts.maybe_shard(out, ts.P("data")).to_local()

            assert torch.equal(ours(), theirs())
            figures[case] = measure({"torchshard": ours, "DTensor index_select": theirs})
    finish_gloo_worker(figures)


if __name__ == "__main__":
    _worker()
