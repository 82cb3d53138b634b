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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _input_wait(stats: Any) -> str:
    """The progress line's input wait: the loader's own figure (``LoaderStats``)."""
    fraction = stats.input_wait_fraction
    return "" if fraction != fraction else f"input wait {fraction:5.1%}"  # nan: not yet
