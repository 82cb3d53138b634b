"""A direct ``host_to_global_array``'s agreement check on the step's path: judged in the call
or deferred (``set_agreement_deferred``), on real gloo processes.

Starts ``PROCESSES`` fresh interpreters on a ``(PROCESSES,)`` mesh over ``data``. Each
iteration of a training loop places the next batch (8 leaves of per-process ``[32, 16]``
float32), then steps on the current one: an op on each of its leaves (their first use, where a
deferred check is judged) and ``STEP_WORK`` 64x64 matrix products. Methods:

- ``check deferred``: the default where torch can wait at a first use (>= 2.13).
- ``check in the call``: ``set_agreement_deferred(False)`` (torch 2.9's only way).
- ``unchecked``: ``set_agreement_check(False)``.

The methods take turns, ``RUN`` iterations each (the first not timed: it pays what the method
before left, a deferred check judged at this call), in a rotating order (so that a loaded
machine's stalls fall on all alike); figures are medians over the timed iterations, in
microseconds, and ``on the path, ...``: the median of an iteration's time minus the unchecked
iteration's of the same round and position. ``call, ...``: the same for the call's own time
(a deferred check is judged after the call returns).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from torchshard._tools.bench._report import Report
from torchshard._tools.bench.dtensor import finish_gloo_worker, run_gloo_workers

NAME = "deferred"
DESCRIPTION = "a direct call's agreement check on the step's path: in the call vs deferred"
PROCESSES = 2
ROUNDS, QUICK_ROUNDS = 200, 5
STEP_WORK = 16
RUN = 4  # iterations of a method in a row; the first is not timed
METHODS = ("check deferred", "check in the call", "unchecked")


def run(report: Report) -> None:
    """Starts the worker processes and records their figures."""
    report.progress(f"{NAME}: {PROCESSES} gloo processes")
    env = {"TORCHSHARD_BENCH_QUICK": "1"} if report.quick else {}
    figures = run_gloo_workers(f"benchmarks.{NAME}", PROCESSES, env=env)
    for method, s in figures.items():
        report.figure(NAME, "8x[32,16] f32", method, s * 1e6, "us")
    report.notes.append(
        f"{NAME}: {PROCESSES} processes over gloo on loopback; medians over rounds of one "
        "iteration per method (place the next batch, step on the current one)"
    )


def _worker() -> None:
    import torch
    import torch.distributed as dist

    import torchshard as ts

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = ts.create_device_mesh((world,), ("data",), backend="dtensor")
    rounds = QUICK_ROUNDS if os.environ.get("TORCHSHARD_BENCH_QUICK") else ROUNDS
    batch = {f"x{i}": torch.randn(32, 16) for i in range(8)}
    a = torch.randn(64, 64)
    held: dict[str, Any] = {}
    settings = {
        "check deferred": (True, True),
        "check in the call": (True, False),
        "unchecked": (False, True),
    }
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    calls: dict[str, list[float]] = {m: [] for m in METHODS}

    def iteration(method: str, record: bool) -> None:
        check, deferred = settings[method]
        old_check = ts.set_agreement_check(check)
        old_deferred = ts.set_agreement_deferred(deferred)
        try:
            t0 = time.perf_counter()
            nxt = ts.host_to_global_array(batch, partition=ts.P("data"))
            t1 = time.perf_counter()
            cur = held.get(method, nxt)
            for x in cur.values():
                x + 0  # the current batch's first use
            b = a
            for _ in range(STEP_WORK):
                b = a @ b
            t2 = time.perf_counter()
        finally:
            ts.set_agreement_deferred(old_deferred)
            ts.set_agreement_check(old_check)
        held[method] = nxt
        if record:
            calls[method].append(t1 - t0)
            times[method].append(t2 - t0)

    with mesh:
        for r in range(rounds + 3):  # 3 rounds of warm-up
            order = METHODS[r % 3 :] + METHODS[: r % 3]
            for method in order:
                for k in range(RUN):  # the first of a run pays what the last method left
                    iteration(method, record=k > 0)
            if r == 2:
                for m in METHODS:
                    times[m].clear()
                    calls[m].clear()
        held.clear()
    figures: dict[str, float] = {m: statistics.median(times[m]) for m in METHODS}
    for m in METHODS[:2]:
        figures[f"on the path, {m}"] = statistics.median(
            x - y for x, y in zip(times[m], times["unchecked"], strict=True)
        )
        figures[f"call, {m}"] = statistics.median(
            x - y for x, y in zip(calls[m], calls["unchecked"], strict=True)
        )
    finish_gloo_worker(figures)


if __name__ == "__main__":
    _worker()
