"""The checks that copies of a stream do not echo each other, at an epoch's first batch (unless
the loader's ``allow_equal_batches`` says equal batches are meant):

- a ``DataLoader`` whose worker processes each read the whole stream (``IterableDataset``)
  instead of their own shard gives every example ``num_workers`` times. Its first
  ``num_workers`` batches come one from each worker, in order; when two are equal, the
  producer raises before the first is handed over (``echo_error``);
- processes (or virtual hosts) that hold different blocks of the batch but read one stream (not
  split by process) pass equal first batches: each host's first batch is digested with its
  feed (``feed_items``), the digests of every process compared through one exchange, and a
  digest under two feeds raises the same ``ShardingError`` on every process
  (``feed_echo_error``)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.utils.data

from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import dim_axes, dim_feeds
from torchshard._core.spec import UNCONSTRAINED, PartitionSpec
from torchshard._core.tree import flatten


def stream_workers(source: Any) -> int:
    """The worker processes of a DataLoader over a stream (``IterableDataset``), else 0."""
    dataset = getattr(source, "dataset", None)
    workers = getattr(source, "num_workers", 0)
    if isinstance(dataset, torch.utils.data.IterableDataset) and isinstance(workers, int):
        return workers if workers > 1 else 0
    return 0


def is_stream(source: Any) -> bool:
    """Whether ``source`` reads a stream: an ``IterableDataset`` (torch's, HF's), or a
    DataLoader over one; such a source has no sampler to split it by process."""
    data = getattr(source, "dataset", source)
    return isinstance(data, torch.utils.data.IterableDataset) or (
        type(data).__name__ == "IterableDataset" and type(data).__module__.startswith("datasets")
    )


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


def feed_items(
    mesh: Mesh, spec: Any, hosts: list[Any], processes: list[int], device_process: tuple[int, ...]
) -> list[tuple[str, int]]:
    """``("<feed>:<digest>", process)`` of each host batch of this process (``hosts[h]``,
    supplied for ``processes[h]``), its feed along dim 0 of ``spec`` (the batch leaf's); none
    where the feeds are not defined or there is one feed (nothing to compare)."""
    if not isinstance(spec, PartitionSpec) or (len(spec) and spec[0] is UNCONSTRAINED):
        return []
    dim0 = PartitionSpec(spec[0]) if len(spec) else PartitionSpec()
    try:
        f = dim_feeds(mesh, dim_axes(mesh, dim0, 1), device_process)[0]
    except (ValueError, TypeError):
        return []
    if f.count is None or f.count < 2:
        return []
    return [(f"{f.feed(p)}:{_digest(x)}", p) for x, p in zip(hosts, processes, strict=True)]


def feed_echo_error(
    items: list[tuple[str, list[int]]], *, spec: Any, batch: int
) -> ShardingError | None:
    """The error when two feeds' first batches are equal, else ``None``: the processes that
    should hold different blocks read one stream. ``items``: every distinct ``"<feed>:<digest>"``
    of the job with the processes that passed it."""
    by_digest: dict[str, dict[int, list[int]]] = {}
    for item, processes in items:
        feed, digest = item.split(":", 1)
        by_digest.setdefault(digest, {}).setdefault(int(feed), []).extend(processes)
    for by_feed in by_digest.values():
        if len(by_feed) > 1:
            (a, pa), (b, pb) = sorted(by_feed.items())[:2]
            return ShardingError(
                f"GlobalBatchLoader: batch {batch}: process {min(pa)} (feed {a}) and process "
                f"{min(pb)} (feed {b}) passed the same first batch, but under {spec!r} they hold "
                "different blocks of it: each reads the whole stream (nothing split it by "
                "process), so its examples would come several times. Split the stream by "
                "process: index, count = torchshard.stream_shard(partition) and read shard index "
                "of count (HF datasets: split_dataset_by_node(ds, rank=index, world_size=count)), "
                "or read a stream of shards through torchshard.data.sharded_stream. If the "
                "processes are meant to pass the same examples (replicas, synthetic data), say "
                "so with GlobalBatchLoader(..., allow_equal_batches=True), or give the batch a "
                "partition under which they hold one block (e.g. P() for a replicated batch)."
            )
    return None
