"""``last_batch=``: what a ``GlobalBatchLoader`` does when its sources run out unevenly (the end
of data).

- ``"error"``: every process raises at the batch where the processes' sources disagree (a short
  batch, or one process's source ending first).
- ``"drop"``: every process stops at the first batch at which any process's source ends or is
  short; the examples read but not yielded are counted (``LoaderStats.dropped_examples``).
- ``"pad"``: every batch is ``(batch, mask)``; a short batch is padded with zero rows and a
  process whose source ended contributes zero rows, ``mask`` ``False`` there, until every
  process's source has ended: the same number of steps and the same shapes everywhere.

Here: the leaf whose dim 0 counts a batch's examples (``batch_leaf``: the one the user names,
else the first leaf whose dim 0 the partition splits), padding a host batch (``Template``), the
per-batch status a process tells the others (``rows_status``, with the rows of its whole batch;
``ENDED``, ``ENDED_EMPTY``), and the decision every process takes from all statuses
(``settle``). Deciding needs every process's status: the producer exchanges it at each
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
from torchshard._core.ranks import RankSet
from torchshard._core.spec import PartitionSpec
from torchshard._core.tree import flatten, paths, unflatten
from torchshard._core.verdict import Group, Verdict, processes_text
from torchshard.data._loader.batch_check import leaf_specs

LeafPath = tuple[Any, ...]

POLICIES = ("error", "drop", "pad")
ENDED = "ended"  # this process's sources have ended (at this batch or before)
ENDED_EMPTY = "ended empty"  # they ended before the first batch: nothing to pad with
_ROWS = "rows "
_WHOLE = "whole batch "  # the item that carries a process's whole batch size


def check_policy(last_batch: Any) -> str:
    if not isinstance(last_batch, str) or last_batch not in POLICIES:
        raise ValueError(
            f"last_batch must be one of {list(POLICIES)}, but got {last_batch!r}: 'error' "
            "raises where the processes' sources disagree, 'drop' stops every process at the "
            "first batch a source ends, 'pad' pads with masked rows until every source has ended."
        )
    return last_batch


def rows_status(rows: int, whole: int | None = None) -> str:
    """The status of a batch of ``rows`` real rows, of a whole batch's ``whole``."""
    return f"{_ROWS}{rows}" + ("" if whole is None else f" of {whole}")


def rows_of_status(status: str) -> int:
    return int(status[len(_ROWS) :].split(" ")[0]) if status.startswith(_ROWS) else 0


def _whole_of_status(status: str) -> int | None:
    """The whole batch size a status carries (``"rows 3 of 4"``, ``"ended of 4"``), if any."""
    parts = status.split(" of ") if status.startswith((_ROWS, ENDED)) else []
    return int(parts[1]) if len(parts) == 2 else None


def leaf_path(named: Any) -> LeafPath | None:
    """``batch_leaf=`` as a path of keys: a key (``"input_ids"``) or a tuple of keys and indices
    (``("inputs", "ids")``); ``None``: not named."""
    if named is None:
        return None
    if isinstance(named, tuple) and named:
        return named
    if isinstance(named, (str, int)) and not isinstance(named, bool):
        return (named,)
    raise TypeError(
        f"batch_leaf: expected the path of the leaf that carries the batch dimension, a key "
        f"(batch_leaf='input_ids') or a tuple of keys and indices (batch_leaf=('inputs', "
        f"'ids')), or None, but got {named!r} of type {type(named).__name__}."
    )


def _splits_dim0(spec: Any) -> bool:
    return isinstance(spec, PartitionSpec) and len(spec) > 0 and spec[0] is not None


def batch_leaf(
    tree: Any, *, named: LeafPath | None, specs: list[Any] | None, name: str
) -> tuple[int, str]:
    """``(index, path)`` of the leaf of ``tree`` whose dim 0 counts its examples: the one
    ``named`` (``leaf_path``), else the first with a dim 0 that its spec splits (``specs``: each
    leaf's, ``None``: not known), else the first with a dim 0. Raises ``ShardingError`` naming
    the leaves when there is none (or the named one is not there, or has no dim 0)."""
    leaves, treespec = flatten(tree)
    shown = paths(treespec, name)
    if named is not None:
        keys = [tuple(p) for p in treespec.paths()]
        if named not in keys:
            raise ShardingError(
                f"GlobalBatchLoader(batch_leaf={named if len(named) > 1 else named[0]!r}): "
                f"{name} has no leaf at that path; its leaves are {shown}. Name the leaf whose "
                "dim 0 holds the batch's examples (a key, or a tuple of keys for a nested one)."
            )
        i = keys.index(named)
        if _rows(leaves[i]) is None:
            raise ShardingError(
                f"GlobalBatchLoader(batch_leaf=...): {shown[i]} has no batch dimension (it is "
                f"{_kind(leaves[i])}); name a leaf whose dim 0 holds the batch's examples."
            )
        return i, shown[i]
    with_rows = [i for i, x in enumerate(leaves) if _rows(x) is not None]
    split = [i for i in with_rows if specs is None or _splits_dim0(specs[i])]
    chosen = split or with_rows
    if not chosen:
        kinds = ", ".join(f"{p}: {_kind(x)}" for p, x in zip(shown, leaves, strict=True))
        raise ShardingError(
            f"GlobalBatchLoader: {name} has no leaf with a batch dimension (dim 0) to count its "
            f"examples (needed by last_batch= and the position in the epoch); its leaves: "
            f"{kinds or 'none'}. Add one, or name it with batch_leaf=..."
        )
    return chosen[0], shown[chosen[0]]


def _kind(x: Any) -> str:
    shape = getattr(x, "shape", None)
    if shape is None:
        return f"a {type(x).__name__}"
    return f"of shape {tuple(int(n) for n in shape)}" if len(shape) else "0-d"


def full_rows(source: Any) -> int | None:
    """The rows of a whole batch of ``source``: its ``batch_size`` (a DataLoader's), if any."""
    size = getattr(source, "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _rows(x: Any) -> int | None:
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


class Template:
    """A host's whole batch, learnt from its first: the structure, and per leaf the shape (dim
    0 the batch's ``full`` rows where the leaf has the batch's rows), dtype and kind. The rows
    are counted on leaf ``index`` (default: ``batch_leaf``'s; its path: ``leaf``); ``specs``:
    each leaf's spec, if known (a leaf whose dim 0 is not split, a per-batch table, keeps its
    shape)."""

    def __init__(
        self,
        first: Any,
        full: int | None,
        *,
        name: str,
        index: int | None = None,
        specs: list[Any] | None = None,
    ) -> None:
        if index is None:
            index, _ = batch_leaf(first, named=None, specs=specs, name=name)
        leaves, self.treespec = flatten(first)
        rows = _rows(leaves[index])
        if rows is None:
            raise ShardingError(
                f"GlobalBatchLoader: {paths(self.treespec, name)[index]} has no batch dimension "
                f"(it is {_kind(leaves[index])}); name a leaf whose dim 0 holds the batch's "
                "examples with batch_leaf=..."
            )
        self.index = index
        self.leaf = paths(self.treespec, name)[index]
        self.rows = full if full is not None and full >= rows else rows
        self.shapes = []
        for i, x in enumerate(leaves):
            shape = tuple(int(n) for n in getattr(x, "shape", ()))
            batchy = specs is None or i == index or _splits_dim0(specs[i])
            if shape and shape[0] == rows and batchy:
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
        rows = _rows(leaves[self.index])
        if rows is None or rows >= self.rows:
            return None
        for x, shape in zip(leaves, self.shapes, strict=True):
            got = tuple(int(n) for n in getattr(x, "shape", ()))
            if got == shape:  # a leaf without the batch's rows (a table, a 0-d value)
                continue
            if not got or got[1:] != shape[1:] or got[0] != rows:
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


def mask_partition(mesh: Mesh, spec_tree: Any, batch: Any, keys: LeafPath | None = None) -> Any:
    """The mask's partition: dim 0 split like the batch's (that of its leaf at the path
    ``keys``, the one that carries the batch dimension, else its first leaf). Under the mesh."""
    if spec_tree is DEFAULT_PARTITION:
        return DEFAULT_PARTITION
    specs = leaf_specs(mesh, spec_tree, batch)
    found = [tuple(p) for p in flatten(batch)[1].paths()]
    spec = specs[found.index(keys)] if keys in found else specs[0]
    return PartitionSpec(spec[0]) if len(spec) else PartitionSpec()


def specs_of(mesh: Mesh, spec_tree: Any, batch: Any) -> list[Any] | None:
    """Each leaf's spec (``leaf_specs``), or ``None`` where the partition does not fit this
    (logical) batch: its placing reports that."""
    try:
        specs = leaf_specs(mesh, spec_tree, batch)
    except (ValueError, TypeError):  # ShardingError and TreeStructureError included
        return None
    return specs if len(specs) == len(flatten(batch)[0]) else None


def ended_status(whole: int | None) -> str:
    """The status of a process whose sources have all ended and that pads (``"pad"``): ended,
    with the rows of its whole batch (compared with the others')."""
    return ENDED if whole is None else f"{ENDED} of {whole}"


def _ended(status: str) -> bool:
    return status == ENDED or status.startswith(f"{ENDED} of ")


def status_counts(status: str) -> list[int]:
    """A process's status as the counts its exchange reduces: ``[real rows, ended, ended
    empty]`` (summed over the processes: the rows to count, how many ended, how many have
    nothing to pad with)."""
    return [
        rows_of_status(status),
        int(_ended(status) or status == ENDED_EMPTY),
        int(status == ENDED_EMPTY),
    ]


def status_items(status: str, made: bool) -> list[str]:
    """What a process's status adds to the items it compares: ``[ENDED_EMPTY]`` (named in the
    error), ``[ENDED]`` when it has no batch (``"drop"``), else the size of its whole batch when
    known (alike on every process, so it costs nothing to compare; a padded batch is compared
    as a batch)."""
    if status == ENDED_EMPTY:
        return [ENDED_EMPTY]
    if _ended(status) and not made:
        return [ENDED]
    whole = _whole_of_status(status)
    return [] if whole is None else [f"{_WHOLE}{whole}"]


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
    wholes: dict[str, RankSet] = {}
    for g in groups:
        w = next((i for i in g.items if i.startswith(_WHOLE)), None)
        if w is not None:
            wholes[w] = wholes[w] | g.ranks if w in wholes else g.ranks
    if len(wholes) > 1:
        seen = "; ".join(f"{w[len(_WHOLE) :]} on {processes_text(r)}" for w, r in wholes.items())
        raise ProcessDisagreementError(
            at(
                what,
                f"last_batch={policy!r} needs one size of a whole batch, but it has {seen}: "
                "each process takes its source's batch_size (a DataLoader's), else its first "
                "batch's rows, so a source whose first batch is short (or another batch size) "
                "cannot be told from a whole one. Give every process's source the same "
                "batch_size (a DataLoader's), or first batches of the whole size.",
            )
        )
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
