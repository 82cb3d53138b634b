"""Feeding steps from ``torch.utils.data``: ``GlobalBatchLoader``, ``sharded_collate``,
``host_sampler``."""

from torchshard._core.errors import WorkerProcessError as WorkerProcessError
from torchshard.data._collate import sharded_collate as sharded_collate
from torchshard.data._loader import GlobalBatchLoader as GlobalBatchLoader
from torchshard.data._loader import LoaderStats as LoaderStats
from torchshard.data._sampler import host_sampler as host_sampler

__all__ = [
    "GlobalBatchLoader",
    "LoaderStats",
    "WorkerProcessError",
    "host_sampler",
    "sharded_collate",
]
assert sorted(__all__) == __all__
