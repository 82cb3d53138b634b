"""How many batches an epoch of a ``GlobalBatchLoader`` yields: ``len(loader)``.

Each source tells its batches (its ``len()``) and, where it can, its *whole* batches, those
before its first short one: a ``DataLoader`` from its ``batch_size``, ``drop_last`` and its
sampler's (or stream's) length; a list of batches from the batches themselves (``count``). The
``last_batch`` policy decides from every source of every process (``epoch_length``):

- ``"error"``: the sources' common length (the loop raises where the sources differ);
- ``"pad"``: the longest (every process runs until every source has ended);
- ``"drop"``: the fewest whole batches (every process stops at the first short or missing one).

On several processes each one's counts are needed: they are exchanged once per ``len()``, on
the calling thread, bounded like every exchange (``ProcessChecks.exchange(..., force=True)``),
so every process returns the same length, or raises the same error (``exchange``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch.utils.data

from torchshard._backend.protocols import ProcessChecks
from torchshard._core.context import thread_mesh
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.partition import feed_partition
from torchshard._core.tree import flatten
from torchshard._core.verdict import processes_text
from torchshard.data._loader.last_batch import LeafPath, batch_leaf, full_rows, specs_of

WHAT = "GlobalBatchLoader: len()"


@dataclasses.dataclass(frozen=True)
class Count:
    """One source's count: ``batches`` (its ``len()``), ``whole`` (the batches before its
    first short one), ``None`` where not known, and ``why`` not (the first unknown's reason,
    said of the source, whose type is ``kind``)."""

    batches: int | None
    whole: int | None
    why: str = ""
    kind: str = ""

    def item(self) -> str:
        """The count as one item of the exchange."""
        return json.dumps([self.batches, self.whole, self.why, self.kind])

    @classmethod
    def parse(cls, item: str) -> Count:
        batches, whole, why, kind = json.loads(item)
        return cls(batches, whole, why, kind)


def _length(x: Any) -> int | None:
    try:
        return len(x)
    except (TypeError, NotImplementedError):  # no len(), or an IterableDataset's own refusal
        return None


def _examples(source: Any) -> tuple[int | None, str]:
    """The examples a ``DataLoader``-like source batches in an epoch, or why not known."""
    dataset = getattr(source, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        workers = getattr(source, "num_workers", 0)
        if isinstance(workers, int) and workers > 1:
            return None, (
                f"reads a stream with {workers} worker processes, each of which may end on a "
                "short batch of its own"
            )
        n = _length(dataset)
        stream = type(dataset).__name__
        return n, "" if n is not None else f"reads a stream ({stream}) without len()"
    sampler = getattr(source, "sampler", None)
    n = _length(sampler) if sampler is not None else None
    return n, "" if n is not None else "has no sampler with a len()"


def batch_rows(
    mesh: Mesh | None, partition: Any, dispatcher: Any, named: LeafPath | None
) -> Callable[[Any], int | None]:
    """A batch's rows, counted on the leaf that carries the batch dimension as the epoch's
    producer counts them (``batch_leaf``: ``named``, else the first leaf whose dim 0 the
    partition splits on ``mesh``, if known; found in the first batch, as the producer does);
    ``None`` for a batch without one."""
    found: list[int] = []

    def rows(batch: Any) -> int | None:
        if not found:
            specs = None
            if mesh is not None and named is None:
                with thread_mesh(mesh):
                    specs = specs_of(mesh, feed_partition(partition, dispatcher), batch)
            try:
                found.append(batch_leaf(batch, named=named, specs=specs, name="batch")[0])
            except ShardingError:
                return None
        leaves = flatten(batch)[0]
        shape = getattr(leaves[found[0]], "shape", None) if found[0] < len(leaves) else None
        return int(shape[0]) if shape is not None and len(shape) else None

    return rows


def whole_size(sources: Sequence[Any], rows: Callable[[Any], int | None]) -> int | None:
    """The rows of a whole batch of a process's ``sources``, as its producer takes them: the
    largest of their ``batch_size``s and their first batches (lists only: nothing is read)."""
    sizes = [full_rows(s) for s in sources]
    sizes += [rows(s[0]) for s in sources if isinstance(s, (list, tuple)) and len(s)]
    known = [n for n in sizes if n is not None]
    return max(known) if known else None


def count(
    source: Any,
    rows: Callable[[Any], int | None],
    *,
    need_whole: bool = True,
    size: int | None = None,
) -> Count:
    """``source``'s count; ``rows(batch)``: a batch's rows (of the leaf that carries the batch
    dimension), for a list of batches, whose whole batches (those before the first of fewer
    than ``size`` rows, default its first batch's) are counted from the batches; whole batches
    only when ``need_whole`` (``last_batch="drop"``)."""
    kind = type(source).__name__
    batches = _length(source)
    if batches is None:
        return Count(None, None, "has no len()", kind)
    if not need_whole:
        return Count(batches, None, "", kind)
    if isinstance(source, (list, tuple)):
        whole = 0
        for batch in source:
            n = rows(batch)
            if n is None:
                return Count(batches, None, f"has no batch dimension in batch {whole}", kind)
            size = n if size is None else size
            if n < size:
                break
            whole += 1
        return Count(batches, whole, "", kind)
    size = full_rows(source)
    if size is None:
        why = "has no batch_size to tell a short batch from a whole one"
        return Count(batches, None, why, kind)
    if getattr(source, "drop_last", False) is True:
        return Count(batches, batches, "", kind)
    examples, why = _examples(source)
    if examples is None:
        return Count(batches, None, why, kind)
    return Count(batches, min(batches, examples // size), "", kind)


def exchange(
    checks: ProcessChecks, mesh: Mesh, counts: Sequence[Count]
) -> tuple[list[list[Count]], list[str]]:
    """The processes' distinct ``counts`` (one bounded exchange, on the calling thread), and
    the processes that passed each (``"process 3"``, ``"processes 0-2, 4"``)."""
    mine = [c.item() for c in counts]
    verdict = checks.exchange(mesh, mine, what=WHAT, force=True)
    if verdict is None or verdict.agreed:  # every process has the same counts
        return [list(counts)], ["every process"]
    every = [[Count.parse(item) for item in g.items] for g in verdict.groups]
    names = [processes_text(g.ranks) for g in verdict.groups]
    return every, names


def epoch_length(
    policy: str, every: Sequence[Sequence[Count]], *, where: Callable[[int, int], str]
) -> int:
    """The batches an epoch yields under ``policy`` when process ``p``'s sources have the
    counts ``every[p]``. ``where(p, h)`` names a source in the errors: ``TypeError`` for a
    length that cannot be known (as ``len()`` of an object without one), ``ValueError`` for
    ``"error"`` sources of different lengths."""
    flat = [(p, h, c) for p, counts in enumerate(every) for h, c in enumerate(counts)]
    unknown = [(p, h, c) for p, h, c in flat if c.batches is None]
    if unknown:
        p, h, c = unknown[0]
        raise TypeError(
            f"len(GlobalBatchLoader): {where(p, h)} ({c.kind}) {c.why}, so the epoch's length "
            "is not known; iterate without len() (Lightning: an iterable without a length, "
            "sized by max_steps), or give the source a len()."
        )
    batches = [c.batches for _, _, c in flat if c.batches is not None]
    if policy == "pad":
        return max(batches, default=0)
    if policy == "drop":
        unknown = [(p, h, c) for p, h, c in flat if c.whole is None]
        if unknown:
            p, h, c = unknown[0]
            raise TypeError(
                f"len(GlobalBatchLoader(last_batch='drop')): every process stops at the first "
                f"short batch of any source, but {where(p, h)} ({c.kind}) {c.why}, so where "
                "that is is not known before the epoch. Give the source a batch_size (a "
                "DataLoader's; drop_last=True makes every batch whole), or iterate without len()."
            )
        return min(c.whole for _, _, c in flat if c.whole is not None)
    if len(set(batches)) > 1:
        seen = ", ".join(f"{where(p, h)}: {c.batches}" for p, h, c in flat)
        raise ValueError(
            f"len(GlobalBatchLoader(last_batch='error')): the sources yield different numbers "
            f"of batches ({seen}), and the loop raises at the first batch where they differ. "
            "Give every source the same number of batches (torchshard.host_sampler with "
            "drop_last=True), or pass last_batch='pad' (every process runs to the longest, "
            "padding with masked rows) or last_batch='drop' (every process stops at the "
            "shortest)."
        )
    return batches[0] if batches else 0
