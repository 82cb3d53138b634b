"""Feeding steps from ``torch.utils.data``: ``GlobalBatchLoader``, ``sharded_collate``,
``host_sampler`` (``HostSampler``), ``stream_shard``."""

import warnings as _warnings
from typing import Any as _Any

from torchshard.data._collate import sharded_collate as sharded_collate
from torchshard.data._loader import GlobalBatchLoader as GlobalBatchLoader
from torchshard.data._loader import LoaderStats as LoaderStats
from torchshard.data._sampler import HostSampler as HostSampler
from torchshard.data._sampler import host_sampler as host_sampler
from torchshard.data._stream import stream_shard as stream_shard

__all__ = [
    "GlobalBatchLoader",
    "HostSampler",
    "LoaderStats",
    "host_sampler",
    "sharded_collate",
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
