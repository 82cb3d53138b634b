"""``host_sampler``: the sampler that reads this host's shard of a dataset."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sized
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from torchshard._core.errors import at

_KEYS = ("num_shards", "shard_index")


def _index(value: Any) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


def _read_config(dispatcher_or_feed_config: Any) -> tuple[int, int]:
    arg = "dispatcher_or_feed_config"
    config = dispatcher_or_feed_config
    if callable(getattr(config, "feed_read_config", None)):
        config = config.feed_read_config()
        arg = f"{arg}.feed_read_config()"
    if not isinstance(config, Mapping):
        raise TypeError(
            at(
                arg,
                f"expected an input dispatcher (with feed_read_config()) or a dict "
                f"{{'num_shards': int, 'shard_index': int}}, but got {type(config).__name__}.",
            )
        )
    if set(config) != set(_KEYS):
        raise ValueError(at(arg, f"expected the keys {list(_KEYS)}, but got {sorted(config)}."))
    ints = []
    for key in _KEYS:
        value = config[key]
        # any integer (np.int64 from a config read with numpy too), but not a bool or a float
        n = None if isinstance(value, (bool, np.bool_)) else _index(value)
        if n is None:
            raise TypeError(f"{arg}['{key}']: expected an int, but got {value!r}.")
        ints.append(n)
    num, index = ints[_KEYS.index("num_shards")], ints[_KEYS.index("shard_index")]
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

    Shard ``shard_index`` of ``num_shards`` (from ``dispatcher.feed_read_config()``, or the
    dict itself) holds every ``num_shards``-th index of the epoch's (shuffled) order, starting
    at ``shard_index``. With ``drop_last=True`` every shard has ``len(dataset) // num_shards``
    indices and no two shards share an example, so the hosts' batches, assembled, hold every
    example at most once per epoch (exactly once when the shard size is a multiple of the
    batch size). Every host must use the same ``seed``; call ``sampler.set_epoch(epoch)`` for
    a new order each epoch.

    Args:
        dataset: a map-style dataset (with ``len()``).
        dispatcher_or_feed_config: an ``InputDispatcher`` or ``{"num_shards", "shard_index"}``.
        shuffle: shuffle the indices (the same permutation on every host).
        seed: the shuffling seed.
        drop_last: drop the tail so that every shard has the same size (else the tail is
            padded with repeated indices, as ``DistributedSampler`` does).

    Raises:
        ValueError: with ``drop_last=True``, a dataset smaller than ``num_shards`` (every
            host's epoch would be empty). ``TypeError``: a config value that is no integer
            (numpy integers are accepted; bools and floats are not).

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
    if drop_last and len(dataset) < num:
        raise ValueError(
            f"dataset: {len(dataset)} example(s) over {num} shards with drop_last=True gives "
            "every host an empty epoch. Use a dataset of at least num_shards examples, or "
            "drop_last=False (the tail is padded with repeated examples)."
        )
    return DistributedSampler(
        dataset,  # type: ignore[arg-type]
        num_replicas=num,
        rank=index,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
