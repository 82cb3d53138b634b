"""torchshard in accelerate: ``prepare(accelerator, *objects)``.

accelerate's ``Accelerator.prepare`` passes a ``GlobalBatchLoader`` through untouched (right:
it yields this process's batches already), but it re-shards every ``DataLoader`` it is given:
a ``DataLoader`` that already reads this process's shard (``torchshard.host_sampler``, a
``DistributedSampler``) then gives each rank only part of its shard, silently. Pass the
torchshard loader, not the ``DataLoader`` inside it; ``prepare`` checks that. A ``DataLoader``
over a stream (``IterableDataset``) on several processes is refused too: accelerate either has
process 0 read the stream and hand its batches out (``dispatch_batches``, its default for
streams) or has every process read it and keep every n-th batch, both right only for a stream
that every process reads whole, and a stream split per process (``torchshard.stream_shard``,
datasets' ``split_dataset_by_node``) cannot be told from one before it is read.

accelerate is imported on first use.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from torchshard._core.optional import require
from torchshard.data._loader.loader import GlobalBatchLoader


def _already_sharded(loader: DataLoader[Any]) -> DistributedSampler[Any] | None:
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler) and sampler.num_replicas > 1:
            return sampler
    return None


def prepare(accelerator: Any, /, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)``, refusing a ``DataLoader`` whose sampler already
    splits the data over processes (a ``DistributedSampler`` of more than one replica, such as
    ``torchshard.host_sampler``'s) or, on several processes, one over a stream
    (``IterableDataset``: accelerate would read a stream split by ``torchshard.stream_shard``
    as if it were whole, losing the other processes' examples), and checking that every
    ``GlobalBatchLoader`` comes back unchanged.

    Returns what ``accelerator.prepare`` returns (one object, or a tuple).

    Raises:
        MissingDependencyError: accelerate is not installed.
        TypeError: ``accelerator`` is not an ``accelerate.Accelerator``.
        ValueError: an already sharded ``DataLoader`` (naming its position and shard), a
            ``DataLoader`` over a stream on several processes (wrap it in a
            ``GlobalBatchLoader``; a whole stream goes to ``accelerator.prepare`` itself), or a
            ``GlobalBatchLoader`` that ``prepare`` replaced.

    Example::

        loader = torchshard.GlobalBatchLoader(DataLoader(data, sampler=host_sampler(...)),
                                              partition=P("dp"), local=True)
        model, opt, loader = torchshard.integrations.accelerate.prepare(
            accelerator, model, opt, loader)
    """
    accelerate = require("accelerate", "torchshard.integrations.accelerate", extra="stacks")
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(
            f"prepare: expected an accelerate.Accelerator, but got {type(accelerator).__name__}."
        )
    for i, obj in enumerate(objects):
        if isinstance(obj, DataLoader):
            sampler = _already_sharded(obj)
            if sampler is not None:
                raise ValueError(
                    f"prepare: objects[{i}] is a DataLoader that already reads shard "
                    f"{sampler.rank} of {sampler.num_replicas} (its sampler is a "
                    "DistributedSampler, e.g. torchshard.host_sampler's); accelerate would "
                    "shard it again, so each process would see only part of its shard. Pass "
                    "the torchshard.GlobalBatchLoader that wraps it instead (accelerate passes "
                    "it through), or a DataLoader over the whole dataset."
                )
            processes = int(getattr(accelerator, "num_processes", 1))
            if isinstance(obj.dataset, IterableDataset) and processes > 1:
                raise ValueError(
                    f"prepare: objects[{i}] is a DataLoader over a stream "
                    f"({type(obj.dataset).__name__}, an IterableDataset) on {processes} "
                    "processes; accelerate would have process 0 read it and hand its batches to "
                    "every process (dispatch_batches, its default for streams), or have every "
                    "process read it and keep every "
                    f"{processes}-th batch, which is right only for a stream every process "
                    "reads whole: one split per process (torchshard.stream_shard, datasets' "
                    "split_dataset_by_node) would lose the other processes' examples, and "
                    "nothing tells the two apart before they are read. Wrap a split stream in "
                    "torchshard.GlobalBatchLoader (accelerate passes it through, and every "
                    "process reads its own shard once); give a whole stream to "
                    "accelerator.prepare itself."
                )
    prepared = accelerator.prepare(*objects)
    out = prepared if isinstance(prepared, tuple) else (prepared,)
    for i, (given, got) in enumerate(zip(objects, out, strict=True)):
        if isinstance(given, GlobalBatchLoader) and got is not given:
            raise ValueError(
                f"prepare: accelerate replaced the GlobalBatchLoader at objects[{i}] by a "
                f"{type(got).__name__}; this accelerate release no longer passes it through, "
                "so use the loader itself rather than what prepare returned for it."
            )
    return prepared
