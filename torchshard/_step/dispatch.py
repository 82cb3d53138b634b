"""In-step dispatch from a physical (padded) batch to the logical batch: ``dispatch_input_batch``
and the machinery ``InputDispatcher.physical_to_logical_batch`` shares with it.

A dict holding ``PHYSICAL_TO_LOGICAL_DISPATCH_KEY`` says which physical rows of its other leaves
form the logical batch. The key is turned into gather indices ``p(l)`` inside the step and every
other leaf of that dict becomes ``x.index_select(0, p)``: ``out[l] = x[p(l)]``. That moves
``L`` rows, where axlearn's ``einsum("p...,pl->l...")`` multiplies by a ``P x L`` one-hot matrix.
The key's backend gives the key's whole value for the index maths (``InStep.full_local``:
torch_xla traces it; DTensor, which has no ``argmax`` rule and refuses plain tensors next to
DTensors, all-gathers the small key) and each leaf's backend does the gather
(``InStep.take_rows``), so this module works alike on both. Row targets first go to the leaf's
backend as they are (``InStep.move_rows``: torch_xla scatters each device's rows to their
targets and reduce-scatters, with no indices at all); a backend without that route gathers.
Both primitives move bits, not float values.

Key forms (``P``: physical rows, ``L``: logical rows):

- one-hot ``[P, L]`` (bool, integer or float; axlearn's form): ``p(l)`` is the row of the
  nonzero entry of column ``l`` (an ``argmax`` over dim 0).
- gather indices ``[L]`` (integer): ``p(l)`` itself.
- row targets ``[P]`` (integer; ``InputDispatcher``'s form, only through its
  ``physical_to_logical_batch``): entry ``p`` is the logical index of physical row ``p``, or
  ``-1`` for padding. Every row carries its own target, so the key is sharded like the data and
  does not depend on where each host's block lands in the global batch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any, cast

import torch

from torchshard._backend.protocols import InStep
from torchshard._backend.registry import lookup
from torchshard._core.context import current_mesh
from torchshard._core.deprecation import warn_once
from torchshard._core.errors import ShardingError, at
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import dim_axes
from torchshard._core.spec import PartitionSpec
from torchshard._core.tree import LazyPaths, flatten, unflatten
from torchshard._step.constraint import maybe_shard

PHYSICAL_TO_LOGICAL_DISPATCH_KEY = "__physical_to_logical_batch_dispatch"
"""The key of a dict's dispatch tensor (axlearn's name and value; axlearn compatibility)."""
_KEY = PHYSICAL_TO_LOGICAL_DISPATCH_KEY


@dataclasses.dataclass(frozen=True)
class RowTargets:
    """A row-target key ``[P]`` as the step got it (a global tensor) and the logical batch
    size: backends that move rows by their targets take it as it is (``InStep.move_rows``),
    the others gather by the indices made from its whole value (``whole``, when a check has
    already read it)."""

    key: torch.Tensor
    logical: int
    whole: torch.Tensor | None = None

    def indices(self) -> torch.Tensor:
        """The gather indices ``[logical]`` (in step)."""
        whole = whole_key(self.key) if self.whole is None else self.whole
        return row_targets_to_indices(whole, self.logical)


# (key as the step got it, where of the key, number of physical rows of the dict's leaves)
# -> gather indices, or row targets for the leaves' backends to move.
ToIndices = Callable[[torch.Tensor, str, int], "torch.Tensor | RowTargets"]


def whole_key(key: torch.Tensor) -> torch.Tensor:
    """The key's whole value for the index maths (torch_xla: the key itself, traced; DTensor:
    a plain tensor, the same on every rank)."""
    return lookup(key).step.full_local(key)


def holds_key(x: Any) -> bool:
    """Whether ``x`` is a dict holding the dispatch key."""
    return isinstance(x, dict) and _KEY in x


def key_path(where: str) -> str:
    """The path of the dispatch key inside the dict at ``where``."""
    return f"{where}[{_KEY!r}]"


def dispatch_dicts(
    tree: Any,
    *,
    argname: str,
    to_indices: ToIndices,
    out_spec: PartitionSpec | None,
) -> tuple[Any, int]:
    """``tree`` with every dict holding the key replaced by its dispatched copy (new
    containers throughout; ``tree`` is not modified), and the number of such dicts."""
    leaves, treespec = flatten(tree, is_leaf=holds_key)
    where = LazyPaths(treespec, argname)
    out = []
    for i, leaf in enumerate(leaves):
        if holds_key(leaf):
            out.append(_dispatch_dict(leaf, where[i], to_indices, out_spec))
        else:
            out.append(leaf)
    return unflatten(treespec, out), sum(holds_key(x) for x in leaves)


def _dispatch_dict(
    data: dict,
    where: str,
    to_indices: ToIndices,
    out_spec: PartitionSpec | None,
) -> dict:
    rest = copy.copy(data)  # keeps the dict's type; the caller's dict keeps its key
    key = rest.pop(_KEY)
    if not isinstance(key, torch.Tensor):
        raise TypeError(
            at(
                key_path(where),
                f"expected the dispatch tensor (a torch.Tensor), but got {type(key).__name__}.",
            )
        )
    leaves, treespec = flatten(rest, is_leaf=holds_key)
    paths = LazyPaths(treespec, where)
    physical = None
    for i, leaf in enumerate(leaves):
        if holds_key(leaf):
            raise ShardingError(
                at(
                    paths[i],
                    f"this dict holds the dispatch key, and so does the dict around it "
                    f"({where}), whose dispatch would apply to the inner key as to any leaf. Keep "
                    "one dispatch key per subtree.",
                )
            )
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            found = (
                f"shape {tuple(leaf.shape)}"
                if isinstance(leaf, torch.Tensor)
                else type(leaf).__name__
            )
            raise ShardingError(
                at(
                    paths[i],
                    f"dispatch selects rows along dim 0, so every leaf beside the "
                    f"dispatch key must be a tensor of rank >= 1; got {found}.",
                )
            )
        if physical is None:
            physical, first = leaf.shape[0], i
        elif leaf.shape[0] != physical:
            raise ShardingError(
                at(
                    paths[i],
                    f"every leaf beside a dispatch key is a batch of the same physical "
                    f"rows; expected dim 0 of size {physical} (as {paths[first]}), got "
                    f"{leaf.shape[0]} (shape {tuple(leaf.shape)}).",
                )
            )
    if physical is None:
        return rest
    rows = to_indices(key, key_path(where), physical)
    index = rows if isinstance(rows, torch.Tensor) else None
    logical = rows.logical if isinstance(rows, RowTargets) else int(rows.shape[0])
    mesh = current_mesh() if out_spec is not None else None
    out = []
    for leaf in leaves:
        step = lookup(leaf).step
        spec, axes = _logical_split(step, mesh, out_spec, logical)
        selected = None
        if isinstance(rows, RowTargets) and mesh is not None and axes:
            selected = step.move_rows(leaf, rows.key, logical, mesh, axes)
        if selected is None:
            if index is None:
                index = cast(RowTargets, rows).indices()
            selected = step.take_rows(leaf, index)
        out.append(maybe_shard(selected, spec))
    return unflatten(treespec, out)


def _logical_split(
    step: InStep, mesh: Mesh | None, out_spec: PartitionSpec | None, logical: int
) -> tuple[PartitionSpec | None, tuple[str, ...]]:
    """The spec the logical rows are constrained to, and the mesh axes that split their dim 0
    (``()``: none, or not known here: ``maybe_shard`` judges the spec).

    ``out_spec`` itself, except where its axes do not divide the logical rows and the backend
    cannot split them unevenly (torch_xla 2.9 returns such a result replicated, resharded
    through a sum that loses -0.0, NaN payloads and subnormals): there the rows are asked for
    replicated, ``P()``, which moves them as bits and says what the step gets."""
    if out_spec is None or mesh is None or mesh.size == 1 or len(out_spec) == 0:
        return out_spec, ()
    try:
        axes = dim_axes(mesh, out_spec)
    except ShardingError:  # maybe_shard leaves such a spec alone (and logs why)
        return out_spec, ()
    if any(axes[1:]):
        return out_spec, ()
    split = math.prod(mesh.shape[a] for a in axes[0])
    if logical % split and not step.splits_unevenly:
        return PartitionSpec(), ()
    return out_spec, axes[0]


def onehot_to_indices(key: torch.Tensor, where: str, physical: int, check: bool) -> torch.Tensor:
    """Gather indices from a one-hot ``[physical, logical]`` matrix (in step)."""
    if key.dtype.is_complex:
        raise TypeError(
            at(where, f"a one-hot dispatch matrix must be bool, integer or float; got {key.dtype}.")
        )
    if key.shape[0] != physical:
        raise ShardingError(
            at(
                where,
                f"a one-hot dispatch matrix has one row per physical example; expected "
                f"shape ({physical}, logical), got {tuple(key.shape)}.",
            )
        )
    nonzero = key != 0
    if check:
        _check_onehot(key, nonzero, where)
    return nonzero.to(torch.int32).argmax(dim=0)


def _check_onehot(key: torch.Tensor, nonzero: torch.Tensor, where: str) -> None:
    # Reads back (a sync) the column sums and whether every entry is 0 or 1.
    counts = nonzero.to(torch.int32).sum(dim=0).cpu()
    binary = bool(((key == 0) | (key == 1)).all().cpu())
    bad = [int(c) for c in torch.nonzero(counts != 1).reshape(-1)]
    if bad or not binary:
        shown = bad[:8]
        detail = (
            f"columns {shown}{' ...' if len(bad) > 8 else ''} have "
            f"{[int(counts[c]) for c in shown]} nonzero entries"
            if bad
            else "some entries are neither 0 nor 1"
        )
        raise ShardingError(
            at(
                where,
                f"every column of a dispatch matrix must be one-hot (exactly one 1, the "
                f"rest 0); expected one nonzero entry per column, but {detail}.",
            )
        )


def check_indices(index: torch.Tensor, physical: int, where: str) -> None:
    """Raises unless every gather index is in ``[0, physical)`` (a sync)."""
    if index.numel() == 0:
        return
    lo, hi = int(index.min().cpu()), int(index.max().cpu())
    if lo < 0 or hi >= physical:
        raise ShardingError(
            at(
                where,
                f"dispatch indices must be physical row numbers in [0, {physical}); "
                f"got values in [{lo}, {hi}].",
            )
        )


def check_row_targets(targets: torch.Tensor, logical: int, where: str) -> None:
    """Raises unless the row targets ``[physical]`` (a whole value) name every logical index
    in ``[0, logical)`` exactly once, ``-1`` marking padding (a sync)."""
    targets = targets.to(torch.int64)
    slots = torch.where(targets >= 0, targets, torch.full_like(targets, logical))
    bad = (targets < -1) | (targets >= logical)
    counts = torch.zeros(logical + 1, dtype=torch.int64, device=targets.device).scatter_add(
        0, torch.where(bad, torch.full_like(slots, logical), slots), torch.ones_like(slots)
    )
    counts, n_bad = counts[:logical].cpu(), int(bad.sum().cpu())
    wrong = [int(i) for i in torch.nonzero(counts != 1).reshape(-1)]
    if n_bad or wrong:
        twice = [i for i in wrong if counts[i] > 1]
        hint = ""
        if twice:
            at_rows = torch.nonzero(targets.cpu() == twice[0]).reshape(-1).tolist()
            hint = (
                f" Logical index {twice[0]} is at physical rows {at_rows[:8]}: the feeds whose "
                "blocks hold those rows claim the same logical rows, as two hosts whose "
                "InputDispatchers have the same physical_feed_index do. Give each host its "
                "own physical_feed_index in [0, num_physical_feeds) (the default, "
                "process_index(), does)."
            )
        raise ShardingError(
            at(
                where,
                f"row targets must name every logical index in [0, {logical}) exactly "
                f"once (-1 for padding); {n_bad} targets are out of range and logical indices "
                f"{wrong[:8]}{' ...' if len(wrong) > 8 else ''} appear "
                f"{[int(counts[i]) for i in wrong[:8]]} times.{hint}",
            )
        )


def row_targets_to_indices(targets: torch.Tensor, logical: int) -> torch.Tensor:
    """Gather indices ``[logical]`` from row targets ``[physical]`` (a whole value; in step).

    Row ``p`` holds logical example ``targets[p]`` (``-1``: padding), so ``index[targets[p]] =
    p``: one scatter of the row numbers into ``logical + 1`` slots, padding into the last one.
    """
    targets = targets.to(torch.int64)
    rows = torch.arange(targets.shape[0], dtype=torch.int64, device=targets.device)
    slots = torch.where(targets >= 0, targets, torch.full_like(targets, logical))
    index = torch.zeros(logical + 1, dtype=torch.int64, device=targets.device)
    return index.scatter(0, slots, rows)[:logical]


def key_to_indices(check: bool) -> ToIndices:
    """``dispatch_input_batch``'s key forms: one-hot ``[P, L]`` or gather indices ``[L]``."""

    def convert(key: torch.Tensor, where: str, physical: int) -> torch.Tensor:
        key = whole_key(key)
        if key.dim() == 2:
            return onehot_to_indices(key, where, physical, check)
        if key.dim() == 1:
            if key.dtype.is_floating_point or key.dtype.is_complex or key.dtype == torch.bool:
                raise TypeError(
                    at(
                        where,
                        f"a 1-D dispatch tensor holds gather indices [logical] and must "
                        f"have an integer dtype; got {key.dtype}.",
                    )
                )
            if check:
                check_indices(key, physical, where)
            return key
        raise ShardingError(
            at(
                where,
                f"expected a one-hot matrix [physical, logical] (rank 2) or gather indices "
                f"[logical] (rank 1), but got shape {tuple(key.shape)}.",
            )
        )

    return convert


def dispatch_input_batch(
    input_batch: Any,
    /,
    *,
    batch_axis_names: str | tuple[str, ...] | list[str] = "data",
    check: bool = False,
) -> Any:
    """Constrains every leaf on the batch axes, then drops the padding rows of every dict that
    holds ``PHYSICAL_TO_LOGICAL_DISPATCH_KEY`` (in step). axlearn compatibility.

    Deprecated, as in axlearn (a ``DeprecationWarning`` once): prefer ``InputDispatcher``,
    whose ``physical_to_logical_batch`` does the same with a key that moves 8 bytes per row.

    Each dict (at any depth) holding the key is copied without it, and each of its other leaves
    ``x`` becomes ``out[l] = x[p(l)]`` (a gather along dim 0), constrained to
    ``P(batch_axis_names)`` (on torch_xla ``P()`` where those axes do not divide the logical
    rows, as ``InputDispatcher.physical_to_logical_batch`` says, which also says how the rows
    move as bits). The key holds axlearn's one-hot ``[physical, logical]`` matrix or integer
    gather indices ``[logical]``; both give the same result. Without a mesh (or on one
    device) it works on plain tensors and only the constraints are skipped. ``input_batch`` is
    not modified.

    Args:
        input_batch: a tree of tensors whose dim 0 is the batch.
        batch_axis_names: the mesh axis (or axes, major first) that split the batch.
        check: verify that the key is one-hot (or that indices are in range). This syncs:
            the values are read back to the host.

    Returns:
        A new tree: the key is gone and its siblings hold the logical rows.

    Raises:
        ShardingError: (a ``ValueError``) naming the path: a key of the wrong shape, siblings
            whose dim 0 is not the key's physical size, a nested key, or (``check``) a column
            that is not one-hot. ``TypeError`` for a key of the wrong dtype.

    Example (without a mesh; 4 physical rows, of which rows 0 and 1 are the logical ones):
        >>> import warnings
        >>> key = torchshard.PHYSICAL_TO_LOGICAL_DISPATCH_KEY
        >>> batch = {"x": torch.arange(4), key: torch.tensor([[1, 0], [0, 1], [0, 0], [0, 0]])}
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)  # prefer InputDispatcher
        ...     torchshard.dispatch_input_batch(batch)
        {'x': tensor([0, 1])}
    """
    warn_once(
        "dispatch_input_batch",
        "dispatch_input_batch is deprecated; use torchshard.InputDispatcher "
        "(logical_to_physical_batch on the host, physical_to_logical_batch in the step).",
    )
    spec = PartitionSpec(
        batch_axis_names if isinstance(batch_axis_names, str) else tuple(batch_axis_names)
    )
    constrained = maybe_shard(input_batch, spec)
    out, _ = dispatch_dicts(
        constrained,
        argname="input_batch",
        to_indices=key_to_indices(check),
        out_spec=spec,
    )
    return out
