"""The end of an epoch and the host memory of the batches in flight.

Case 1, the end of data (mesh ``(8,)``, axis ``data``): an epoch of a dataset whose length does
not divide the batch (``BATCHES`` full batches of ``[ROWS, COLS]`` f32 and one of ``SHORT``
rows), fed through ``GlobalBatchLoader`` into a step (a matmul with a replicated weight, the
rows weighted by the mask, ``torch_xla.sync()``, the scalar read back). Methods:

- ``pad``: ``last_batch="pad"``; the short batch is padded to the full shape and masked.
- ``drop``: ``last_batch="drop"``; the short batch is not yielded (its examples are lost).
- ``as is``: the host batches through ``host_to_global_array`` one by one (no policy: the
  short batch keeps its shape); the loader itself refuses a short batch with ``"error"``.

Figures per method: steps/s over the epoch (interleaved rounds, medians), and the XLA graphs
compiled from the end of the first step to the end of the epoch (torch_xla's ``CompileTime``
count, on a fresh weight shape per method so the cache of another method does not hide one):
``pad`` keeps one graph to the end, ``as is`` compiles the short batch's.

Case 2, memory: an epoch of ``BIG`` host batches (made fresh per read, as a decoding source
does) with ``prefetch=8`` and a step slower than a batch read (``STEP_MS``), so the read-ahead
fills: the peak resident set size above the epoch's start (sampled every 2 ms from
``/proc/self/statm``), each in a fresh process, without a byte bound and with
``prefetch_bytes`` = two batches. On the
CPU emulation a global batch also lives in host memory (the devices' buffers).

With ``--devices N`` the mesh is ``(N,)`` and every row count a multiple of N (``sizes``), the
short batch still shorter than the full ones; the memory runs emulate the same N devices.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report

NAME = "ends"
DESCRIPTION = "last_batch pad vs drop (steps/s, recompilations) and prefetch_bytes (peak RSS)"
ROWS, COLS, BATCHES, SHORT = 512, 512, 40, 136
BIG_ROWS, BIG_COLS, BIG_BATCHES = 2048, 4096, 16  # 32 MiB per batch
STEP_MS = 300.0
ROUNDS = 7


def rows_source(batches: int, rows: int, cols: int, short: int) -> list[dict[str, torch.Tensor]]:
    """``batches`` full host batches and one of ``short`` rows: ``{"x": [rows, cols] f32}``,
    row ``i`` of the epoch filled with ``i / 1000``."""
    out, start = [], 0
    for n in [rows] * batches + [short]:
        x = (torch.arange(start, start + n, dtype=torch.float32) / 1000).repeat(cols, 1).T
        out.append({"x": x.contiguous()})
        start += n
    return out


def compiles() -> int:
    """torch_xla's ``CompileTime`` count so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def feeds(source: list[Any], spec: Any) -> dict[str, Callable[[], Any]]:
    """Each method's epoch: an iterable of ``(x, mask or None)``."""
    import torchshard as ts

    def pad() -> Iterator[Any]:
        loader = ts.GlobalBatchLoader(source, partition=spec, last_batch="pad")
        for b, mask in loader:
            yield b["x"], mask

    def drop() -> Iterator[Any]:
        loader = ts.GlobalBatchLoader(source, partition=spec, last_batch="drop")
        for b in loader:
            yield b["x"], None

    def as_is() -> Iterator[Any]:
        for b in source:
            yield ts.host_to_global_array(b["x"], partition=spec), None

    return {"pad": pad, "drop": drop, "as is": as_is}


def epoch(feed: Callable[[], Any], weight: torch.Tensor) -> tuple[float, int, int, list[int]]:
    """Runs one epoch of ``feed``; returns (seconds from the end of the first step to the end
    of the epoch (the loader's start left out), steps, the real examples the steps saw (the
    masks read back after the loop), the ``CompileTime`` count after each step)."""
    import torch_xla

    steps, counts, real = 0, [], []
    t0 = 0.0
    for x, mask in feed():
        rows = (x @ weight).sum(1)
        if mask is not None:
            rows = rows * mask.to(rows.dtype)
        out = rows.sum()
        torch_xla.sync()
        out.item()
        steps += 1
        if steps == 1:
            t0 = time.perf_counter()
        counts.append(compiles())
        real.append(x.shape[0] if mask is None else mask)
    seconds = time.perf_counter() - t0
    examples = sum(r if isinstance(r, int) else int(r.cpu().sum()) for r in real)
    return seconds, steps, examples, counts


class PeakRSS:
    """Samples this process's resident set size every 2 ms on a thread; ``peak`` in bytes."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def rss(self) -> int:
        """The resident set size now, in bytes."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def big_batches(n: int, rows: int, cols: int) -> Iterator[dict[str, torch.Tensor]]:
    """``n`` host batches made fresh per read (each its own memory, like a decoding source)."""
    for i in range(n):
        yield {"x": torch.full((rows, cols), float(i))}


def memory_epoch(budget: int | None, *, n: int, rows: int, cols: int, step_ms: float) -> int:
    """The peak RSS above the start (bytes) over one epoch of ``big_batches`` with
    ``prefetch=8`` and ``prefetch_bytes=budget``."""
    import torch_xla

    import torchshard as ts

    loader = ts.GlobalBatchLoader(
        big_batches(n, rows, cols), partition=ts.P("data"), prefetch=8, prefetch_bytes=budget
    )
    with PeakRSS() as rss:
        for b in loader:
            b["x"][0, 0].item()
            del b
            time.sleep(step_ms / 1e3)
        torch_xla.sync()
    return rss.peak - rss.start


MEMORY_MAIN = """
import json, sys
from torchshard._backend.xla.env import setup_cpu_emulation
devices = int(sys.argv[2])
setup_cpu_emulation(devices)
import numpy as np
import torchshard as ts
from benchmarks.ends import memory_epoch
args = json.loads(sys.argv[1])
budgets = args.pop("budgets")
with ts.Mesh(np.arange(devices), ("data",)):
    memory_epoch(None, n=2, rows=devices, cols=8, step_ms=0)  # the runtime and the thread start
    print(json.dumps([memory_epoch(budget, **args) for budget in budgets]))
"""


def sizes(quick: bool, devices: int) -> tuple[int, int, int, int]:
    """Case 1's ``(rows, cols, batches, short)``: ``ROWS``, ``COLS``, ``BATCHES``, ``SHORT``
    (``--quick``: 64, 32, 3, 24) with the row counts rounded up to a multiple of ``devices``,
    the full batches kept longer than the short one."""
    rows, cols, batches, short = (64, 32, 3, 24) if quick else (ROWS, COLS, BATCHES, SHORT)
    short = _devices.round_up(short, devices)
    return max(_devices.round_up(rows, devices), short + devices), cols, batches, short


def memory_in_a_fresh_process(
    budgets: Sequence[int | None], *, devices: int = 8, **sizes: Any
) -> list[int]:
    """``memory_epoch`` in a new Python process, once per budget, in order: the allocator's
    memory kept from an earlier run (glibc keeps freed heap pages, and raises its mmap threshold
    after the first large free) would hide the next run's batches, so a figure worth reading
    takes one process per budget (``run`` does; ``--quick``, whose figures nobody reads, runs
    its budgets in one)."""
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(f))) for f in (ts_file(), __file__)}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*sorted(roots), env.get("PYTHONPATH")) if p)
    args = json.dumps({"budgets": list(budgets), **sizes})
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_MAIN, args, str(devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"bench ends: the memory run failed:\n{out.stderr[-2000:]}")
    return [int(peak) for peak in json.loads(out.stdout.strip().splitlines()[-1])]


def ts_file() -> str:
    """The path of the torchshard package's ``__init__.py``."""
    import torchshard

    return str(torchshard.__file__)


def run(report: Report) -> None:
    """Measures steps/s and the compilations per policy, and the peak RSS with and without a
    byte bound."""
    import torch_xla

    import torchshard as ts

    quick = report.quick
    mesh = _devices.data_mesh()  # (8,); (N,) with --devices N
    rows, cols, batches, short = sizes(quick, mesh.size)
    rounds = 3 if quick else ROUNDS
    spec = ts.P("data")
    source = rows_source(batches, rows, cols, short)
    device = torch_xla.device()
    case = f"{batches} x [{rows},{cols}] f32 + [{short},{cols}] {_devices.label(mesh)}"
    with mesh:
        methods = feeds(source, spec)
        for k, (name, feed) in enumerate(methods.items()):
            report.progress(f"ends: compilations, {name}")
            weight = torch.ones(cols, 8 + k).to(device)  # a graph of its own per method
            _, steps, examples, counts = epoch(feed, weight)
            report.figure(NAME, case, f"{name}: steps", steps, "steps")
            report.figure(
                NAME,
                case,
                f"{name}: graphs compiled after step 1",
                counts[-1] - counts[0],
                "graphs",
            )
            report.figure(NAME, case, f"{name}: examples seen", examples, "examples")
        weight = torch.ones(cols, 8).to(device)
        samples: dict[str, list[float]] = {name: [] for name in methods}
        order = list(methods)
        rng = random.Random(0)
        for r in range(rounds):
            rng.shuffle(order)
            for name in order:
                report.progress(f"ends: round {r + 1}/{rounds} {name}")
                seconds, steps, _, _ = epoch(methods[name], weight)
                samples[name].append((steps - 1) / seconds)
        rate = {name: statistics.median(s) for name, s in samples.items()}
        for name, value in rate.items():
            report.figure(NAME, case, name, value, "steps/s")
        report.ratio(NAME, case, "pad", "drop", rate["pad"] / rate["drop"])
        report.ratio(NAME, case, "pad", "as is", rate["pad"] / rate["as is"])

        n, big_rows, big_cols = (4, 64, 64) if quick else (BIG_BATCHES, BIG_ROWS, BIG_COLS)
        big_rows = _devices.round_up(big_rows, mesh.size)
        nbytes = big_rows * big_cols * 4
        mem_case = f"{n} x [{big_rows},{big_cols}] f32 ({nbytes / 2**20:g} MiB), prefetch=8"
        budgets = {"prefetch_bytes=None": None, "prefetch_bytes=2 batches": 2 * nbytes}
        report.progress("ends: peak RSS")
        measured = dict.fromkeys(budgets, 0)
        for group in [list(budgets)] if quick else [[label] for label in budgets]:
            peaks = memory_in_a_fresh_process(
                [budgets[label] for label in group],
                devices=mesh.size,
                n=n,
                rows=big_rows,
                cols=big_cols,
                step_ms=1.0 if quick else STEP_MS,
            )
            measured.update(zip(group, peaks, strict=True))
        for label, peak in measured.items():
            report.figure(NAME, mem_case, f"{label}: peak RSS above start", peak / 2**20, "MiB")
