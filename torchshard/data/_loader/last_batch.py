"""``last_batch=``: what a ``GlobalBatchLoader`` does when its sources run out unevenly (the end
of data).

- ``"error"``: every process raises at the batch where the processes' sources disagree (a short
  batch, or one process's source ending first).
- ``"drop"``: every process stops at the first batch at which any process's source ends or is
  short; the examples read but not yielded are counted (``LoaderStats.dropped_examples``).
- ``"pad"``: every batch is ``(batch, mask)``; a short batch is padded with zero rows and a
  process whose source ended contributes zero rows, ``mask`` ``False`` there, until every
  process's source has ended: the same number of steps and the same shapes everywhere.

Here: padding a host batch (``Template``), the per-batch status a process tells the others
(``rows_status``, ``ENDED``, ``ENDED_EMPTY``), and the decision every process takes from all
statuses (``settle``). Deciding needs every process's status: the producer exchanges it at each
batch on the epoch's channel (``exchanges.py``; the DTensor backend's bounded exchange), also
with the agreement check off; under ``virtual_hosts`` the producer sees every host's source
itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchshard._core.agreement import END_OF_DATA, disagreement, outcome_disagreement
from torchshard._core.errors import ProcessDisagreementError, ShardingError, at
from torchshard._core.mesh import Mesh
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.spec import PartitionSpec
from torchshard._core.tree import flatten, paths, unflatten
from torchshard._core.verdict import Group, Verdict
from torchshard.data._loader.batch_check import leaf_specs

POLICIES = ("error", "drop", "pad")
ENDED = "ended"  # this process's sources have ended (at this batch or before)
ENDED_EMPTY = "ended empty"  # they ended before the first batch: nothing to pad with
_ROWS = "rows "


def check_policy(last_batch: Any) -> str:
    if not isinstance(last_batch, str) or last_batch not in POLICIES:
        raise ValueError(
            f"last_batch must be one of {list(POLICIES)}, but got {last_batch!r}: 'error' "
            "raises where the processes' sources disagree, 'drop' stops every process at the "
            "first batch a source ends, 'pad' pads with masked rows until every source has ended."
        )
    return last_batch


def rows_status(rows: int) -> str:
    return f"{_ROWS}{rows}"


def rows_of_status(status: str) -> int:
    return int(status[len(_ROWS) :]) if status.startswith(_ROWS) else 0


def full_rows(source: Any) -> int | None:
    """The rows of a whole batch of ``source``: its ``batch_size`` (a DataLoader's), if any."""
    size = getattr(source, "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _rows(x: Any) -> int | None:
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


class Template:
    """A host's whole batch, learnt from its first: the structure, and per leaf the shape (dim
    0 the batch's ``full`` rows where the leaf has the batch's rows), dtype and kind."""

    def __init__(self, first: Any, full: int | None, *, name: str) -> None:
        leaves, self.treespec = flatten(first)
        if not leaves or _rows(leaves[0]) is None:
            raise ShardingError(
                f"GlobalBatchLoader(last_batch=...): {name} needs a batch whose first leaf has a "
                "batch dimension (dim 0) to count and pad rows, but got "
                f"{type(leaves[0]).__name__ if leaves else 'no leaves'}."
            )
        rows = _rows(leaves[0])
        assert rows is not None
        self.rows = full if full is not None and full >= rows else rows
        self.shapes = []
        for x in leaves:
            shape = tuple(int(n) for n in getattr(x, "shape", ()))
            if shape and shape[0] == rows:
                shape = (self.rows, *shape[1:])
            self.shapes.append(shape)
        self.leaves = leaves
        self.name = name

    def short(self, tree: Any) -> int | None:
        """The real rows of ``tree`` when it is a short batch (fewer rows than a whole one,
        everything else alike), else ``None``."""
        leaves, treespec = flatten(tree)
        if treespec != self.treespec or not leaves:
            return None
        rows = _rows(leaves[0])
        if rows is None or rows >= self.rows:
            return None
        for x, shape in zip(leaves, self.shapes, strict=True):
            got = tuple(int(n) for n in getattr(x, "shape", ()))
            if not got or got[1:] != shape[1:] or not (got[0] == rows or got == shape):
                return None
        return rows

    def pad(self, tree: Any, rows: int) -> Any:
        """``tree`` (``rows`` real rows) padded with zero rows to a whole batch."""
        leaves, _ = flatten(tree)
        out = [
            _pad_leaf(x, shape[0]) if tuple(getattr(x, "shape", ())) != shape else x
            for x, shape in zip(leaves, self.shapes, strict=True)
        ]
        return unflatten(self.treespec, out)

    def padding(self) -> Any:
        """A batch of zero rows only (a host whose source has ended)."""
        return unflatten(
            self.treespec,
            [_zeros_like(x, s) for x, s in zip(self.leaves, self.shapes, strict=True)],
        )

    def mask(self, rows: int) -> np.ndarray:
        """The host's mask block: ``True`` for its ``rows`` real rows, which come first."""
        mask = np.zeros(self.rows, dtype=np.bool_)
        mask[:rows] = True
        return mask


def _zeros_like(x: Any, shape: tuple[int, ...]) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.zeros(shape, dtype=x.dtype)
    return np.zeros(shape, dtype=np.asarray(x).dtype)


def _pad_leaf(x: Any, rows: int) -> Any:
    have = int(x.shape[0])
    tail = _zeros_like(x, (rows - have, *tuple(x.shape[1:])))
    if isinstance(x, torch.Tensor):
        return torch.cat([x, tail])
    return np.concatenate([np.asarray(x), tail])


def leaf_paths(tree: Any, name: str) -> list[str]:
    return paths(flatten(tree)[1], name)


def mask_partition(mesh: Mesh, spec_tree: Any, batch: Any) -> Any:
    """The mask's partition: dim 0 split like the batch's (its first leaf's). Under the mesh."""
    if spec_tree is DEFAULT_PARTITION:
        return DEFAULT_PARTITION
    first = leaf_specs(mesh, spec_tree, batch)[0]
    return PartitionSpec(first[0]) if len(first) else PartitionSpec()


def status_counts(status: str) -> list[int]:
    """A process's status as the counts its exchange reduces: ``[real rows, ended, ended
    empty]`` (summed over the processes: the rows to count, how many ended, how many have
    nothing to pad with)."""
    return [
        rows_of_status(status),
        int(status in (ENDED, ENDED_EMPTY)),
        int(status == ENDED_EMPTY),
    ]


def status_items(status: str, made: bool) -> list[str]:
    """What a process's status adds to the items it compares: ``[ENDED_EMPTY]`` (named in the
    error), ``[ENDED]`` when it has no batch (``"drop"``), else nothing (a padded batch is
    compared as a batch)."""
    if status == ENDED_EMPTY:
        return [ENDED_EMPTY]
    if status == ENDED and not made:
        return [ENDED]
    return []


def settle(
    policy: str, verdict: Verdict, *, what: str, where: Callable[[int], str]
) -> tuple[bool, int]:
    """The processes' outcomes of one batch (``verdict``: their items, and ``status_counts``
    summed) -> ``(stop, real rows over the processes)``, the same on every process; raises
    ``ProcessDisagreementError`` (the same on every process) when the processes cannot go on
    together: a failure on one of them, batches that differ in structure, shapes or dtypes, or
    (``"pad"``) a process with nothing to pad with while others go on."""
    groups = verdict.groups
    if any(g.items and g.items[0].startswith("a failure") for g in groups):
        simple = [
            Group(
                g.ranks,
                g.items
                if g.items and g.items[0].startswith("a failure")
                else (END_OF_DATA,)
                if g.items and g.items[0] in (ENDED, ENDED_EMPTY)
                else ("structure (a batch)",),
            )
            for g in groups
        ]
        raise outcome_disagreement(what, simple, where)
    rows, ended, empty = (*verdict.sums, 0, 0, 0)[:3]
    if policy == "drop" and ended:
        return True, rows
    if ended == verdict.processes:
        return True, rows
    if empty:
        named = ", ".join(str(g.ranks) for g in groups if g.items[:1] == (ENDED_EMPTY,))
        raise ProcessDisagreementError(
            at(
                what,
                f"last_batch='pad' pads a process whose source has ended with zero rows shaped "
                f"like its first batch, but the source of process(es) [{named}] ended before "
                "its first batch, so there is nothing to pad with. Give every process at least "
                "one batch (fewer processes, or a smaller batch), or use last_batch='drop'.",
            )
        )
    if not verdict.agreed:
        raise disagreement(what, groups, where)
    return False, rows
