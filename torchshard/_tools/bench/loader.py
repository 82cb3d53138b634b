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
- ``torchshard, GIL-holding transfer``: the same loader with the foreground transfer
  (``_global_tensor_from_cpu_shards``, one host copy less but it holds the GIL, stalling the
  step's Python on the consumer thread): what ``GlobalBatchLoader`` did before.
- ``MpDeviceLoader``: torch_xla's ``MpDeviceLoader`` with the ``input_sharding`` that works for
  it: ``ShardingSpec(mesh, ("data", None))`` for ``x`` and ``("data",)`` for ``y`` (dim 0 over
  all devices), default prefetch sizes.
- ``no prefetch``: ``host_to_global_array`` inside the loop.
- ``pre-transferred``: batches transferred before the loop; no input work at all, the ceiling.

Figures: steps/s and the input-wait fraction (time in ``next()`` / step time); and the GIL
stall a transfer thread inflicts on the main thread: a thread transfers batches back to back
while the main thread sleeps 0.5 ms at a time; the mean overshoot of those sleeps is the time
it waited for the GIL. Targets: torchshard's input wait < 5 %; torchshard >= 1.0x
MpDeviceLoader's steps/s.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch

from torchshard._backend.registry import lookup
from torchshard._backend.xla import backend as xla
from torchshard._core.context import current_mesh, require_mesh, thread_mesh
from torchshard._mesh.context import current_topology
from torchshard._place.call import read
from torchshard._place.place import to_global
from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report, compare

NAME = "loader"
DESCRIPTION = "training loop fed by GlobalBatchLoader vs MpDeviceLoader vs no prefetch"
ROWS, COLS = 1024, 1024
DEVICE_MS = 20.0
STEPS = 60
ROUNDS = 9
WAIT_TARGET = 0.05
HOLDING = "torchshard, GIL-holding transfer"
STALL_SECONDS = 1.5


def transfer(batch: Any, spec: Any, background: bool, *_: Any) -> Any:
    """One batch through the engine, as the loader's thread (``background``) or the
    foreground transfers it (the agreement step left out, as on the loader's thread)."""
    mesh = current_mesh()
    if mesh is None:
        mesh = require_mesh("transfer")  # raises NoMeshError
    backend, topology = lookup(mesh), current_topology(mesh)
    call = read([batch], topology, spec, per_host=False)
    return to_global(mesh, backend, topology, call, background=background)


class HoldingLoader:
    """A ``GlobalBatchLoader`` whose thread transfers with the GIL-holding call: while it is
    iterated, the torch_xla backend's GIL-free route is off (its size threshold is infinite)."""

    def __init__(self, source: Iterable[Any], **options: Any) -> None:
        import torchshard as ts

        self._loader = ts.GlobalBatchLoader(source, **options)
        self._threshold = xla.GIL_FREE_MIN_BYTES

    def __iter__(self) -> Iterator[Any]:
        xla.GIL_FREE_MIN_BYTES = math.inf
        return iter(self._loader)

    def close(self) -> None:
        """Stops the loader and restores the backend's threshold."""
        self._loader.close()
        xla.GIL_FREE_MIN_BYTES = self._threshold


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


def gil_stall(transfer: Callable[[], Any], seconds: float) -> float:
    """Mean seconds the main thread waits for the GIL after a 0.5 ms sleep while another
    thread runs ``transfer`` back to back (0 if ``transfer`` releases the GIL)."""
    import threading

    stop = threading.Event()

    def loop() -> None:
        keep: list[Any] = []
        while not stop.is_set():
            keep = [*keep[-3:], transfer()]

    thread = threading.Thread(target=loop, name="bench-transfer", daemon=True)
    thread.start()
    over, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.0005)
        over.append(time.perf_counter() - t - 0.0005)
    stop.set()
    thread.join()
    return statistics.mean(over)


def transfer_figures(
    report: Report, case: str, mesh: Any, make: Callable[[bool], Callable[[bool], Any]]
) -> None:
    """The GIL stall a transfer thread inflicts, and one transfer's cost alone, for the
    loader's background transfer and the GIL-holding one (``make(background)`` transfers one
    batch)."""
    import torch_xla.core.xla_model as xm

    def in_thread(fn: Callable[[bool], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with thread_mesh(mesh):  # the mesh context is per thread
                return fn(True)

        return call

    def to_completion(fn: Callable[[bool], Any]) -> Callable[[], Any]:
        def call() -> Any:
            out = fn(True)
            xm.wait_device_ops()
            return out

        return call

    report.progress("loader: GIL stall of a transfer thread")
    for name, background in (("torchshard", True), (HOLDING, False)):
        stall = gil_stall(in_thread(make(background)), STALL_SECONDS)
        report.figure(NAME, case, f"{name}: main thread's GIL wait", 1e3 * stall, "ms/0.5 ms")
    report.progress("loader: one transfer, single-threaded")
    alone = compare({"torchshard": to_completion(make(True)), HOLDING: to_completion(make(False))})
    for name, secs in alone.items():
        report.figure(NAME, case, f"{name}: one transfer alone", 1e3 * secs, "ms")
    xm.wait_device_ops()


def run(report: Report) -> None:
    """Measures steps/s and the input-wait fraction of each method; records the ratios."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs

    import torchshard as ts

    mesh = _devices.data_mesh()  # (8,); (N,) with --devices N
    spec = ts.P("data")
    rows = _devices.round_up(ROWS, mesh.size)  # dim 0 splits evenly
    pool = host_batches(8, rows=rows)
    device = torch_xla.device()
    weight = torch.randn(COLS, 64).to(device)

    def source() -> Iterator[dict[str, torch.Tensor]]:
        for i in range(STEPS + 8):  # a little more than a run needs
            yield pool[i % len(pool)]

    def step(batch: Any) -> None:
        out = (batch["x"] @ weight).sum() + batch["y"].sum()
        torch_xla.sync()
        out.item()  # waits for this step's result (not for transfers in flight)
        time.sleep(DEVICE_MS / 1e3)

    def no_prefetch() -> Iterator[Any]:
        for b in source():
            yield ts.host_to_global_array(b, partition=spec)

    sharding = {
        "x": xs.ShardingSpec(mesh.xla_mesh, ("data", None)),
        "y": xs.ShardingSpec(mesh.xla_mesh, ("data",)),
    }
    pre: list[Any] = []
    methods: dict[str, Callable[[], Any]] = {
        "torchshard": lambda: ts.GlobalBatchLoader(source(), partition=spec, prefetch=2),
        HOLDING: lambda: HoldingLoader(source(), partition=spec, prefetch=2),
        "MpDeviceLoader": lambda: pl.MpDeviceLoader(source(), device, input_sharding=sharding),
        "no prefetch": no_prefetch,
        "pre-transferred": lambda: iter([pre[i % len(pre)] for i in range(STEPS + 8)]),
    }

    case = f"[{rows},{COLS}] f32 {_devices.label(mesh)}, step {DEVICE_MS:g} ms device + sync"
    with mesh:
        pre += [ts.host_to_global_array(b, partition=spec) for b in pool]
        transfer_figures(report, case, mesh, lambda bg: partial(transfer, pool[0], spec, bg))
        xm.wait_device_ops()
        report.progress("loader: warm-up (compiles the step)")
        for make in methods.values():
            run_loop(make(), step, 5)
        samples: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        transfer_s: list[float] = []  # seconds per batch in the loader thread's transfer
        order = list(methods)
        rng = random.Random(0)
        for r in range(ROUNDS):
            rng.shuffle(order)
            for name in order:
                report.progress(f"loader: round {r + 1}/{ROUNDS} {name}")
                loader = methods[name]()
                samples[name].append(run_loop(loader, step, STEPS))
                if name == "torchshard":
                    stats = loader.stats
                    transfer_s.append(stats.transfer_seconds / stats.batches)

    rate: dict[str, float] = {}
    for name, runs in samples.items():
        secs = statistics.median(s for s, _ in runs)
        waits = statistics.median(w / s for s, w in runs)
        rate[name] = STEPS / secs
        report.figure(NAME, case, name, rate[name], "steps/s")
        report.figure(NAME, case, f"{name} input wait", 100 * waits, "% of step")
    step_ms = 1e3 * statistics.median(s / STEPS for s, _ in samples["torchshard"])
    report.figure(NAME, case, "torchshard step", step_ms, "ms")
    report.figure(
        NAME, case, "torchshard transfer", 1e3 * statistics.median(transfer_s), "ms/batch"
    )
    vs_mp = rate["torchshard"] / rate["MpDeviceLoader"]
    report.ratio(NAME, case, "torchshard", "MpDeviceLoader", vs_mp, 1.0)
    report.ratio(NAME, case, "torchshard", HOLDING, rate["torchshard"] / rate[HOLDING])
    report.ratio(NAME, case, "torchshard", "no prefetch", rate["torchshard"] / rate["no prefetch"])
    report.ratio(
        NAME,
        case,
        "pre-transferred",
        "MpDeviceLoader",
        rate["pre-transferred"] / rate["MpDeviceLoader"],
    )
    wait = statistics.median(w / s for s, w in samples["torchshard"])
    verdict = "ok" if wait < WAIT_TARGET else "MISSED"
    report.notes.append(
        f"loader: torchshard input wait {wait:.1%} of step time (target < {WAIT_TARGET:.0%}): "
        f"{verdict}"
    )
