"""``global_batch_loader_per_host``: a ``GlobalBatchLoader`` with one source per virtual host."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._mesh.mesh import Mesh
from torchshard.data._loader.loader import GlobalBatchLoader, per_host_loader


def global_batch_loader_per_host(
    loaders: Sequence[Iterable[Any]],
    /,
    *,
    partition: Any = DEFAULT_PARTITION,
    mesh: Mesh | None = None,
    dispatchers: Sequence[Any] | None = None,
    prefetch: int = 2,
    prefetch_bytes: int | None = None,
    last_batch: str = "error",
    batch_leaf: Any = None,
    allow_equal_batches: bool = False,
) -> GlobalBatchLoader:
    """A ``GlobalBatchLoader`` that plays every host of ``virtual_hosts(n)``.

    Each step takes one batch from every host's source (``loaders[h]`` is host ``h``'s, with
    its own ``dispatchers[h]``) and assembles them as ``host_to_global_array_per_host`` does,
    through the same engine as the real path. Everything else (prefetching, order, errors, stats,
    ``last_batch``, ``batch_leaf`` and ``allow_equal_batches`` across the hosts' sources,
    ``len()``, ``state_dict`` with ``{"process_0": {"sources": [...], ...}, ...}``) is
    ``GlobalBatchLoader``'s. ``iter()`` must run inside ``virtual_hosts(len(loaders))``.

    Example (2 hosts, 4 rows from each per step):
        >>> from torch.utils.data import DataLoader
        >>> from torchshard.testing import global_batch_loader_per_host, virtual_hosts
        >>> ds = range(16)
        >>> feeds = [{"num_shards": 2, "shard_index": h} for h in range(2)]
        >>> loaders = [
        ...     DataLoader(ds, batch_size=4, sampler=torchshard.host_sampler(ds, f, shuffle=False))
        ...     for f in feeds
        ... ]
        >>> with virtual_hosts(2), torchshard.Mesh(np.arange(8), ("data",)):
        ...     for batch in global_batch_loader_per_host(loaders):
        ...         print(torchshard.replicate_to_local_data(batch).tolist())
        [0, 2, 4, 6, 1, 3, 5, 7]
        [8, 10, 12, 14, 9, 11, 13, 15]
    """
    if not isinstance(loaders, (list, tuple)) or not loaders:
        raise TypeError(
            "loaders: expected a non-empty list with one source per host, but got "
            f"{type(loaders).__name__}."
        )
    return per_host_loader(
        loaders,
        dispatchers,
        partition=partition,
        mesh=mesh,
        prefetch=prefetch,
        prefetch_bytes=prefetch_bytes,
        last_batch=last_batch,
        batch_leaf=batch_leaf,
        allow_equal_batches=allow_equal_batches,
    )
