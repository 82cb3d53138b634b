"""Soak: 2,000 batches through ``GlobalBatchLoader``; host memory and threads must not leak.

8 epochs of 250 batches (a new loader and ``iter()`` per epoch; one epoch abandoned half-way
and left to the garbage collector), each batch ``{"x": [256, 512] f32, "y": [256] i64}``
(0.5 MB) on the ``(4, 2)`` mesh (with ``--devices N``: ``(N / 2, 2)``, or ``(N, 1)`` for odd N,
the rows a multiple of N), consumed by a small step (a reduction, ``sync``). Measures the
process's RSS (psutil) after a warm-up epoch and at the end, the loader threads left at the end,
and the threads left once a finished epoch's parked thread has had time to expire
(``_threads.PARK_SECONDS``; each epoch that ends by itself hands its thread to the next).
Targets: RSS growth < 50 MB; no thread left.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import torch

from torchshard._core.optional import require
from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report

NAME = "soak"
DESCRIPTION = "2,000 batches through GlobalBatchLoader: RSS growth and threads left"
BATCHES, EPOCH = 2000, 250
GROWTH_LIMIT_MB = 50.0


def _rss_mb() -> float:
    psutil = require("psutil", "bench soak", extra="test")  # in the test extra
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def _loader_threads() -> list[threading.Thread]:
    gc.collect()
    return [t for t in threading.enumerate() if t.name.startswith("torchshard-loader")]


def run(report: Report) -> None:
    """Runs 2,000 batches; records RSS growth after warm-up and the threads left."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torchshard as ts

    mesh = _devices.grid_mesh()  # (4, 2); (N / 2, 2) or (N, 1) with --devices N
    rows = _devices.round_up(256, mesh.size)  # dim 0 splits evenly
    g = torch.Generator().manual_seed(0)
    pool = [{"x": torch.randn(rows, 512, generator=g), "y": torch.arange(rows)} for _ in range(4)]

    def source(n: int) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(n):
            yield pool[i % len(pool)]

    threads_before = threading.active_count()
    done = 0
    warm_rss = 0.0
    total = torch.zeros((), device=torch_xla.device())
    with mesh:
        epoch = 0
        while done < BATCHES:
            abandon = epoch == 3  # one epoch is dropped half-way, for the GC to clean up
            loader = ts.GlobalBatchLoader(source(min(EPOCH, BATCHES - done)), prefetch=2)
            it = iter(loader)
            for i, batch in enumerate(it):
                total = total + batch["x"].sum() + batch["y"].sum()
                torch_xla.sync()
                done += 1
                if abandon and i == EPOCH // 2:
                    break
            del it, loader, batch
            xm.wait_device_ops()
            epoch += 1
            if epoch == 1:
                warm_rss = _rss_mb()
                report.progress(f"soak: warm-up done ({done} batches), RSS {warm_rss:.0f} MB")
            else:
                report.progress(f"soak: {done} batches, RSS {_rss_mb():.0f} MB")
        total.item()
    end_rss = _rss_mb()
    left = _loader_threads()
    from torchshard.data._loader import threads as _threads

    time.sleep(_threads.PARK_SECONDS + 0.5)  # the last epoch's parked thread expires
    parked = [t for t in threading.enumerate() if t.name == _threads.PARKED_NAME]
    growth = end_rss - warm_rss
    case = f"{done} batches, {epoch} epochs, [{rows},512] f32 {_devices.label(mesh)}"
    report.figure(NAME, case, "RSS after warm-up", warm_rss, "MB")
    report.figure(NAME, case, "RSS growth after warm-up", growth, "MB")
    report.figure(NAME, case, "loader threads left", len(left), "threads")
    added = threading.active_count() - threads_before
    report.figure(NAME, case, "parked threads left after expiry", len(parked), "threads")
    report.figure(NAME, case, "threads added (all, after expiry)", added, "threads")
    report.notes.append(
        f"soak: RSS grew {growth:.1f} MB after warm-up (limit {GROWTH_LIMIT_MB:g} MB): "
        f"{'ok' if growth < GROWTH_LIMIT_MB else 'MISSED'}; loader threads left: {len(left)}, "
        f"after the parking time: {added}: {'ok' if not left and not added else 'MISSED'}"
    )
