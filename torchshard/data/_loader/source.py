"""The DataLoader protocol of a ``GlobalBatchLoader``: its source's ``sampler``,
``batch_sampler`` and ``dataset``, and ``set_epoch`` forwarded to the source.

Training stacks find a loader's sampler through these attributes: Lightning calls
``set_epoch`` on ``loader.sampler`` and ``loader.batch_sampler`` each epoch, accelerate and
user loops call ``loader.set_epoch``. A loader that hid its source's sampler would repeat the
first epoch's order every epoch, silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def source_attribute(sources: Sequence[Any], name: str) -> Any:
    """The source's ``name`` (``None`` when it has none); with one source per host (the
    testing loader), a tuple of each source's."""
    values = tuple(getattr(s, name, None) for s in sources)
    return values[0] if len(values) == 1 else values


def _targets(source: Any) -> list[Any]:
    """What ``set_epoch`` reaches in ``source``: the source itself when it has ``set_epoch``
    (a torchtitan or HF loader, an iterable dataset), else its sampler and batch sampler (and
    the batch sampler's sampler) and its dataset (an HF ``IterableDataset``, whose shuffle
    buffer and shard order are seeded by the epoch; it shares the epoch with persistent
    workers itself), each once."""
    if callable(getattr(source, "set_epoch", None)):
        return [source]
    found: list[Any] = []
    batch_sampler = getattr(source, "batch_sampler", None)
    for candidate in (
        getattr(source, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(source, "dataset", None),
    ):
        if callable(getattr(candidate, "set_epoch", None)) and all(
            candidate is not f for f in found
        ):
            found.append(candidate)
    return found


def forward_set_epoch(sources: Sequence[Any], epoch: Any) -> None:
    """Calls ``set_epoch(epoch)`` on what every source has for it; raises when a source has
    nothing (its order cannot change per epoch: calling ``set_epoch`` on it would be a silent
    no-op)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise TypeError(f"set_epoch: epoch must be an int >= 0, but got {epoch!r}.")
    plans = []
    for h, source in enumerate(sources):
        targets = _targets(source)
        if not targets:
            where = "the source" if len(sources) == 1 else f"source {h}"
            raise TypeError(
                f"GlobalBatchLoader.set_epoch({epoch}): {where} ({type(source).__name__}) has "
                "no set_epoch, and neither has its sampler, batch_sampler or dataset, so its "
                "order cannot change per epoch. Read the source through a sampler with "
                "set_epoch (torchshard.host_sampler(dataset, P(...)) or a DistributedSampler), "
                "or a dataset with set_epoch (an HF IterableDataset), or set the epoch on the "
                "source yourself."
            )
        plans.append(targets)
    for targets in plans:
        for t in targets:
            t.set_epoch(epoch)
