"""Input pipelines feeding the same training loop: GlobalBatchLoader, MpDeviceLoader, no prefetch.

Mesh ``(8,)`` (axis ``data``; ``(N,)`` with ``--devices N``, the rows rounded up to a multiple
of N); each host batch is ``{"x": [1024, 1024] f32, "y": [1024] i64}``
(4.2 MB), split on dim 0 over the 8 devices. The step consumes the batch on the devices (a
matmul with a replicated weight, ``torch_xla.sync()``, read the result) and then sleeps
``DEVICE_MS`` to stand for the rest of the device's work: on the CPU emulation the "devices"
share the host's cores with the input thread, which a TPU's do not, so real compute would
measure core contention instead of the input pipeline. The step is slower than the transfer
(both are printed), which is the regime where prefetching should hide the input entirely.

Methods (the same host batches, the same step, interleaved rounds, medians):

- ``torchshard``: ``GlobalBatchLoader(source, partition=P("data"), prefetch=2)``. On its thread
  the backend transfers with torch_xla's GIL-free ``_xla_tensors_from_aten``.
- ``MpDeviceLoader``: torch_xla's ``MpDeviceLoader`` with the ``input_sharding`` that works for
  it: ``ShardingSpec(mesh, ("data", None))`` for ``x`` and ``("data",)`` for ``y`` (dim 0 over
  all devices), default prefetch sizes.
- ``no prefetch``: ``host_to_global_array`` inside the loop.
- ``pre-transferred``: batches transferred before the loop; no input work at all, the ceiling.

Figures: steps/s and the input-wait fraction (time in ``next()`` / step time), torchshard's
step and its loader's transfer per batch (``GlobalBatchLoader.stats``). Targets: torchshard's
input wait < 5 %; torchshard >= 1.0x MpDeviceLoader's steps/s. The loop (``Loop``,
``compare_loops``) is also the lab's: ``python -m benchmarks loader_gil`` feeds it from the
loader with the GIL-holding transfer (what ``GlobalBatchLoader`` did before) and measures the
GIL stall a transfer thread inflicts on the step's thread.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report

NAME = "loader"
DESCRIPTION = "training loop fed by GlobalBatchLoader vs MpDeviceLoader vs no prefetch"
ROWS, COLS = 1024, 1024
DEVICE_MS = 20.0
STEPS = 60
ROUNDS = 9
WAIT_TARGET = 0.05


def host_batches(n: int, seed: int = 0, rows: int = ROWS) -> list[dict[str, torch.Tensor]]:
    """``n`` distinct host batches of ``rows`` rows (made once, outside the timing)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(rows, COLS, generator=g), "y": torch.arange(rows) + i} for i in range(n)
    ]


def run_loop(
    batches: Iterable[Any], step: Callable[[Any], None], steps: int
) -> tuple[float, float]:
    """Runs ``steps`` steps; returns (seconds, seconds spent in ``next()``)."""
    it: Iterator[Any] = iter(batches)
    try:
        return _timed(it, step, steps)
    finally:  # stop the pipeline's threads (MpDeviceLoader has no close(): drain it)
        close = getattr(batches, "close", None)
        if callable(close):
            close()
        else:
            for _ in it:
                pass


def _timed(it: Iterator[Any], step: Callable[[Any], None], steps: int) -> tuple[float, float]:
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        batch = next(it)
        wait += time.perf_counter() - t
        step(batch)
    return time.perf_counter() - t0, wait


@dataclasses.dataclass
class Loop:
    """The training loop every method feeds: the mesh, the spec, the host batches, the step."""

    mesh: Any
    spec: Any
    rows: int
    pool: list[dict[str, torch.Tensor]]
    weight: torch.Tensor

    @property
    def case(self) -> str:
        """The case name: the batch, the mesh and the step."""
        mesh = _devices.label(self.mesh)
        return f"[{self.rows},{COLS}] f32 {mesh}, step {DEVICE_MS:g} ms device + sync"

    def source(self) -> Iterator[dict[str, torch.Tensor]]:
        """The host batches of one run (a little more than a run needs)."""
        for i in range(STEPS + 8):
            yield self.pool[i % len(self.pool)]

    def step(self, batch: Any) -> None:
        """Consumes the batch on the devices, then stands for the rest of the device's work."""
        import torch_xla

        out = (batch["x"] @ self.weight).sum() + batch["y"].sum()
        torch_xla.sync()
        out.item()  # waits for this step's result (not for transfers in flight)
        time.sleep(DEVICE_MS / 1e3)


def make_loop() -> Loop:
    """The loop on every device of the run: mesh ``(N,)`` over ``data``, dim 0 split."""
    import torch_xla

    import torchshard as ts

    mesh = _devices.data_mesh()  # (8,); (N,) with --devices N
    rows = _devices.round_up(ROWS, mesh.size)  # dim 0 splits evenly
    weight = torch.randn(COLS, 64).to(torch_xla.device())
    return Loop(mesh, ts.P("data"), rows, host_batches(8, rows=rows), weight)


def compare_loops(
    report: Report, loop: Loop, methods: dict[str, Callable[[], Any]], bench: str = NAME
) -> dict[str, float]:
    """Runs every method's pipeline (``methods``: name -> a fresh iterable of global batches)
    through the loop, inside the mesh: a warm-up, then ``ROUNDS`` rounds of ``STEPS`` steps in
    a shuffled order. Records each method's steps/s and input wait (medians over the rounds),
    and for ``torchshard`` (a ``GlobalBatchLoader``) the step and the loader's transfer per
    batch; returns the steps/s of each method."""
    import torch_xla.core.xla_model as xm

    case = loop.case
    with loop.mesh:
        xm.wait_device_ops()
        report.progress(f"{bench}: warm-up (compiles the step)")
        for make in methods.values():
            run_loop(make(), loop.step, 5)
        samples: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        transfer_s: list[float] = []  # seconds per batch in the loader thread's transfer
        order = list(methods)
        rng = random.Random(0)
        for r in range(ROUNDS):
            rng.shuffle(order)
            for name in order:
                report.progress(f"{bench}: round {r + 1}/{ROUNDS} {name}")
                loader = methods[name]()
                samples[name].append(run_loop(loader, loop.step, STEPS))
                if name == "torchshard":
                    stats = loader.stats
                    transfer_s.append(stats.transfer_seconds / stats.batches)

    rate: dict[str, float] = {}
    for name, runs in samples.items():
        secs = statistics.median(s for s, _ in runs)
        waits = statistics.median(w / s for s, w in runs)
        rate[name] = STEPS / secs
        report.figure(bench, case, name, rate[name], "steps/s")
        report.figure(bench, case, f"{name} input wait", 100 * waits, "% of step")
    if "torchshard" in samples:
        step_ms = 1e3 * statistics.median(s / STEPS for s, _ in samples["torchshard"])
        report.figure(bench, case, "torchshard step", step_ms, "ms")
        report.figure(
            bench, case, "torchshard transfer", 1e3 * statistics.median(transfer_s), "ms/batch"
        )
        wait = statistics.median(w / s for s, w in samples["torchshard"])
        verdict = "ok" if wait < WAIT_TARGET else "MISSED"
        report.notes.append(
            f"{bench}: torchshard input wait {wait:.1%} of step time (target < "
            f"{WAIT_TARGET:.0%}): {verdict}"
        )
    return rate


def run(report: Report) -> None:
    """Measures steps/s and the input-wait fraction of each method; records the ratios."""
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs

    import torchshard as ts

    loop = make_loop()
    mesh, spec = loop.mesh, loop.spec

    def no_prefetch() -> Iterator[Any]:
        for b in loop.source():
            yield ts.host_to_global_array(b, partition=spec)

    sharding = {
        "x": xs.ShardingSpec(mesh.xla_mesh, ("data", None)),
        "y": xs.ShardingSpec(mesh.xla_mesh, ("data",)),
    }
    device = torch_xla.device()
    with mesh:
        pre = [ts.host_to_global_array(b, partition=spec) for b in loop.pool]
    methods: dict[str, Callable[[], Any]] = {
        "torchshard": lambda: ts.GlobalBatchLoader(loop.source(), partition=spec, prefetch=2),
        "MpDeviceLoader": lambda: pl.MpDeviceLoader(loop.source(), device, input_sharding=sharding),
        "no prefetch": no_prefetch,
        "pre-transferred": lambda: iter([pre[i % len(pre)] for i in range(STEPS + 8)]),
    }
    rate = compare_loops(report, loop, methods)
    case = loop.case
    vs_mp = rate["torchshard"] / rate["MpDeviceLoader"]
    report.ratio(NAME, case, "torchshard", "MpDeviceLoader", vs_mp, 1.0)
    report.ratio(NAME, case, "torchshard", "no prefetch", rate["torchshard"] / rate["no prefetch"])
    report.ratio(
        NAME,
        case,
        "pre-transferred",
        "MpDeviceLoader",
        rate["pre-transferred"] / rate["MpDeviceLoader"],
    )
