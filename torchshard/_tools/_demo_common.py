"""What both demos share (``demo.py`` on torch_xla, ``demo_dtensor.py`` on DTensor): the
synthetic dataset, the model, the DataLoader worker check and the ``Result``. Pure numpy and
torch: DataLoader workers import it, never torch_xla.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

FEATURES, CLASSES = 32, 10
# An epoch is this many batches: the dataset holds STEPS_PER_EPOCH * batch examples of
# EXAMPLE_BYTES each (float32 features and an int64 label).
STEPS_PER_EPOCH = 64
EXAMPLE_BYTES = FEATURES * 4 + 8
# The data a run may hold, over every copy (each process builds the dataset, each DataLoader
# worker unpickles one): 4 GiB, so that `--batch 2**31` (17 TiB a copy) is refused before
# anything is allocated, while the default batch (2.1 MiB a copy) and batches of 100,000 pass.
MAX_DATA_BYTES = 4 << 30
# The fewest steps whose losses can tell whether the model learns. Measured (the demo's model,
# data, Adam at 3e-3 and windows, on the CPU; 16-48 seeds per cell): the last window's loss is
# 5 % below the first's for every seed from 6 steps at batch 256, 10 at 64, 16 at 32, 50 at 8
# and 80 at 1, and for only some seeds below that (at 2 steps for about 1 seed in 4, whatever
# the batch): fewer steps are no evidence either way.
MIN_JUDGED_STEPS = 100


class SyntheticClassification(Dataset[dict[str, np.ndarray]]):
    """Gaussian features labelled by a fixed random linear teacher (learnable, pure numpy)."""

    def __init__(self, size: int, *, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
        self.x = rng.standard_normal((size, FEATURES)).astype(np.float32)
        self.y = (self.x @ teacher).argmax(axis=1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"x": self.x[i], "y": self.y[i]}


def check_worker(worker_id: int) -> None:
    """``worker_init_fn``: a DataLoader worker must not carry torch_xla."""
    if "torch_xla" in sys.modules:
        raise RuntimeError(
            f"DataLoader worker {worker_id} has torch_xla imported; start workers with the "
            "'forkserver' or 'spawn' method and keep the dataset free of XLA."
        )


def host_loader(dataset: Any, batch_size: int, sampler: Any, workers: int) -> DataLoader:
    """A host's DataLoader over its sampler's shard, with ``workers`` worker processes forked
    from a server that has imported this module (torch, numpy; no XLA), each checking so."""
    if workers:
        multiprocessing.set_forkserver_preload([__name__])
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        multiprocessing_context="forkserver" if workers else None,
        persistent_workers=workers > 0,
        worker_init_fn=check_worker,
    )


def mesh_shape(devices: int) -> tuple[int, int]:
    """The demos' ``(data, model)`` mesh: ``(N / 2, 2)`` for an even device count N, else
    ``(N, 1)``: a mesh of every device for any N >= 1 (both axes named, so the ``FULL`` spec
    ``P(("data", "model"))`` reads the same on every count)."""
    return (devices // 2, 2) if devices % 2 == 0 else (devices, 1)


def mlp() -> torch.nn.Module:
    """The model: 32 -> 128 -> 128 -> 10."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, CLASSES),
    )


@dataclasses.dataclass
class Result:
    """What a demo run measured. ``input_wait_fraction`` is the loader's own figure
    (``LoaderStats.input_wait_fraction``: the share of step time spent waiting for input after
    each epoch's first batch; the DTensor demo's: the largest over its processes);
    ``warmup_wait_seconds`` the wait for those first batches."""

    first_loss: float
    last_loss: float
    steps_per_second: float
    examples_per_second: float
    input_wait_fraction: float
    warmup_seconds: float
    warmup_wait_seconds: float = 0.0

    @property
    def loss_fell(self) -> bool:
        """Whether the loss of the last steps is at least 5 % below that of the first steps."""
        return self.last_loss < 0.95 * self.first_loss


def data_copies(devices: int, hosts: int, workers: int, *, backend: str) -> tuple[int, str]:
    """How many copies of the dataset a run holds, and who holds them (in words): the XLA
    demo's process and every DataLoader worker of its hosts; every gloo process of the DTensor
    demo and its workers."""
    if backend == "dtensor":
        each = max(1, workers // devices) if workers > 0 else 0
        copies = devices * (1 + each)
        return copies, f"the {devices} gloo processes and their {devices * each} worker(s)"
    total = hosts * (max(1, workers // hosts) if workers > 0 else 0)
    return 1 + total, f"this process and its {total} DataLoader worker(s)"


def data_size(nbytes: int) -> str:
    """``nbytes`` for a reader: ``2.1 MiB``, ``17.0 TiB``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,} bytes"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _input_wait(stats: Any) -> str:
    """The progress line's input wait: the loader's own figure (``LoaderStats``)."""
    fraction = stats.input_wait_fraction
    return "" if fraction != fraction else f"input wait {fraction:5.1%}"  # nan: not yet
