"""``python -m torchshard demo --backend dtensor``: the demo on torch.distributed DTensor.

The same model, data and training loop as the torch_xla demo (``demo.py``), data-parallel over
N gloo processes on the CPU (one process per device, N = ``--devices``) instead of N emulated
XLA devices: the mesh is ``(N / 2, 2)`` (axes ``data``/``model``; ``(N, 1)`` for odd N), each
process is a host with its own ``DataLoader`` (worker processes started with ``forkserver``)
over its shard (``host_sampler``), and ``GlobalBatchLoader`` turns each host batch into
global ``DTensor`` batches, split over every process, on a background thread. The step runs
the model on each process's rows (``to_local()``) under ``DistributedDataParallel``, which
averages the gradients over the processes: the same update as the single XLA program. Rank 0
prints the same lines as the XLA demo (the loss is the mean over every process's rows).

Needs no torch_xla: the default backend of ``python -m torchshard demo`` on a plain install.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import multiprocessing
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from torchshard._tools._demo_common import (
    STEPS_PER_EPOCH,
    Result,
    SyntheticClassification,
    _input_wait,
    _mean,
    host_loader,
    mesh_shape,
    mlp,
)

# A process that fails or hangs must not leave the others waiting forever.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclasses.dataclass(frozen=True)
class Settings:
    """One demo run (picklable: every process gets it)."""

    processes: int
    steps: int
    batch_size: int
    workers: int
    lr: float
    seed: int
    agreement_check: bool = True
    quiet: bool = False


def _rank_main(rank: int, init_method: str, s: Settings, results: Any) -> None:
    """One gloo process: trains; rank 0 prints and reports the ``Result``."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share the cores
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=s.processes,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        _train_rank(rank, s, results)
    finally:
        # The model is gone with _train_rank's frame; DDP's reducer, which holds the process
        # group, may still sit in a cycle: free it first, or gloo may abort at exit
        # (pytorch/pytorch#190489).
        gc.collect()
        dist.destroy_process_group()


def _train_rank(rank: int, s: Settings, results: Any) -> None:
    """The training of one process, inside its process group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torchshard as ts

    log: Callable[[str], None] = (
        (lambda msg: print(msg, flush=True)) if rank == 0 and not s.quiet else (lambda msg: None)
    )
    ts.set_agreement_check(s.agreement_check)
    torch.manual_seed(s.seed)
    mesh = ts.create_device_mesh(mesh_shape(s.processes), ("data", "model"), backend="dtensor")
    dataset = SyntheticClassification(STEPS_PER_EPOCH * s.batch_size, seed=s.seed)
    per_process = s.batch_size // s.processes
    with mesh:  # the feed from the mesh: the shard of the rows this process holds
        sampler = ts.host_sampler(dataset, ts.input_partition_spec(), seed=s.seed)
    workers = max(1, s.workers // s.processes) if s.workers > 0 else 0
    source = host_loader(dataset, per_process, sampler, workers)
    log(
        f"mesh {dict(mesh.shape)}, {s.processes} gloo process(es) x {workers} DataLoader "
        f"worker(s){' (forkserver)' if workers else ''}, global batch {s.batch_size} "
        f"({per_process} per process), {s.steps} steps"
    )
    model = DistributedDataParallel(mlp())  # same seed: the same start on every process
    optimizer = torch.optim.Adam(model.parameters(), lr=s.lr)
    every = max(1, s.steps // 10)
    warmup = min(3, s.steps - 1)
    losses: list[float] = []
    with mesh, ts.GlobalBatchLoader(source) as loader:
        t_start = time.perf_counter()
        t_warm, step, epoch = t_start, 0, 0
        while step < s.steps:
            sampler.set_epoch(epoch)
            for batch in loader:  # DTensors, dim 0 split over every process
                logits = model(batch["x"].to_local())
                loss = torch.nn.functional.cross_entropy(logits, batch["y"].to_local())
                optimizer.zero_grad()
                loss.backward()  # DDP averages the gradients over the processes
                optimizer.step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)  # equal rows per process: the global batch's mean
                losses.append(mean.item() / s.processes)
                step += 1
                if step == warmup:
                    t_warm = time.perf_counter()
                if step % every == 0 or step == s.steps:
                    elapsed = time.perf_counter() - t_warm
                    done = step - warmup
                    frac = _input_wait(loader.stats)
                    rate = f"{done / elapsed:6.1f} steps/s" if done > 0 else " warming up"
                    log(f"step {step:>5}/{s.steps}  loss {losses[-1]:.4f}  {rate}  {frac}")
                if step == s.steps:
                    break
            epoch += 1
        elapsed = time.perf_counter() - t_warm
        stats = loader.stats
    # The figure reported is the process that waited most (each process's loader waits
    # for its own DataLoader; DDP's all-reduce makes every step the slowest one's).
    wait = torch.tensor([stats.input_wait_fraction], dtype=torch.float64)
    dist.all_reduce(wait, op=dist.ReduceOp.MAX)
    if rank == 0:
        timed = max(s.steps - warmup, 1)
        window = max(1, min(10, s.steps // 5))
        results.put(
            Result(
                first_loss=_mean(losses[:window]),
                last_loss=_mean(losses[-window:]),
                steps_per_second=timed / elapsed,
                examples_per_second=timed * s.batch_size / elapsed,
                input_wait_fraction=float(wait.item()),
                warmup_seconds=t_warm - t_start,
                warmup_wait_seconds=stats.warmup_wait_seconds,
            )
        )


def train(
    *,
    processes: int = 8,
    steps: int = 300,
    batch_size: int = 256,
    workers: int = 2,
    lr: float = 3e-3,
    seed: int = 0,
    timeout: float = 900.0,
    agreement_check: bool = True,
    quiet: bool = False,
) -> Result:
    """Trains the MLP over ``processes`` gloo processes (started with ``spawn``); rank 0
    prints the progress lines (unless ``quiet``). ``agreement_check``: each process's
    ``set_agreement_check`` (the lab's ``python -m benchmarks dtensor_loader`` compares both).
    Raises ``RuntimeError`` when a process fails or the run takes longer than ``timeout``
    seconds (the processes are then stopped)."""
    s = Settings(processes, steps, batch_size, workers, lr, seed, agreement_check, quiet)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    # A TCPStore (rank 0 serves it), as torchrun gives; torchshard's exchanges use it only to
    # set up their own connections.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    procs = [
        ctx.Process(target=_rank_main, args=(r, init_method, s, results), name=f"rank{r}")
        for r in range(processes)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.terminate()
        for p in alive:
            p.join(10)
    failed = {p.name: p.exitcode for p in procs if p.exitcode != 0}
    if alive:
        raise RuntimeError(
            f"demo: the gloo processes {[p.name for p in alive]} were still running after "
            f"{timeout:.0f} s and were stopped."
        )
    if failed:
        raise RuntimeError(
            f"demo: gloo process(es) failed (exit codes {failed}); their errors are above."
        )
    if results.empty():
        raise RuntimeError("demo: rank 0 finished without reporting a result.")
    return results.get()
