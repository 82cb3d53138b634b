"""The check that copies of a stream do not echo each other: a ``DataLoader`` whose worker
processes each read the whole stream (``IterableDataset``) instead of their own shard gives
every example ``num_workers`` times. Its first ``num_workers`` batches come one from each
worker, in order; when two are equal, the producer raises before the first is handed over
(unless the loader's ``allow_equal_batches`` says equal batches are meant)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.utils.data

from torchshard._core.errors import ShardingError
from torchshard._core.tree import flatten


def stream_workers(source: Any) -> int:
    """The worker processes of a DataLoader over a stream (``IterableDataset``), else 0."""
    dataset = getattr(source, "dataset", None)
    workers = getattr(source, "num_workers", 0)
    if isinstance(dataset, torch.utils.data.IterableDataset) and isinstance(workers, int):
        return workers if workers > 1 else 0
    return 0


def _digest(tree: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    leaves, treespec = flatten(tree)
    h.update(str(treespec).encode())
    for x in leaves:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous()
            h.update(f"{tuple(x.shape)} {x.dtype}".encode())
            if x.numel():
                h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, np.ndarray):
            h.update(f"{x.shape} {x.dtype}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


def echo_error(
    batches: list[Any], workers: int, *, host: int | None, batch: int
) -> ShardingError | None:
    """The error when a DataLoader's ``workers`` yielded the same first batch (its first
    ``workers`` batches come one from each worker, in order), else ``None``."""
    if len(batches) < 2:
        return None
    digests = [_digest(b) for b in batches]
    if len(set(digests)) == len(digests):
        return None
    same = [w for w, d in enumerate(digests) if digests.count(d) > 1]
    name = "the DataLoader" if host is None else f"host {host}'s DataLoader"
    return ShardingError(
        f"GlobalBatchLoader: batch {batch}: {name} has {workers} worker processes over a stream "
        f"(IterableDataset), and workers {same} yielded the same first batch: each of them reads "
        "the whole stream, so its examples would come several times. Split the stream by worker "
        "inside the dataset's __iter__: index, count = torchshard.stream_shard() (over the "
        "processes and the workers) and read shard index of count (HF datasets: "
        "split_dataset_by_node(ds, rank=index, world_size=count) in the main process; datasets "
        "splits by worker itself). If the stream is split and its examples are equal on purpose "
        "(synthetic data such as zeros), pass GlobalBatchLoader(..., allow_equal_batches=True)."
    )
