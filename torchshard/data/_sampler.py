"""``host_sampler``: the sampler that reads this host's shard of a dataset."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

from torch.utils.data import DistributedSampler

from torchshard._core.errors import ShardingError, at
from torchshard._core.feed import feed_read_config
from torchshard._core.spec import DataPartitionType, PartitionSpec

_KEYS = ("num_shards", "shard_index")


def _read_config(dispatcher_or_feed_config: Any) -> tuple[int, int]:
    arg = "dispatcher_or_feed_config"
    config = dispatcher_or_feed_config
    if isinstance(config, (PartitionSpec, DataPartitionType)):
        # The feed of dim 0 on the current mesh: processes that hold one block read one shard.
        try:
            config = feed_read_config(config)
        except ShardingError as e:
            raise type(e)(f"host_sampler(dataset, {config!r}): {e}") from None
    elif callable(getattr(config, "feed_read_config", None)):
        config = config.feed_read_config()
        arg = f"{arg}.feed_read_config()"
    if not isinstance(config, Mapping):
        raise TypeError(
            at(
                arg,
                "expected a PartitionSpec (the batch's layout on the current mesh, e.g. "
                "P('dp')), an input dispatcher (with feed_read_config()) or a dict "
                f"{{'num_shards': int, 'shard_index': int}}, but got {type(config).__name__}.",
            )
        )
    if set(config) != set(_KEYS):
        raise ValueError(at(arg, f"expected the keys {list(_KEYS)}, but got {sorted(config)}."))
    num, index = config["num_shards"], config["shard_index"]
    for key, value in (("num_shards", num), ("shard_index", index)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{arg}['{key}']: expected an int, but got {value!r}.")
    if num < 1 or not 0 <= index < num:
        raise ValueError(
            at(
                arg,
                f"expected num_shards >= 1 and 0 <= shard_index < num_shards, but got "
                f"num_shards={num}, shard_index={index}.",
            )
        )
    return num, index


def host_sampler(
    dataset: Sized,
    dispatcher_or_feed_config: Any,
    /,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
) -> DistributedSampler[Any]:
    """A sampler over this host's shard of ``dataset`` (``DistributedSampler`` semantics).

    Shard ``shard_index`` of ``num_shards`` (for a spec, ``torchshard.feed_read_config(spec)``
    on the current mesh; for a dispatcher, ``dispatcher.feed_read_config()``; or the dict
    itself) holds every ``num_shards``-th index of the epoch's (shuffled) order, starting
    at ``shard_index``. With ``drop_last=True`` every shard has ``len(dataset) // num_shards``
    indices and no two shards share an example, so the hosts' batches, assembled, hold every
    example at most once per epoch (exactly once when the shard size is a multiple of the
    batch size). Every host must use the same ``seed``; call ``sampler.set_epoch(epoch)`` for
    a new order each epoch.

    Args:
        dataset: a map-style dataset (with ``len()``).
        dispatcher_or_feed_config: the batch's ``PartitionSpec`` (or ``DataPartitionType``)
            on the current mesh, e.g. ``P("dp")``: processes whose devices hold the same block
            of dim 0 read the same shard (on a ``(dp, tp)`` mesh the tp peers read the same
            examples); an ``InputDispatcher``; or ``{"num_shards", "shard_index"}``.
        shuffle: shuffle the indices (the same permutation on every host).
        seed: the shuffling seed.
        drop_last: drop the tail so that every shard has the same size (else the tail is
            padded with repeated indices, as ``DistributedSampler`` does).

    Raises:
        NoMeshError: a spec outside any mesh; else as ``torchshard.feed_read_config``.

    Example:
        >>> feed = {"num_shards": 2, "shard_index": 1}
        >>> sampler = torchshard.host_sampler(range(10), feed, shuffle=False)
        >>> list(sampler)
        [1, 3, 5, 7, 9]
    """
    num, index = _read_config(dispatcher_or_feed_config)
    if not isinstance(dataset, Sized):
        raise TypeError(
            f"dataset: expected a map-style dataset with len(), but got {type(dataset).__name__}."
        )
    return DistributedSampler(
        dataset,  # type: ignore[arg-type]
        num_replicas=num,
        rank=index,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
