"""The loader's GIL-free transfer against the GIL-holding one it replaced, on ``loader``'s loop.

A design comparison, built from torchshard's engine: what ``GlobalBatchLoader`` gained when its
thread moved from ``_global_tensor_from_cpu_shards`` (one host copy less, but it holds the GIL,
stalling the step's Python on the consumer thread) to torch_xla's GIL-free
``_xla_tensors_from_aten``. The training loop, its batches and its rounds are the wheel's
``loader`` bench's (``Loop``, ``compare_loops``). Methods:

- ``torchshard``: ``GlobalBatchLoader(source, partition=P("data"), prefetch=2)``.
- ``torchshard, GIL-holding transfer``: the same loader with the foreground transfer (the
  torch_xla backend's GIL-free route turned off while it is iterated): what
  ``GlobalBatchLoader`` did before.

Figures: steps/s and the input wait of both (as ``loader``'s); the GIL stall a transfer thread
inflicts on the main thread (a thread transfers batches back to back while the main thread
sleeps 0.5 ms at a time; the mean overshoot of those sleeps is the time it waited for the GIL);
and one transfer's cost alone, single-threaded, each way.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

from torchshard._backend.registry import lookup
from torchshard._backend.xla import backend as xla
from torchshard._core.context import current_mesh, require_mesh, thread_mesh
from torchshard._mesh.context import current_topology
from torchshard._place.call import read
from torchshard._place.place import to_global
from torchshard._tools.bench import loader
from torchshard._tools.bench._report import Report, compare

NAME = "loader_gil"
DESCRIPTION = "the loader's GIL-free transfer vs the GIL-holding one (steps/s, GIL stall)"
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


def gil_stall(transfer: Callable[[], Any], seconds: float) -> float:
    """Mean seconds the main thread waits for the GIL after a 0.5 ms sleep while another
    thread runs ``transfer`` back to back (0 if ``transfer`` releases the GIL)."""
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

    report.progress(f"{NAME}: GIL stall of a transfer thread")
    for name, background in (("torchshard", True), (HOLDING, False)):
        stall = gil_stall(in_thread(make(background)), STALL_SECONDS)
        report.figure(NAME, case, f"{name}: main thread's GIL wait", 1e3 * stall, "ms/0.5 ms")
    report.progress(f"{NAME}: one transfer, single-threaded")
    alone = compare({"torchshard": to_completion(make(True)), HOLDING: to_completion(make(False))})
    for name, secs in alone.items():
        report.figure(NAME, case, f"{name}: one transfer alone", 1e3 * secs, "ms")
    xm.wait_device_ops()


def run(report: Report) -> None:
    """Measures the GIL stall and one transfer each way, then both loaders on the loop."""
    import torchshard as ts

    loop = loader.make_loop()
    spec, case = loop.spec, loop.case
    with loop.mesh:
        transfer_figures(
            report, case, loop.mesh, lambda bg: partial(transfer, loop.pool[0], spec, bg)
        )
    methods: dict[str, Callable[[], Any]] = {
        "torchshard": lambda: ts.GlobalBatchLoader(loop.source(), partition=spec, prefetch=2),
        HOLDING: lambda: HoldingLoader(loop.source(), partition=spec, prefetch=2),
    }
    rate = loader.compare_loops(report, loop, methods, bench=NAME)
    report.ratio(NAME, case, "torchshard", HOLDING, rate["torchshard"] / rate[HOLDING])
