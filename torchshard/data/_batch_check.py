"""Checks on a stream of host batches: same structure, shapes and dtypes in every batch, and
an indivisible batch turned into an error that says which dispatcher setting fixes it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torchshard._errors import IndivisibleError, ShardingError, TreeStructureError
from torchshard._index import NamedSharding
from torchshard._mesh import Mesh
from torchshard._partition import complete_partition_spec_tree, input_partition_spec
from torchshard._spec import PartitionSpec
from torchshard._tree import flatten, paths

_FIX_SHAPES = (
    "Every batch must have the same structure, shapes and dtypes (each new shape compiles a new "
    "XLA step). For a short last batch, pass drop_last=True to the DataLoader, or pad it with a "
    "dispatcher (torchshard.InputDispatcher)."
)


def _signature(leaf: Any) -> tuple[tuple[int, ...], str] | None:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return None  # not an array: host_to_global_array reports it
    return tuple(int(n) for n in shape), str(dtype).removeprefix("torch.")


def _show(sig: tuple[tuple[int, ...], str] | None) -> str:
    return "not an array" if sig is None else f"shape {sig[0]} and dtype {sig[1]}"


class BatchChecker:
    """Remembers the first batch's structure, shapes and dtypes and checks every later one.

    Example:
        >>> check = BatchChecker()
        >>> check({"x": np.zeros((8, 2))}, batch=0)
        >>> check({"x": np.zeros((6, 2))}, batch=1)
        Traceback (most recent call last):
        ...
        torchshard._errors.ShardingError: GlobalBatchLoader: batch 1: batch['x'] has shape ...
    """

    def __init__(self) -> None:
        self._ref: tuple[Any, list[Any], int, str] | None = None

    def __call__(self, tree: Any, *, batch: int, host: int | None = None) -> None:
        """Raises ``TreeStructureError``/``ShardingError`` naming the batch and the tree path."""
        leaves, treespec = flatten(tree)
        sigs = [_signature(x) for x in leaves]
        name = "batch" if host is None else f"host_batches[{host}]"
        if self._ref is None:
            self._ref = (treespec, sigs, batch, name)
            return
        ref_spec, ref_sigs, ref_batch, ref_name = self._ref
        if treespec != ref_spec:
            first = f"batch {ref_batch}" + ("" if ref_name == "batch" else f", {ref_name}")
            raise TreeStructureError(
                f"GlobalBatchLoader: batch {batch}: {name} has a different structure from the "
                f"first batch ({first}); expected {ref_spec}, got {treespec}. " + _FIX_SHAPES
            )
        for i, (sig, ref) in enumerate(zip(sigs, ref_sigs, strict=True)):
            if sig != ref:
                path = paths(treespec, name)[i]
                raise ShardingError(
                    f"GlobalBatchLoader: batch {batch}: {path} has {_show(sig)}, but in batch "
                    f"{ref_batch} it had {_show(ref)}. " + _FIX_SHAPES
                )


def _leaf_specs(mesh: Mesh, spec_tree: Any, tree: Any) -> list[PartitionSpec]:
    if spec_tree is None or isinstance(spec_tree, PartitionSpec):
        specs = [spec_tree] * len(flatten(tree)[0])
    elif not isinstance(spec_tree, (dict, list, tuple)):  # the FULL default
        specs = [input_partition_spec()] * len(flatten(tree)[0])
    else:
        specs = flatten(complete_partition_spec_tree(tree, spec_tree))[0]
    return [PartitionSpec() if s is None else s for s in specs]


def indivisible_error(
    error: IndivisibleError,
    *,
    mesh: Mesh,
    spec_tree: Any,
    host_batch: Any,
    batch: int,
    dispatcher: bool,
) -> IndivisibleError:
    """``error`` with the batch number and, when dim 0 (the batch) does not divide, the
    dispatcher setting that fixes it. Must run under ``mesh``."""
    prefix = f"GlobalBatchLoader: batch {batch}: {error}"
    try:
        fix = _batch_fix(mesh, spec_tree, host_batch, dispatcher)
    except ShardingError:  # a layout the hint cannot describe: the original error says enough
        fix = None
    return IndivisibleError(prefix if fix is None else f"{prefix}\n{fix}")


def _batch_fix(mesh: Mesh, spec_tree: Any, host_batch: Any, dispatcher: bool) -> str | None:
    """How to make dim 0 divide, for the first leaf whose dim 0 does not; else None."""
    leaves, treespec = flatten(host_batch)
    for leaf, spec, path in zip(
        leaves, _leaf_specs(mesh, spec_tree, host_batch), paths(treespec, "batch"), strict=True
    ):
        sig = _signature(leaf)
        if sig is None or not sig[0]:
            continue
        ndim = len(sig[0])
        sharding = NamedSharding(mesh, spec)
        shards = sharding.shard_counts(ndim)[0]
        feeds = sharding.process_index_and_count(0, ndim=ndim)[1]
        rows = sig[0][0] * feeds
        if rows % shards == 0:
            continue
        step = math.lcm(shards, feeds)
        physical = -(-rows // step) * step
        hosts = f"{sig[0][0]} per host x {feeds} host{'s' if feeds > 1 else ''}"
        if dispatcher:
            return (
                f"The dispatcher's physical batch has {rows} rows ({hosts}) at {path}, which do "
                f"not split over the {shards} shards of dim 0: set the dispatcher's "
                f"global_physical_batch_size to a multiple of {step} (e.g. {physical})."
            )
        return (
            f"The global batch has {rows} rows ({hosts}) at {path}, which do not split over "
            f"the {shards} shards of dim 0. Fix: pad every host's batch with "
            f"dispatcher=torchshard.InputDispatcher({rows}, global_physical_batch_size="
            f"{physical}) and drop the padding in the step with "
            "dispatcher.physical_to_logical_batch(batch); or make the per-host batch size a "
            f"multiple of {step // feeds}."
        )
    return None


def host_nbytes(trees: Sequence[Any]) -> int:
    """The bytes of every array leaf of ``trees``."""
    total = 0
    for tree in trees:
        for leaf in flatten(tree)[0]:
            n = getattr(leaf, "nbytes", None)
            if n is None and hasattr(leaf, "element_size"):
                n = leaf.numel() * leaf.element_size()
            total += int(n or 0)
    return total
