"""``python -m torchshard demo``: data-parallel training fed by a DataLoader with workers.

A small MLP classifier learns a synthetic task on the mesh ``(N / 2, 2)`` of the run's N
devices (``(4, 2)`` for the default 8, ``(N, 1)`` for odd N; axes ``data``/``model``;
CPU-emulated, N = ``--devices``, when no TPU is present). The parameters are replicated; each
global batch is split over all N devices (``FULL``: ``P(("data", "model"))``). The input path
is the one torchshard is for: a ``DataLoader`` with worker processes reads this host's shard
(``host_sampler``), and ``GlobalBatchLoader`` turns its host batches into global sharded
batches on a background thread. ``--hosts H`` runs the same path with H virtual hosts (H
dividing N), each with its own DataLoader and shard.

``--backend dtensor`` (the default when torch_xla is not installed) runs the same training
data-parallel over gloo processes on DTensor instead (``demo_dtensor.py``); ``--backend
torchax`` on torchax, PyTorch on JAX, in one JAX process (``demo_torchax.py``).

This module is an application, not library code: it imports torch_xla (the optimizer step and
``torch_xla.sync()``), which torchshard's library modules leave to ``_backend/xla.py``. The
dataset and the worker code are pure numpy/torch: the workers are started with the
``forkserver`` method, so they never carry torch_xla's runtime (a check in each worker proves
it), and forking a process whose XLA runtime threads are live is avoided.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from torchshard._tools._demo_common import (
    CLASSES,
    EXAMPLE_BYTES,
    FEATURES,
    MAX_DATA_BYTES,
    MIN_JUDGED_STEPS,
    STEPS_PER_EPOCH,
    Result,
    SyntheticClassification,
    _input_wait,
    _mean,
    check_worker,
    data_copies,
    data_size,
    host_loader,
    mesh_shape,
    mlp,
)

__all__ = [
    "CLASSES",
    "FEATURES",
    "Result",
    "SyntheticClassification",
    "check_worker",
    "main",
    "mlp",
    "resolve_backend",
    "train",
]


def train(
    *,
    steps: int = 300,
    hosts: int = 1,
    batch_size: int = 256,
    workers: int = 2,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Result:
    """Trains the MLP for ``steps`` steps; returns the losses and the throughput."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torchshard as ts
    from torchshard.testing import global_batch_loader_per_host, virtual_hosts

    torch.manual_seed(seed)
    mesh = ts.create_device_mesh(mesh_shape(device_count()), ("data", "model"))
    dataset = SyntheticClassification(STEPS_PER_EPOCH * batch_size, seed=seed)
    per_host = batch_size // hosts

    def feed(h: int) -> dict[str, int]:
        """Host ``h``'s shard, from the mesh: the rows its devices hold (dim 0 over every axis,
        the loader's default)."""
        with virtual_hosts(hosts, process_index=h):
            return ts.feed_read_config(ts.P(mesh.axis_names), mesh=mesh)

    samplers = [ts.host_sampler(dataset, feed(h), seed=seed) for h in range(hosts)]
    host_workers = max(1, workers // hosts) if workers > 0 else 0
    loaders = [host_loader(dataset, per_host, sampler, host_workers) for sampler in samplers]
    log(
        f"mesh {dict(mesh.shape)}, {hosts} host(s) x {host_workers} DataLoader worker(s)"
        f"{' (forkserver)' if host_workers else ''}, global batch {batch_size} "
        f"({per_host} per host), {steps} steps"
    )
    every = max(1, steps // 10)
    warmup = min(3, steps - 1)
    losses: list[float] = []
    pending: list[tuple[int, Any]] = []
    with contextlib.ExitStack() as stack:
        if hosts > 1:
            stack.enter_context(virtual_hosts(hosts))
        stack.enter_context(mesh)
        if hosts > 1:
            loader = global_batch_loader_per_host(loaders)
        else:
            loader = ts.GlobalBatchLoader(loaders[0])
        stack.enter_context(loader)
        device = torch_xla.device()
        model = mlp().to(device)  # replicated: every device holds the parameters
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        t_start = time.perf_counter()
        t_warm, step, epoch = t_start, 0, 0
        while step < steps:
            for sampler in samplers:
                sampler.set_epoch(epoch)
            for batch in loader:
                logits = model(batch["x"])
                loss = torch.nn.functional.cross_entropy(logits, batch["y"])
                optimizer.zero_grad()
                loss.backward()
                xm.optimizer_step(optimizer)
                torch_xla.sync()
                pending.append((step, loss))
                step += 1
                if step == warmup:
                    xm.wait_device_ops()
                    t_warm = time.perf_counter()
                if step % every == 0 or step == steps:
                    losses += [t.item() for _, t in pending]
                    pending.clear()
                    elapsed = time.perf_counter() - t_warm
                    done = step - warmup
                    frac = _input_wait(loader.stats)
                    rate = f"{done / elapsed:6.1f} steps/s" if done > 0 else " warming up"
                    log(f"step {step:>5}/{steps}  loss {losses[-1]:.4f}  {rate}  {frac}")
                if step == steps:
                    break
            epoch += 1
        xm.wait_device_ops()
        elapsed = time.perf_counter() - t_warm
        stats = loader.stats
    timed = max(steps - warmup, 1)
    window = max(1, min(10, steps // 5))
    return Result(
        first_loss=_mean(losses[:window]),
        last_loss=_mean(losses[-window:]),
        steps_per_second=timed / elapsed,
        examples_per_second=timed * batch_size / elapsed,
        input_wait_fraction=stats.input_wait_fraction,
        warmup_seconds=t_warm - t_start,
        warmup_wait_seconds=stats.warmup_wait_seconds,
    )


def device_count() -> int:
    """The run's torch_xla devices: ``--devices`` emulated on a CPU, a TPU's chips."""
    import torch_xla.runtime as xr

    return int(xr.global_runtime_device_count())


def default_batch(devices: int) -> int:
    """``--batch``'s default: 256, rounded up to a multiple of the device (or process) count so
    that every device gets as many rows (256 on 1, 2, 4 or 8 devices, 258 on 3)."""
    return max(1, -(-256 // devices)) * devices


def check_sizes(
    devices: int, hosts: int, batch: int, *, backend: str, workers: int = 0
) -> str | None:
    """Why ``hosts`` and ``batch`` cannot run on ``devices`` devices (or gloo processes) with
    ``workers`` DataLoader workers, in one line naming the options; ``None`` when they can."""
    copies, who = data_copies(devices, hosts, workers, backend=backend)
    per_copy = STEPS_PER_EPOCH * batch * EXAMPLE_BYTES
    if copies * per_copy > MAX_DATA_BYTES:
        most = MAX_DATA_BYTES // (copies * STEPS_PER_EPOCH * EXAMPLE_BYTES) // devices * devices
        fix = f"pass --batch {most:,} or less" if most else "pass fewer --workers"
        if most and workers:
            fix += " (or fewer --workers)"
        return (
            f"--batch {batch}: the demo's dataset is {STEPS_PER_EPOCH} batches of "
            f"{EXAMPLE_BYTES}-byte examples, {data_size(per_copy)}, held by {who}: "
            f"{data_size(copies * per_copy)} in all, above the demo's bound of "
            f"{data_size(MAX_DATA_BYTES)}; {fix}"
        )
    if backend == "torchax":
        if hosts != 1:
            return (
                f"--hosts {hosts}: the torchax demo is one JAX process, one host (several hosts "
                "are several JAX processes joined by jax.distributed, each with its own "
                "loader), so --hosts must be 1 (leave it out)"
            )
    elif backend == "dtensor":
        if hosts != 1:
            return (
                f"--hosts {hosts}: on dtensor every one of the --devices ({devices}) gloo "
                "processes is a host of its own, so --hosts must be 1 (leave it out)"
            )
    elif hosts > devices or devices % hosts:
        fewer = max(h for h in range(1, min(hosts, devices) + 1) if devices % h == 0)
        return (
            f"--hosts {hosts} needs a device count that it divides (each virtual host owns "
            f"as many devices), but there are {devices} devices; pass --devices "
            f"{hosts * max(1, devices // hosts)} or --hosts {fewer}"
        )
    if batch % devices:
        return (
            f"--batch {batch} must be a multiple of the {devices} devices (each gets as many "
            f"rows); pass --batch {max(1, -(-batch // devices)) * devices}, or leave it out"
        )
    return None


def resolve_backend(name: str) -> str:
    """``--backend``: ``auto`` is ``xla`` when torch_xla is installed, else ``dtensor``."""
    if name != "auto":
        return name
    from torchshard._backend.xla.env import xla_installed

    return "xla" if xla_installed() else "dtensor"


def main(args: Any) -> int:
    """The ``demo`` subcommand; exits non-zero when the loss does not fall. Runs of fewer than
    ``MIN_JUDGED_STEPS`` steps are not judged (their losses are no evidence either way)."""
    if args.steps < 2:
        print("demo: --steps must be at least 2", file=sys.stderr)
        return 2
    backend = resolve_backend(getattr(args, "backend", "auto"))
    # the gloo processes are --devices; torch_xla's and JAX's devices are the runtime's (a
    # TPU's chips, or --devices CPU devices)
    if backend == "dtensor":
        devices = args.devices
    elif backend == "torchax":
        from torchshard._tools import demo_torchax

        devices = demo_torchax.device_count()
    else:
        devices = device_count()
    batch = default_batch(devices) if args.batch is None else args.batch
    why = check_sizes(devices, args.hosts, batch, backend=backend, workers=args.workers)
    if why:
        print(f"demo: {why}", file=sys.stderr)
        return 2
    if backend == "dtensor":
        from torchshard._tools import demo_dtensor

        r = demo_dtensor.train(
            processes=devices,
            steps=args.steps,
            batch_size=batch,
            workers=args.workers,
            lr=args.lr,
            seed=args.seed,
        )
        warmup = "warm-up"
    elif backend == "torchax":
        r = demo_torchax.train(
            steps=args.steps,
            batch_size=batch,
            workers=args.workers,
            lr=args.lr,
            seed=args.seed,
            log=lambda msg: print(msg, flush=True),
        )
        warmup = "compilation"
    else:
        r = train(
            steps=args.steps,
            hosts=args.hosts,
            batch_size=batch,
            workers=args.workers,
            lr=args.lr,
            seed=args.seed,
            log=lambda msg: print(msg, flush=True),
        )
        warmup = "compilation"
    wait = r.input_wait_fraction
    print(
        f"loss {r.first_loss:.4f} -> {r.last_loss:.4f} (mean of the first and last steps); "
        f"{r.steps_per_second:.1f} steps/s, {r.examples_per_second:,.0f} examples/s after "
        f"{r.warmup_seconds:.1f} s of {warmup}; "
        + (
            f"input wait {wait:.1%} of step time after each epoch's first batch"
            if math.isfinite(wait)
            else "input wait not measured, as no step ended after an epoch's first batch"
        )
        + f" (loader.stats; {r.warmup_wait_seconds:.1f} s waited for those: the DataLoader "
        "workers' start)"
    )
    if args.steps < MIN_JUDGED_STEPS:
        print(
            f"not judged: {args.steps} steps are too few to tell whether the loss falls (over "
            "so few, it moves by chance as much as by learning); pass --steps "
            f"{MIN_JUDGED_STEPS} or more for a verdict (the default is 300)"
        )
        return 0
    if not math.isfinite(r.last_loss):
        print(
            f"FAILED: the loss is {r.last_loss} (the training diverged; --lr {args.lr:g} may "
            "be too large)",
            file=sys.stderr,
        )
        return 1
    if not r.loss_fell:
        print("FAILED: the loss did not fall", file=sys.stderr)
        return 1
    print("ok: the loss fell")
    return 0
