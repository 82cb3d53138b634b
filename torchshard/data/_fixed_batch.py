"""A fixed global batch on any number of processes: ``fixed_global_batches``.

axlearn's ``ElasticSpmdInputDispatcher`` keeps a job's global batch when it continues on fewer
slices: the healthy ones read the lost ones' share, with padding. Here the global order of a
map-style dataset is cut into global batches of ``global_batch_size`` examples (``G``), the same
whatever the layout; feed ``i`` of ``F`` reads its part of each (``G // F`` examples, one more
for the first ``G % F`` feeds), padded to a block of ``b`` rows: ``r = ceil(G / S)`` rows per
shard of dim 0 (``S`` shards), ``b = r * S / F``. Under ``GlobalBatchLoader(...,
last_batch="pad")`` each step is one global batch: ``r * S`` rows, exactly ``G`` when ``S``
divides ``G`` (the step's shapes unchanged on any number of processes), else the padding rows
masked ``False``; the mask sums to ``G`` at every step.

The position is the epoch and the global batches consumed, the same on every process and
meaningful on any layout: a state saved on ``N`` processes resumes on ``M`` (an elastic source,
``data/_loader/elastic.py``), each example once, the global batch kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
import torch.utils.data

from torchshard._core.checks import positive_int
from torchshard._core.errors import ShardingError
from torchshard._core.feed import feed_read_config, resolve_mesh, resolve_spec
from torchshard._core.sharding import dim_axes
from torchshard._core.spec import PartitionSpec
from torchshard._mesh.mesh import Mesh

IDENTITY = ("global_batch_size", "num_examples", "seed", "shuffle")
KEYS = ("epoch", "step", *IDENTITY)


class FixedGlobalBatches:
    """This process's part of every global batch of ``global_batch_size`` examples (made by
    ``fixed_global_batches``): iterable (one epoch's global batches, or the rest of a resumed
    one), ``set_epoch``, ``state_dict``/``load_state_dict`` (the epoch and the global batches
    consumed: the same on every process, loadable on any layout) and the elastic members.
    ``batch_size`` is the block's rows (a short part is padded to it by the loader); ``feed``,
    ``num_feeds``, ``rows`` (this feed's real rows per step) and ``steps`` are attributes."""

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        feed: int,
        feeds: int,
        block: int,
        shuffle: bool,
        seed: int,
        collate: Callable[[list[Any]], Any],
    ) -> None:
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.feed, self.num_feeds = feed, feeds
        self.batch_size = block
        self.shuffle, self.seed, self.collate = shuffle, seed, collate
        base, extra = divmod(global_batch_size, feeds)
        self.rows = base + (1 if feed < extra else 0)
        self._start = feed * base + min(feed, extra)  # this feed's first row in a global batch
        self.num_examples = len(dataset)
        self.steps = self.num_examples // global_batch_size
        self.epoch = 0
        self._step = 0
        self._resumed = False

    def set_epoch(self, epoch: int) -> None:
        """The epoch's order (shuffled with ``seed + epoch``); the next ``iter()`` starts it."""
        self.epoch = int(epoch)

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng(self.seed + self.epoch).permutation(self.num_examples)

    def __iter__(self) -> Iterator[Any]:
        if not self._resumed:
            self._step = 0
        self._resumed = False
        return self._batches(self._step)

    def _batches(self, first: int) -> Iterator[Any]:
        order = self._order()
        g = self.global_batch_size
        for k in range(first, self.steps):
            lo = k * g + self._start
            rows = [self.dataset[int(i)] for i in order[lo : lo + self.rows]]
            self._step = k + 1  # the state a snapshot after this batch takes
            yield self.collate(rows)

    # -- the position ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "step", "global_batch_size", "num_examples", "seed", "shuffle"}``:
        global batches ``step`` of epoch ``epoch`` consumed; the same on every process."""
        return {
            "epoch": self.epoch,
            "step": self._step,
            "global_batch_size": self.global_batch_size,
            "num_examples": self.num_examples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The next ``iter()`` reads epoch ``epoch`` from global batch ``step`` on, on this
        layout (a state of any number of processes).

        Raises:
            ValueError: not such a state, or one of another global batch size, dataset size,
                seed or shuffling (its global batches are other examples).
        """
        where = "FixedGlobalBatches.load_state_dict: state_dict"
        if not isinstance(state_dict, dict) or set(state_dict) != set(KEYS):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"{where}: expected a dict with keys {sorted(KEYS)}, but got {got}.")
        mine = self.state_dict()
        differ = [k for k in IDENTITY if state_dict[k] != mine[k]]
        if differ:
            raise ValueError(
                f"{where}: saved with {', '.join(f'{k}={state_dict[k]!r}' for k in differ)}, but "
                f"this source has {', '.join(f'{k}={mine[k]!r}' for k in differ)}; its global "
                "batches hold other examples. Resume with the same dataset, global_batch_size, "
                "seed and shuffle (the processes may differ)."
            )
        for k in ("epoch", "step"):
            v = state_dict[k]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{where}[{k!r}]: expected an int >= 0, but got {v!r}.")
        if state_dict["step"] > self.steps:
            raise ValueError(
                f"{where}['step']: {state_dict['step']} global batches consumed, but an epoch "
                f"has {self.steps}; the state is corrupt or was edited."
            )
        self.epoch, self._step = state_dict["epoch"], state_dict["step"]
        self._resumed = True

    def elastic_part(self, state: dict[str, Any]) -> dict[str, Any]:
        return dict(state)

    @staticmethod
    def merge_elastic_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The job's position: every process's, which must be one (processes step together)."""
        distinct = {tuple(sorted(p.items())) for p in parts}
        if len(distinct) != 1:
            raise ValueError(
                f"FixedGlobalBatches: the processes saved different positions {parts[:4]}; "
                "save every process's state after the same step."
            )
        return dict(parts[0])

    def load_elastic_state(self, position: dict[str, Any]) -> None:
        self.load_state_dict(position)


def fixed_global_batches(
    dataset: Sized,
    global_batch_size: int,
    /,
    partition: Any = None,
    *,
    mesh: Mesh | None = None,
    shuffle: bool = True,
    seed: int = 0,
    collate: Callable[[list[Any]], Any] | None = None,
) -> FixedGlobalBatches:
    """This process's part of every global batch of ``global_batch_size`` examples, kept on
    any number of processes (elastic scale-down with a fixed global batch).

    Use it as the source of ``GlobalBatchLoader(source, partition=..., last_batch="pad")``:
    each step is one global batch of ``global_batch_size`` real examples (the mask's sum), its
    shape ``ceil(G / S) * S`` rows for ``S`` shards of dim 0 (``G`` itself when ``S`` divides
    it), whatever the number of processes. A state saved on ``N`` processes resumes on ``M``
    from the global batches consumed: each process then reads a larger block (``M < N``) and
    the examples of the epoch come once each.

    Args:
        dataset: a map-style dataset (``len()`` and ``dataset[i]``).
        global_batch_size: the examples of every global batch (``G``); the epoch has
            ``len(dataset) // G`` of them (the rest is dropped).
        partition: the batch's ``PartitionSpec`` (dim 0's split; default: dim 0 over every mesh
            axis): processes that hold one block read the same part.
        mesh: a ``torchshard.Mesh`` (default: the current mesh).
        shuffle: whether the epoch's order is shuffled (with ``seed + epoch``, ``set_epoch``).
        seed: the shuffle's seed.
        collate: a batch from a list of examples (default: ``default_collate``).

    Raises:
        ShardingError: fewer examples per global batch than feeds (a feed would read none).
        ValueError: ``global_batch_size`` not a positive int, or larger than the dataset.

    Example (one process, 8 devices; 10 examples in global batches of 4):
        >>> with torchshard.Mesh(np.arange(8), ("data",)):
        ...     source = torchshard.data.fixed_global_batches(range(10), 4, shuffle=False)
        >>> source.batch_size, [b.tolist() for b in source]
        (8, [[0, 1, 2, 3], [4, 5, 6, 7]])
    """
    g = positive_int(global_batch_size, "global_batch_size")
    if not isinstance(dataset, Sized):
        raise TypeError(
            f"fixed_global_batches: dataset: expected a map-style dataset with len(), but got "
            f"{type(dataset).__name__}."
        )
    if len(dataset) < g:
        raise ValueError(
            f"fixed_global_batches: global_batch_size {g} is larger than the dataset's "
            f"{len(dataset)} examples: an epoch would have no global batch."
        )
    m = resolve_mesh(mesh, "fixed_global_batches")
    spec = (
        PartitionSpec(tuple(m.axis_names))
        if partition is None
        else resolve_spec(partition, m, "fixed_global_batches")
    )
    feed = feed_read_config(spec, mesh=m)
    index, feeds = feed["shard_index"], feed["num_shards"]
    dim0 = PartitionSpec(spec[0]) if len(spec) else PartitionSpec()
    shards = math.prod(m.shape[a] for a in dim_axes(m, dim0, 1)[0])
    if g < feeds:
        raise ShardingError(
            f"fixed_global_batches: global_batch_size {g} over {feeds} feeds of {spec!r}: feed "
            f"{g} and later would read no example. Keep at least one example per feed (a global "
            "batch of at least the feed count)."
        )
    block = math.ceil(g / shards) * (shards // feeds)
    return FixedGlobalBatches(
        dataset,
        global_batch_size=g,
        feed=index,
        feeds=feeds,
        block=block,
        shuffle=bool(shuffle),
        seed=int(seed),
        collate=collate or torch.utils.data.default_collate,
    )
