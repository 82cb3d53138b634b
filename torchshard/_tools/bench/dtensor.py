"""Host -> global on the DTensor backend, on real gloo processes; the agreement check's cost.

Starts ``PROCESSES`` fresh interpreters (torch.distributed over gloo on 127.0.0.1, no
torch_xla), each passing its block of a batch on a ``(PROCESSES,)`` mesh split over ``data``.
Methods, called in lockstep on every rank (a barrier before each sample):

- ``torchshard``: ``host_to_global_array`` with the cross-process agreement check (default).
- ``torchshard unchecked``: the same with ``set_agreement_check(False)``.
- ``torchshard + value check``: the same with the opt-in ``set_value_check(True)``.
- ``from_local``: ``DTensor.from_local`` of a copy of each block, by hand (the ceiling).

Cases: a small batch (8 leaves of per-process [32, 16] float32, where fixed per-call costs
dominate) and the ``h2g`` batches (1 and 8 leaves of global [1024, 2048] float32); ``--quick``
runs the small batch only, with fewer samples. Figures are microseconds per call (median over
samples, taken on rank 0). ``agreement check`` is the check's own cost per call: the median
over samples of (checked - unchecked), each sample timing both back to back; ``value check``
likewise (value-checked - checked).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from torchshard._tools.bench._report import Report

NAME = "dtensor"
DESCRIPTION = "DTensor backend on gloo processes: host_to_global_array vs from_local; check cost"
PROCESSES = 2
CASES = {"8x[32,16] f32": (8, 32, 16), "1x[1024,2048] f32": (1, 1024, 2048)}
CASES["8x[1024,2048] f32"] = (8, 1024, 2048)
SAMPLES, MIN_SECONDS, TIMEOUT = 15, 0.03, 900


def run(report: Report) -> None:
    """Starts the worker processes and records their figures and ratios."""
    report.progress(f"dtensor: {PROCESSES} gloo processes")
    env = {"TORCHSHARD_BENCH_QUICK": "1"} if report.quick else {}
    secs = run_gloo_workers("torchshard._tools.bench.dtensor", PROCESSES, env=env)
    for case, by_method in secs.items():
        for method, s in by_method.items():
            report.figure(NAME, case, method, s * 1e6, "us/call")
        base = by_method["from_local"]
        for method in ("torchshard unchecked", "torchshard"):  # not the check's own cost
            report.ratio(NAME, case, method, "from_local", base / by_method[method])
    report.notes.append(
        f"dtensor: agreement check = median of (torchshard - torchshard unchecked) per sample, "
        f"{PROCESSES} processes over gloo on loopback, the exchange over torchshard's tree"
    )


def run_gloo_workers(module: str, processes: int, env: dict[str, str] | None = None) -> Any:
    """Runs ``python -m module`` on ``processes`` fresh interpreters joined over gloo on
    127.0.0.1 (no torch_xla), with ``env`` added to their environment; returns what rank 0
    wrote to ``TORCHSHARD_BENCH_OUT`` (JSON). The workers import ``module`` from where this
    process does (its top-level package's folder is put first on their ``PYTHONPATH``: the
    lab's ``benchmarks`` lives in a checkout, not in site-packages)."""
    extra = env or {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(processes))
        root = _import_root(module)
        if root is not None:
            path = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join([root, path] if path else [root])
        env.update(OMP_NUM_THREADS="1", TORCHSHARD_BENCH_OUT=out, **extra)
        # The workers' output (gloo's connection lines) goes to a log, shown only on failure,
        # so that it does not break up the table on stdout or the progress bar on stderr.
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+b") for r in range(processes)]
        try:
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", module],
                    env=dict(env, RANK=str(r)),
                    stdout=logs[r],
                    stderr=subprocess.STDOUT,
                )
                for r in range(processes)
            ]
            try:
                codes = [p.wait(timeout=TIMEOUT) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            if any(codes):
                tails = []
                for r, log in enumerate(logs):
                    log.seek(0)
                    text = log.read().decode(errors="replace")[-4000:]
                    tails.append(f"--- rank {r} ---\n{text}")
                raise RuntimeError(f"{module} workers exited with {codes}\n" + "\n".join(tails))
        finally:
            for log in logs:
                log.close()
        with open(out) as f:
            return json.load(f)


def _import_root(module: str) -> str | None:
    """The folder that holds ``module``'s top-level package as this process imports it, or
    None when it is not importable (the workers then fail, saying so)."""
    try:
        spec = importlib.util.find_spec(module.partition(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or spec.submodule_search_locations is None:
        return None  # not a package (or a namespace one): nothing to add
    return os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))


def finish_gloo_worker(figures: Any) -> None:
    """The end of a ``run_gloo_workers`` worker: rank 0 writes ``figures`` (JSON) where the
    parent reads them; every rank leaves the process group."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(os.environ["TORCHSHARD_BENCH_OUT"], "w") as f:
            json.dump(figures, f)
    dist.destroy_process_group()


def measure(
    methods: dict[str, Callable[[], Any]], differences: dict[str, tuple[str, str]] | None = None
) -> dict[str, float]:
    """Median seconds per call of each method, called in lockstep by every rank (a barrier
    before each sample; the calls per sample are rank 0's, shared). ``differences``: name ->
    (a, b), the median over samples of a's time minus b's (both timed in each sample)."""
    import torch.distributed as dist

    samples_n = 5 if os.environ.get("TORCHSHARD_BENCH_QUICK") else SAMPLES
    for fn in methods.values():
        for _ in range(3):
            fn()
    # Calls per sample: from rank 0's timing, shared, so that every rank calls alike.
    reps = []
    for fn in methods.values():
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        reps.append(max(1, int(MIN_SECONDS / max(time.perf_counter() - t0, 1e-6))))
    dist.broadcast_object_list(reps, src=0)
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(samples_n):
        for (name, fn), n in zip(methods.items(), reps, strict=True):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    out = {name: statistics.median(s) for name, s in samples.items()}
    for name, (a, b) in (differences or {}).items():
        out[name] = statistics.median(x - y for x, y in zip(samples[a], samples[b], strict=True))
    return out


def _worker() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    import torchshard as ts

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = ts.create_device_mesh((world,), ("data",), backend="dtensor")
    figures = {}
    quick = bool(os.environ.get("TORCHSHARD_BENCH_QUICK"))
    cases = dict(list(CASES.items())[:1]) if quick else CASES
    with mesh:
        for case, (leaves, rows, cols) in cases.items():
            local = rows // world if rows >= 1024 else rows
            batch = {f"x{i}": torch.randn(local, cols) for i in range(leaves)}
            spec = ts.P("data")
            shape = (local * world, cols)

            def checked(batch: Any = batch, spec: Any = spec) -> Any:
                return ts.host_to_global_array(batch, partition=spec)

            def unchecked(batch: Any = batch, spec: Any = spec) -> Any:
                old = ts.set_agreement_check(False)
                try:
                    return ts.host_to_global_array(batch, partition=spec)
                finally:
                    ts.set_agreement_check(old)

            def direct(batch: Any = batch, shape: Any = shape) -> Any:
                stride = (shape[1], 1)
                return {
                    k: DTensor.from_local(
                        t.clone(), mesh.native, [Shard(0)], shape=shape, stride=stride
                    )
                    for k, t in batch.items()
                }

            def values(batch: Any = batch, spec: Any = spec) -> Any:
                old = ts.set_value_check(True)
                try:
                    return ts.host_to_global_array(batch, partition=spec)
                finally:
                    ts.set_value_check(old)

            methods: dict[str, Callable[[], Any]] = {
                "torchshard": checked,
                "torchshard unchecked": unchecked,
            }
            methods["torchshard + value check"] = values
            methods["from_local"] = direct
            diff = {
                "agreement check": ("torchshard", "torchshard unchecked"),
                "value check": ("torchshard + value check", "torchshard"),
            }
            figures[case] = measure(methods, diff)
    finish_gloo_worker(figures)


if __name__ == "__main__":
    _worker()
