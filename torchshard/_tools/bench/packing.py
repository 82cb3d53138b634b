"""Packing documents on the host: documents/s per method, the padding each leaves, and the input
wait of a ``GlobalBatchLoader`` fed by a ``Packer``.

Documents: lengths log-normal around 1.5k tokens (median 1,500, sigma 0.8, cut at the row),
int32 tokens, made once outside the timing. Rows of ``SEQ_LEN`` = 8,192 tokens, ``ROWS`` = 8 per
batch (64k tokens, ~40 documents). Methods, timed in interleaved rounds (``_report.measure``):
``torchshard.data.Packer`` with ``best_fit``, ``first_fit``, ``concat_split``; a figure is
documents/s on one core (one host's packing thread), the best round.

The loader: ``GlobalBatchLoader(Packer(...), partition=P("data"))`` on the run's devices,
feeding a step that sleeps ``STEP_MS`` (a step over 64k tokens takes longer on any
accelerator); the figure is the input wait, time in ``next()`` over the step time, the warm-up
batch aside (``LoaderStats.input_wait_fraction``). Target: packing never shows (< 1 %).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report, measure

NAME = "packing"
DESCRIPTION = "Packer: documents/s per method (best fit, first fit, concat-then-split), loader wait"
SEQ_LEN, ROWS = 8192, 8
DOCUMENTS = 4000
STEP_MS = 30.0
STEPS = 40
WAIT_TARGET = 0.01
METHODS = ("best_fit", "first_fit", "concat_split")


def lognormal_documents(n: int, seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` documents, lengths log-normal around 1.5k tokens (cut at ``seq_len``)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1500), 0.8, n).astype(int), 1, seq_len)
    return [rng.integers(1, 50_000, int(k), dtype=np.int32) for k in lengths]


def padding(batches: list[dict[str, Any]]) -> float:
    """The fraction of positions that are padding, over every batch but the last."""
    full = batches[:-1] or batches
    total = sum(b["segment_ids"].size for b in full)
    return 1 - sum(int(np.count_nonzero(b["segment_ids"])) for b in full) / total


def run(report: Report) -> None:
    """Documents/s and padding per method; then the loader's input wait."""
    import torchshard as ts

    seq_len = 1024 if report.quick else SEQ_LEN
    docs = lognormal_documents(200 if report.quick else DOCUMENTS, seq_len)
    case = f"{len(docs)} documents, log-normal ~1.5k tokens, rows {ROWS} x {seq_len}"

    def packing(method: str) -> Callable[[], list[dict[str, Any]]]:
        return lambda: list(ts.data.Packer(docs, seq_len=seq_len, rows=ROWS, method=method))

    methods = {m: packing(m) for m in METHODS}
    report.progress(f"{NAME}: packing, {len(METHODS)} methods")
    timings = measure(methods, rounds=7, warmup=1)
    for m, t in timings.items():
        report.figure(
            NAME, case, m, len(docs) / t.best, "documents/s", spread=t.spread,
            median=len(docs) / t.median,
        )  # fmt: skip
        report.figure(NAME, case, f"{m} padding", 100 * padding(methods[m]()), "% of positions")
    _loader_wait(report, docs, seq_len)


def _loader_wait(report: Report, docs: list[np.ndarray], seq_len: int) -> None:
    import torchshard as ts

    mesh = _devices.data_mesh()
    rows = _devices.round_up(ROWS, mesh.size)
    steps = 5 if report.quick else STEPS
    case = f"GlobalBatchLoader(Packer(best_fit, rows {rows} x {seq_len})), step {STEP_MS:g} ms"
    report.progress(f"{NAME}: the loader over a Packer, {steps} steps")
    with mesh:
        packer = ts.data.Packer(docs * 4, seq_len=seq_len, rows=rows)
        with ts.data.GlobalBatchLoader(packer, partition=ts.P("data"), prefetch=2) as loader:
            it = iter(loader)
            for _ in range(steps):
                next(it)
                time.sleep(STEP_MS / 1e3)
            wait = loader.stats.input_wait_fraction
    report.figure(NAME, case, "input wait", 100 * wait, "% of step")
    if report.verdicts:
        verdict = "ok" if wait < WAIT_TARGET else "MISSED"
        report.notes.append(
            f"{NAME}: input wait over a Packer {wait:.2%} of step time (target < "
            f"{WAIT_TARGET:.0%}): {verdict}"
        )
