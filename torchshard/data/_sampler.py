"""``host_sampler``: the sampler that reads this host's shard of a dataset (``HostSampler``).

Each epoch has one global order of the dataset's indices (``DistributedSampler``'s: a
permutation seeded ``seed + epoch``, or ``0..n-1``); shard ``i`` of ``k`` reads every ``k``-th
index of it, starting at ``i``. A sampler also knows where in that order its epoch starts
(``start``, 0 unless resumed), so that a job resumed on another number of hosts reads on from the
next unconsumed example of the same order (``GlobalBatchLoader.load_state_dict``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from torchshard._core.errors import ShardingError, at
from torchshard._core.feed import feed_read_config
from torchshard._core.spec import DataPartitionType, PartitionSpec

_KEYS = ("num_shards", "shard_index")
STATE_KEYS = (
    "drop_last",
    "epoch",
    "num_examples",
    "num_shards",
    "seed",
    "shard_index",
    "shuffle",
    "start",
    "yielded",
)


def _index(value: Any) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


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


class HostSampler(DistributedSampler[int]):
    """This host's shard of a dataset's epoch (``DistributedSampler``, without repeats).

    Made by ``torchshard.host_sampler``; ``num_replicas``/``rank`` are the shard count and
    index. ``drop_last=True``: every shard has ``(n - start) // num_shards`` indices;
    ``drop_last=False``: every index of the epoch once, so shards differ by at most one index
    (``DistributedSampler`` repeats indices instead; use ``GlobalBatchLoader(...,
    last_batch="pad")`` to feed the short shards).

    ``state_dict()``/``load_state_dict()``: the epoch, where it starts in the global order and
    how many indices the current pass yielded (``StatefulDataLoader`` saves and restores it).
    ``set_epoch(e)`` with another epoch starts that epoch at its beginning.
    """

    def __init__(
        self,
        dataset: Sized,
        num_shards: int,
        shard_index: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_shards,
            rank=shard_index,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.start = 0  # where the epoch's pass begins in its global order
        self.yielded = 0  # indices the current pass yielded
        self._skip: int | None = None  # set by load_state_dict: the next pass skips these
        self._sizes()

    def _sizes(self) -> None:
        rest = max(len(self.dataset) - self.start, 0)  # type: ignore[arg-type]
        k = self.num_replicas
        self.num_samples = rest // k if self.drop_last else len(range(self.rank, rest, k))
        self.total_size = rest // k * k if self.drop_last else rest

    def global_order(self) -> list[int]:
        """The epoch's order of the whole dataset (every shard's, interleaved)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip or 0, None
        self._sizes()
        order = self.global_order()[self.start :]
        mine = order[self.rank : self.total_size : self.num_replicas]
        self.yielded = skip
        for i in mine[skip:]:
            self.yielded += 1
            yield i
        # The pass is complete: the next one (the same epoch again) starts at the beginning.
        self.start, self.yielded = 0, 0
        self._sizes()

    def __len__(self) -> int:
        """This shard's examples of the whole epoch, as torch's ``DistributedSampler`` counts
        them. A pass resumed mid-epoch yields the rest (as torchdata's ``StatefulDataLoader``
        and Lightning count an epoch: Lightning sizes it by ``len()`` and ends a resumed one at
        the loader's end); the count does not change while a pass runs, whose read-ahead
        restarts the sampler at 0 at its end, at a moment that differs between processes."""
        n, k = len(self.dataset), self.num_replicas  # type: ignore[arg-type]
        return n // k if self.drop_last else len(range(self.rank, n, k))

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (its own order); another epoch than the current starts at 0."""
        if epoch != self.epoch:
            self.start, self.yielded, self._skip = 0, 0, None
        super().set_epoch(epoch)

    def resume(self, epoch: int, start: int) -> None:
        """The next pass is epoch ``epoch`` from global position ``start`` (examples of the
        epoch's order already consumed, by any number of hosts)."""
        self.epoch, self.start, self.yielded, self._skip = epoch, start, 0, None
        self._sizes()

    def identity(self) -> dict[str, Any]:
        """What a resumed sampler must share with the saved one: the same global order."""
        return {
            "num_examples": len(self.dataset),  # type: ignore[arg-type]
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def state_dict(self) -> dict[str, Any]:
        """The epoch, its start in the global order, the indices yielded by this pass, and the
        configuration they mean something in."""
        return {
            **self.identity(),
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "num_shards": self.num_replicas,
            "shard_index": self.rank,
            "start": self.start,
            "yielded": self.yielded,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores ``state_dict()``'s position; the next pass goes on from there.

        Raises:
            ValueError: a state of another shape, or of a sampler with another order, shard
                count or index (resuming on another number of hosts goes through
                ``GlobalBatchLoader.load_state_dict``, which restarts each host's shard from
                the epoch's global position).
        """
        where = "HostSampler.load_state_dict: state_dict"
        if not isinstance(state_dict, dict) or set(state_dict) != set(STATE_KEYS):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"{where}: expected a dict with keys {list(STATE_KEYS)} (from "
                f"HostSampler.state_dict()), but got {got}."
            )
        mine = {**self.identity(), "num_shards": self.num_replicas, "shard_index": self.rank}
        other = {k: state_dict[k] for k in mine}
        if other != mine:
            raise ValueError(
                f"{where}: saved by a sampler with {other}, but this one has {mine}. A shard's "
                "position means something only in the same order and shard count; to resume on "
                "another number of hosts, load GlobalBatchLoader's state (it restarts every "
                "shard at the epoch's global position)."
            )
        self.epoch, self.start = int(state_dict["epoch"]), int(state_dict["start"])
        self._skip = int(state_dict["yielded"])
        self.yielded = self._skip
        self._sizes()


def host_sampler(
    dataset: Sized,
    dispatcher_or_feed_config: Any,
    /,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
) -> HostSampler:
    """A sampler over this host's shard of ``dataset`` (``DistributedSampler``'s order).

    Shard ``shard_index`` of ``num_shards`` (for a spec, ``torchshard.feed_read_config(spec)``
    on the current mesh; for a dispatcher, ``dispatcher.feed_read_config()``; or the dict
    itself) holds every ``num_shards``-th index of the epoch's (shuffled) order, starting
    at ``shard_index``. With ``drop_last=True`` every shard has ``len(dataset) // num_shards``
    indices and no two shards share an example, so the hosts' batches, assembled, hold every
    example at most once per epoch (exactly once when the shard size is a multiple of the
    batch size). Every host must use the same ``seed``; call ``sampler.set_epoch(epoch)`` for
    a new order each epoch.

    With ``drop_last=False`` every example of the epoch is in exactly one shard, so shards
    differ by at most one example (``DistributedSampler`` would repeat indices to even them,
    which counts examples twice). That is the way to evaluate: feed the shards through
    ``GlobalBatchLoader(..., last_batch="pad")``, which pads the short hosts' batches with
    rows whose mask is ``False``, and weight the metric by the mask.

    The sampler keeps its position in the epoch's global order (``state_dict()``), so a
    ``GlobalBatchLoader`` over it resumes on another number of hosts at the next unconsumed
    example.

    Args:
        dataset: a map-style dataset (with ``len()``).
        dispatcher_or_feed_config: the batch's ``PartitionSpec`` (or ``DataPartitionType``)
            on the current mesh, e.g. ``P("dp")``: processes whose devices hold the same block
            of dim 0 read the same shard (on a ``(dp, tp)`` mesh the tp peers read the same
            examples); an ``InputDispatcher``; or ``{"num_shards", "shard_index"}``.
        shuffle: shuffle the indices (the same permutation on every host).
        seed: the shuffling seed.
        drop_last: drop the tail so that every shard has the same size (else every example
            once, shards differing by at most one).

    Raises:
        ValueError: with ``drop_last=True``, a dataset smaller than ``num_shards`` (every
            host's epoch would be empty). ``TypeError``: a config value that is no integer
            (numpy integers are accepted; bools and floats are not).

    Raises:
        NoMeshError: a spec outside any mesh; else as ``torchshard.feed_read_config``.

    Example:
        >>> feed = {"num_shards": 2, "shard_index": 1}
        >>> sampler = torchshard.host_sampler(range(10), feed, shuffle=False)
        >>> list(sampler)
        [1, 3, 5, 7, 9]
        >>> list(torchshard.host_sampler(range(5), feed, shuffle=False, drop_last=False))
        [1, 3]
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
            "drop_last=False (every example once; with last_batch='pad' the short hosts are "
            "padded and masked)."
        )
    return HostSampler(dataset, num, index, shuffle=shuffle, seed=seed, drop_last=drop_last)
