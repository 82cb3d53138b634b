"""``global_batch_loader_per_host``: a ``GlobalBatchLoader`` with one source per virtual host."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torchshard._assemble import DEFAULT_PARTITION
from torchshard._mesh import Mesh
from torchshard.data._loader import GlobalBatchLoader
from torchshard.testing._virtual import assemble_per_host


def _assemble_per_host(hosts: list[Any], spec: Any, background: bool) -> Any:
    return assemble_per_host(hosts, partition=spec, background=background)


def global_batch_loader_per_host(
    loaders: Sequence[Iterable[Any]],
    /,
    *,
    partition: Any = DEFAULT_PARTITION,
    mesh: Mesh | None = None,
    dispatchers: Sequence[Any] | None = None,
    prefetch: int = 2,
) -> GlobalBatchLoader:
    """A ``GlobalBatchLoader`` that plays every host of ``virtual_hosts(n)``.

    Each step takes one batch from every host's source (``loaders[h]`` is host ``h``'s, with
    its own ``dispatchers[h]``) and assembles them with ``host_to_global_array_per_host``, the
    same code path as the real one. Everything else (prefetching, order, errors, stats,
    ``state_dict`` with ``{"sources": [...]}``) is ``GlobalBatchLoader``'s. ``iter()`` must run
    inside ``virtual_hosts(len(loaders))``.

    Example:
        >>> ds = range(64)
        >>> loaders = [
        ...     DataLoader(ds, batch_size=8, sampler=host_sampler(ds, {"num_shards": 2,
        ...                                                           "shard_index": h}))
        ...     for h in range(2)
        ... ]
        >>> with virtual_hosts(2), mesh:
        ...     for batch in global_batch_loader_per_host(loaders):
        ...         ...  # 16 rows: 8 from each host
    """
    if not isinstance(loaders, (list, tuple)) or not loaders:
        raise TypeError(
            "loaders: expected a non-empty list with one source per host, but got "
            f"{type(loaders).__name__}."
        )
    return GlobalBatchLoader._from_hosts(
        loaders,
        dispatchers,
        partition=partition,
        mesh=mesh,
        prefetch=prefetch,
        assemble=_assemble_per_host,
    )
