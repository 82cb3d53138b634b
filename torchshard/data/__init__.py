"""Feeding steps from ``torch.utils.data``, in the order data flows:

- Feeders that work alone, each before or inside a ``DataLoader``: ``_sampler.py``
  (``host_sampler`` -> ``HostSampler``: the shard of a map-style dataset this process reads,
  from the mesh), ``_stream_shard.py`` (``stream_shard``: the shard of a stream a process, and
  a DataLoader worker inside it, reads), ``_collate.py`` (``sharded_collate``: the DataLoader's
  own collate making global batches, ``num_workers=0``), ``_packer.py`` (``Packer``: documents
  packed into fixed-length rows, a source with its own state), ``_cp_rows.py``
  (``context_parallel_rows``: each process's part of packed rows, in a context-parallel order
  that respects their documents), ``_sharded_stream.py`` (``sharded_stream`` ->
  ``ShardedStream``: a stream of shards in batches, each shard's position recorded, resumed on
  any number of processes with the unfinished shards split again), ``_fixed_batch.py``
  (``fixed_global_batches`` -> ``FixedGlobalBatches``: each process's part of a global batch
  kept on any number of processes).
- The loader's wing, ``_loader/`` (``GlobalBatchLoader``: host batches from any of them ->
  global sharded batches, prefetched; its map is ``_loader/__init__.py``).

The feeders import nothing of the wing. Public names: ``GlobalBatchLoader``, ``LoaderStats``,
``host_sampler``, ``HostSampler``, ``Packer``, ``ShardedStream``, ``FixedGlobalBatches``,
``fixed_global_batches``, ``context_parallel_rows``,
``sharded_collate``, ``sharded_stream``, ``stream_shard``.
"""

import warnings as _warnings
from typing import Any as _Any

from torchshard.data._collate import sharded_collate as sharded_collate
from torchshard.data._cp_rows import context_parallel_rows as context_parallel_rows
from torchshard.data._fixed_batch import FixedGlobalBatches as FixedGlobalBatches
from torchshard.data._fixed_batch import fixed_global_batches as fixed_global_batches
from torchshard.data._loader.loader import GlobalBatchLoader as GlobalBatchLoader
from torchshard.data._loader.stats import LoaderStats as LoaderStats
from torchshard.data._packer import Packer as Packer
from torchshard.data._sampler import HostSampler as HostSampler
from torchshard.data._sampler import host_sampler as host_sampler
from torchshard.data._sharded_stream import ShardedStream as ShardedStream
from torchshard.data._sharded_stream import sharded_stream as sharded_stream
from torchshard.data._stream_shard import stream_shard as stream_shard

__all__ = [
    "FixedGlobalBatches",
    "GlobalBatchLoader",
    "HostSampler",
    "LoaderStats",
    "Packer",
    "ShardedStream",
    "context_parallel_rows",
    "fixed_global_batches",
    "host_sampler",
    "sharded_collate",
    "sharded_stream",
    "stream_shard",
]
assert sorted(__all__) == __all__


def __getattr__(name: str) -> _Any:
    if name == "WorkerProcessError":  # moved to torchshard.errors (0.2)
        _warnings.warn(
            "torchshard.data.WorkerProcessError is deprecated; use "
            "torchshard.errors.WorkerProcessError.",
            DeprecationWarning,
            stacklevel=2,
        )
        from torchshard._core.errors import WorkerProcessError

        return WorkerProcessError
    raise AttributeError(f"module 'torchshard.data' has no attribute {name!r}")
