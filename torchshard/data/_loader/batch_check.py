"""Checks on a stream of host batches: same structure, shapes and dtypes in every batch; the
partition laying the hosts' physical blocks out along dim 0 as their dispatchers expect; and an
indivisible batch turned into an error that says which dispatcher setting fixes it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torchshard._core.errors import IndivisibleError, ShardingError, TreeStructureError
from torchshard._core.mesh import Mesh
from torchshard._core.partition import complete_partition_spec_tree, input_partition_spec
from torchshard._core.sharding import NamedSharding
from torchshard._core.spec import PartitionSpec
from torchshard._core.tree import flatten, paths
from torchshard._step.dispatch import PHYSICAL_TO_LOGICAL_DISPATCH_KEY

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
        torchshard.errors.ShardingError: GlobalBatchLoader: batch 1: batch['x'] has shape ...
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


def leaf_specs(mesh: Mesh, spec_tree: Any, tree: Any) -> list[PartitionSpec]:
    """Each leaf's spec (the default: dim 0 over every axis of the current mesh)."""
    if spec_tree is None or isinstance(spec_tree, PartitionSpec):
        specs = [spec_tree] * len(flatten(tree)[0])
    elif not isinstance(spec_tree, (dict, list, tuple)):  # the FULL default
        specs = [input_partition_spec()] * len(flatten(tree)[0])
    else:
        specs = flatten(complete_partition_spec_tree(tree, spec_tree))[0]
    return [PartitionSpec() if s is None else s for s in specs]


def _data_first(tree: Any, spec_tree: Any, mesh: Mesh, name: str) -> list[tuple[Any, Any, str]]:
    """(leaf, spec, path) of every leaf, the dispatch key last (errors name a data leaf)."""
    leaves, treespec = flatten(tree)
    rows = list(zip(leaves, leaf_specs(mesh, spec_tree, tree), paths(treespec, name), strict=True))
    return sorted(rows, key=lambda r: PHYSICAL_TO_LOGICAL_DISPATCH_KEY in r[2])


def check_dispatch_feeds(
    *,
    mesh: Mesh,
    spec_tree: Any,
    physical_batches: Sequence[Any],
    dispatchers: Sequence[Any],
    hosts: Sequence[int],
    explicit: bool,
    batch: int,
) -> None:
    """Raises ``ShardingError`` unless the partition lays the hosts' physical blocks out along
    dim 0 the way their dispatchers expect. Must run under ``mesh``.

    ``physical_batches[i]`` is host ``hosts[i]``'s batch after its ``dispatchers[i]``. An
    ``InputDispatcher`` (it has ``num_physical_feeds``) expects dim 0 of every leaf to hold one
    block per physical feed, ``num_physical_feeds`` in all (the dispatch key travels with its
    rows, so where each block lands does not matter). A ``SpmdInputDispatcher`` (it has
    ``logical_feed_index``/``num_logical_feeds`` only) read the shard of its own feed, so this
    host's block must land at that feed. Other dispatchers are not checked; nor are leaves
    whose layout is not process-uniform (the transfer reports those).
    """
    for h, tree, d in zip(hosts, physical_batches, dispatchers, strict=True):
        feeds = getattr(d, "num_physical_feeds", None)
        spmd = feeds is None and hasattr(d, "logical_feed_index")
        if feeds is None and not spmd:
            continue
        for leaf, spec, path in _data_first(tree, spec_tree, mesh, "batch"):
            sig = _signature(leaf)
            if sig is None or not sig[0]:
                continue
            try:
                index, count = NamedSharding(mesh, spec).process_index_and_count(
                    0, ndim=len(sig[0]), process_index=h
                )
            except ValueError:
                continue
            fix = (
                f" Omit partition= to use the dispatcher's partition_spec ({d.partition_spec!r}),"
                " or pass a partition that splits dim 0 over the hosts."
                if explicit
                else ""
            )
            if not spmd and count != feeds:
                if not explicit:
                    fix = (
                        f" Set the dispatcher's num_physical_feeds to {count} (one feed per "
                        "host; the default is process_count())."
                    )
                fp = d.feed_physical_batch_size
                raise ShardingError(
                    f"GlobalBatchLoader: batch {batch}: under partition {spec!r}, dim 0 of {path} "
                    f"holds {count} per-host block{'s' if count != 1 else ''}, but the "
                    f"dispatcher's physical batch is {feeds} blocks of {fp} rows "
                    f"(num_physical_feeds={feeds}), {feeds * fp} rows in all." + fix
                )
            expected = (d.logical_feed_index, d.num_logical_feeds)
            if spmd and (index, count) != expected:
                raise ShardingError(
                    f"GlobalBatchLoader: batch {batch}: partition {spec!r} puts host {h}'s block "
                    f"of {path} at feed {index} of {count} along dim 0, but its dispatcher "
                    f"({type(d).__name__}) read feed {expected[0]} of {expected[1]} "
                    "(feed_read_config()), so the global batch would be reordered. Build the "
                    "dispatcher under the same mesh as the loader and omit partition= (the "
                    "dispatcher's partition_spec is the default)."
                )


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
    """How to make dim 0 divide, for the first leaf whose dim 0 does not (the dispatch key
    last); else None."""
    for leaf, spec, path in _data_first(host_batch, spec_tree, mesh, "batch"):
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
