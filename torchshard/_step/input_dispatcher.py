"""``InputDispatcher``: per-feed logical batches (padded on the host) to the global
logical batch in the step (axlearn's ``input_dispatch``).

Data flow of ``InputDispatcher`` (``P``/``L``: global physical/logical batch, ``fp``/``fl``: per
feed)::

    host, per feed     logical_to_physical_batch: leaves [fl, ...] -> [fp, ...] (zero padded;
                       a padding feed is all zeros) + key [fp] int64: the logical index of each
                       row, -1 for padding
    host -> global     host_to_global_array(batch, partition=dispatcher.partition_spec):
                       leaves [P, ...] and key [P], split alike along dim 0
    in step            physical_to_logical_batch: gather indices from the key (one scatter of
                       P row numbers), then index_select: leaves [L, ...]

The key travels with its rows, so the result does not depend on where each feed's block lands
in the global batch (feed order, permuted meshes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchshard._core.checks import positive_int
from torchshard._core.context import current_mesh
from torchshard._core.errors import ShardingError, at
from torchshard._core.partition import input_partition_spec
from torchshard._core.spec import PartitionSpec
from torchshard._core.tensor_spec import TensorSpec
from torchshard._core.tree import LazyPaths, flatten, unflatten
from torchshard._mesh.context import current_topology
from torchshard._place.host_data import (
    MASKED_ARRAY,
    as_host_tensor,
    has_names,
    shape_dtype,
    unwrapped,
)
from torchshard._step.dispatch import (
    PHYSICAL_TO_LOGICAL_DISPATCH_KEY,
    RowTargets,
    ToIndices,
    check_row_targets,
    dispatch_dicts,
    key_path,
    onehot_to_indices,
    whole_key,
)

_KEY = PHYSICAL_TO_LOGICAL_DISPATCH_KEY


def _host_leaf(x: Any, where: str) -> None:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(
                at(
                    where,
                    f"logical_to_physical_batch runs on the host; expected a numpy array or "
                    f"a CPU tensor, but got a tensor on {x.device}.",
                )
            )
        unwrapped(x, where)  # raises for a tensor kept from inside vmap
        if x.layout is not torch.strided or has_names(x):
            as_host_tensor(x, where)  # raises: sparse and named tensors are not host arrays
    elif isinstance(x, np.ma.MaskedArray):
        raise TypeError(at(where, f"{MASKED_ARRAY}"))
    elif not isinstance(x, (np.ndarray, np.generic)):
        raise TypeError(
            at(where, f"expected a numpy array or a CPU torch.Tensor, but got {type(x).__name__}.")
        )


def _paddable(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return True  # every torch dtype is numeric or bool
    return np.dtype(dtype).kind in "biufc"


def _check_batch_dim(shape: tuple[int, ...], expected: int, where: str, what: str) -> None:
    if len(shape) == 0 or shape[0] != expected:
        found = "a scalar" if len(shape) == 0 else f"dim 0 of size {shape[0]}"
        raise ShardingError(
            at(
                where,
                f"dim 0 of every leaf is the {what}; expected {expected}, got {found} "
                f"(shape {shape}).",
            )
        )


class InputDispatcher:
    """Pads each feed's logical batch to a physical one on the host and drops the padding in
    the step, so that any global batch (smaller than the device count, hosts that feed no
    data) can be assembled evenly over the devices.

    Each feed (host) reads the shard ``feed_read_config()`` names, batches
    ``feed_logical_batch_size`` examples, calls ``logical_to_physical_batch`` and
    ``host_to_global_array(batch, partition=dispatcher.partition_spec)``; the step calls
    ``physical_to_logical_batch`` on the global batch.

    Args:
        global_logical_batch_size: the examples per step, over all feeds.
        global_physical_batch_size: the rows per step after padding. Default: the smallest
            multiple of both the device count and ``num_physical_feeds`` that holds
            ``feed_logical_batch_size`` rows per feed.
        num_physical_feeds: the feeds (hosts) that assemble the global batch. Default:
            ``process_count()``.
        physical_feed_index: this feed, in ``[0, num_physical_feeds)``. Default:
            ``process_index()``.
        logical_feed_indices: the physical feeds that read data, one per logical feed. Default:
            the first ``min(global_logical_batch_size, num_physical_feeds)`` feeds.

    Raises:
        ValueError: as axlearn: a logical batch not divisible by the logical feeds, a physical
            batch not divisible by the physical feeds or smaller per feed than the logical one,
            a feed index out of range, repeated logical feed indices.

    Example (2 hosts, 8 devices, 2 examples per step, only host 0 reads data):
        >>> d = torchshard.InputDispatcher(
        ...     2, num_physical_feeds=2, physical_feed_index=0, logical_feed_indices=(0,)
        ... )
        >>> d.feed_physical_batch_size, d.global_physical_batch_size
        (4, 8)
        >>> d.feed_read_config()
        {'num_shards': 1, 'shard_index': 0}

    The whole path, with both hosts played by this process (host 1 pads; its rows are dropped):
        >>> from torchshard.testing import host_to_global_array_per_host, virtual_hosts
        >>> with virtual_hosts(2), torchshard.Mesh(np.arange(8), ("data",)):
        ...     feeds = [
        ...         torchshard.InputDispatcher(2, physical_feed_index=h, logical_feed_indices=(0,))
        ...         for h in range(2)
        ...     ]
        ...     rows = {"x": np.array([10, 11])}  # the shard both feeds read (shard 0 of 1)
        ...     batches = [f.logical_to_physical_batch(rows) for f in feeds]
        ...     g = host_to_global_array_per_host(batches, partition=feeds[0].partition_spec)
        ...     out = feeds[0].physical_to_logical_batch(g)  # in the step
        ...     torchshard.replicate_to_local_data(out)
        {'x': tensor([10, 11])}
    """

    def __init__(
        self,
        global_logical_batch_size: int,
        *,
        global_physical_batch_size: int | None = None,
        num_physical_feeds: int | None = None,
        physical_feed_index: int | None = None,
        logical_feed_indices: Sequence[int] | None = None,
    ) -> None:
        topology = current_topology(current_mesh())
        logical = positive_int(global_logical_batch_size, "global_logical_batch_size")
        feeds = (
            topology.process_count
            if num_physical_feeds is None
            else positive_int(num_physical_feeds, "num_physical_feeds")
        )
        index = topology.process_index if physical_feed_index is None else physical_feed_index
        if logical_feed_indices is None:
            logical_feed_indices = range(min(logical, feeds))
        indices = tuple(int(i) for i in logical_feed_indices)
        if not indices:
            raise ValueError("logical_feed_indices must name at least one physical feed.")
        if global_physical_batch_size is None:
            # axlearn takes max(feed_logical * feeds, device_count), which need not divide
            # by the device count (5 * 2 = 10 rows on 8 devices); round up to a multiple.
            step = math.lcm(topology.device_count, feeds)
            need = (logical // len(indices)) * feeds
            physical = -(-need // step) * step
        else:
            physical = positive_int(global_physical_batch_size, "global_physical_batch_size")
        self._logical = logical
        self._physical = physical
        self._feeds = feeds
        self._index = index
        self._indices = indices
        self._verified = False  # physical_to_logical_batch verified a key (check=None)

        if logical % self.num_logical_feeds:
            raise ValueError(
                f"global_logical_batch_size={logical} must be divisible by "
                f"num_logical_feeds={self.num_logical_feeds} (len(logical_feed_indices))."
            )
        if physical % feeds:
            raise ValueError(
                f"global_physical_batch_size={physical} must be divisible by "
                f"num_physical_feeds={feeds}."
            )
        if self.feed_physical_batch_size < self.feed_logical_batch_size:
            raise ValueError(
                f"feed_physical_batch_size={self.feed_physical_batch_size} must be >= "
                f"feed_logical_batch_size={self.feed_logical_batch_size}; raise "
                "global_physical_batch_size or leave it to the default."
            )
        if not 0 <= index < feeds:
            raise ValueError(f"physical_feed_index={index} must be in range [0, {feeds}).")
        if not all(0 <= i < feeds for i in indices):
            raise ValueError(
                f"Invalid physical feed index in logical_feed_indices={list(indices)}: must be "
                f"in range [0, {feeds})."
            )
        if len(set(indices)) != len(indices):
            raise ValueError(f"logical_feed_indices={list(indices)} must be unique.")

    def __repr__(self) -> str:
        return (
            f"InputDispatcher(global_logical_batch_size={self._logical}, "
            f"global_physical_batch_size={self._physical}, num_physical_feeds={self._feeds}, "
            f"physical_feed_index={self._index}, logical_feed_indices={self._indices})"
        )

    # -- configuration --------------------------------------------------------------------
    @property
    def global_logical_batch_size(self) -> int:
        """The examples per step, over all feeds."""
        return self._logical

    @property
    def global_physical_batch_size(self) -> int:
        """The rows per step after padding, over all feeds."""
        return self._physical

    @property
    def num_physical_feeds(self) -> int:
        """The feeds that assemble the global batch."""
        return self._feeds

    @property
    def physical_feed_index(self) -> int:
        """This feed's index among the physical feeds."""
        return self._index

    @property
    def logical_feed_indices(self) -> tuple[int, ...]:
        """The physical feed of each logical feed."""
        return self._indices

    @property
    def num_logical_feeds(self) -> int:
        """The feeds that read data."""
        return len(self._indices)

    @property
    def logical_feed_index(self) -> int | None:
        """This feed's index among the logical feeds; None for a padding feed."""
        if self._index in self._indices:
            return self._indices.index(self._index)
        return None

    @property
    def feed_logical_batch_size(self) -> int:
        """The examples this feed batches (every feed, padding feeds included)."""
        return self._logical // self.num_logical_feeds

    @property
    def feed_physical_batch_size(self) -> int:
        """The rows of this feed's block of the global batch."""
        return self._physical // self._feeds

    @property
    def partition_spec(self) -> PartitionSpec:
        """The spec to assemble with: dim 0 over every axis of the current mesh."""
        return input_partition_spec()

    @property
    def is_identity(self) -> bool:
        """Whether batches pass through unchanged (no padding, no key): every feed is logical
        feed of the same index, so the physical order already is the logical order. (axlearn
        also skips the key when the logical feeds are the physical ones in another order, which
        then silently reorders the batch.)"""
        return self._logical == self._physical and self._indices == tuple(range(self._feeds))

    def feed_read_config(self) -> dict[str, int]:
        """Which shard of the source this feed reads: ``{"num_shards", "shard_index"}``.

        A padding feed reads an arbitrary shard (its rows are dropped in the step); padding
        feeds spread over the shards.
        """
        shard = self.logical_feed_index
        if shard is None:
            padding = [i for i in range(self._feeds) if i not in self._indices]
            shard = padding.index(self._index) % self.num_logical_feeds
        return {"num_shards": self.num_logical_feeds, "shard_index": shard}

    # -- host side ------------------------------------------------------------------------
    def logical_to_physical_batch(self, logical_feed_batch: Any, /) -> Any:
        """This feed's physical batch: every leaf padded with zeros to
        ``feed_physical_batch_size`` rows (all zeros on a padding feed), plus the dispatch key.

        Host side, on numpy arrays or CPU tensors (each leaf keeps its kind; containers keep
        their types). The key is an int64 vector ``[feed_physical_batch_size]``: the logical
        index of each row, ``-1`` for padding; it is a torch tensor when any leaf is one, else
        a numpy array. When logical and physical batches coincide the batch passes through
        (new containers, same leaves) without a key.

        Raises:
            ShardingError: (a ``ValueError``) naming the leaf whose dim 0 is not
                ``feed_logical_batch_size``; ``ValueError`` when the key is already present;
                ``TypeError`` for a root that is not a dict (the key needs one), a leaf that
                is not a host array, or a dtype that cannot be zero-padded.

        Example (feed 0 of 2 reads 2 rows and pads them to 4):
            >>> d = torchshard.InputDispatcher(
            ...     2, num_physical_feeds=2, physical_feed_index=0, logical_feed_indices=(0,)
            ... )
            >>> d.feed_logical_batch_size, d.feed_physical_batch_size
            (2, 4)
            >>> d.logical_to_physical_batch({"x": np.arange(2)})
            {'x': array([0, 1, 0, 0]),
             '__physical_to_logical_batch_dispatch': array([ 0,  1, -1, -1])}
        """
        leaves, treespec = flatten(logical_feed_batch)
        where = LazyPaths(treespec, "logical_feed_batch")
        fl, fp = self.feed_logical_batch_size, self.feed_physical_batch_size
        for i, leaf in enumerate(leaves):
            _host_leaf(leaf, where[i])
            _check_batch_dim(tuple(leaf.shape), fl, where[i], "feed's logical batch size")
        if self.is_identity:
            return unflatten(treespec, leaves)
        self._check_root(logical_feed_batch, "logical_feed_batch")
        feed_index = self.logical_feed_index
        padding_feed = feed_index is None
        out = []
        for i, leaf in enumerate(leaves):
            if (padding_feed or fp > fl) and not _paddable(leaf.dtype):
                raise TypeError(
                    at(
                        where[i],
                        f"this feed's rows are padded with zeros, which needs a numeric "
                        f"or bool dtype; got {leaf.dtype}. Encode strings and objects as numbers.",
                    )
                )
            out.append(self._pad(leaf, padding_feed))
        batch = unflatten(treespec, out)
        targets = np.full(fp, -1, dtype=np.int64)
        if feed_index is not None:  # not padding_feed
            targets[:fl] = feed_index * fl + np.arange(fl)
        batch[_KEY] = (
            torch.from_numpy(targets)
            if any(isinstance(x, torch.Tensor) for x in leaves)
            else targets
        )
        return batch

    def _check_root(self, tree: Any, argname: str) -> None:
        if not isinstance(tree, dict):
            raise TypeError(
                at(
                    argname,
                    f"the dispatch key is added at the root of the batch, which must "
                    f"therefore be a dict; got {type(tree).__name__}.",
                )
            )
        if _KEY in tree:
            raise ValueError(
                at(
                    key_path(argname),
                    "the dispatch key is already present; "
                    "logical_to_physical_batch adds it (call it once per batch).",
                )
            )

    def _pad(self, leaf: Any, zeros: bool) -> Any:
        fl, fp = self.feed_logical_batch_size, self.feed_physical_batch_size
        out: torch.Tensor | np.ndarray
        if isinstance(leaf, torch.Tensor):
            out = torch.zeros((fp, *leaf.shape[1:]), dtype=leaf.dtype)
        else:
            leaf = np.asarray(leaf)
            out = np.zeros((fp, *leaf.shape[1:]), dtype=leaf.dtype)
        if not zeros:
            out[:fl] = leaf
        return out

    def logical_to_physical_shapes(self, logical_feed_shapes: Any, /) -> Any:
        """The per-feed physical shapes (``TensorSpec`` tree) for ahead-of-time compilation,
        including the dispatch key when ``logical_to_physical_batch`` adds one.

        Args:
            logical_feed_shapes: a tree whose leaves are ``TensorSpec``s (or have ``.shape`` and
                ``.dtype``), each ``[feed_logical_batch_size, ...]``.
        """
        leaves, treespec = flatten(logical_feed_shapes)
        where = LazyPaths(treespec, "logical_feed_shapes")
        fl, fp = self.feed_logical_batch_size, self.feed_physical_batch_size
        out = []
        for i, leaf in enumerate(leaves):
            shape, dtype = shape_dtype(leaf, where[i])
            _check_batch_dim(shape, fl, where[i], "feed's logical batch size")
            out.append(TensorSpec((fp, *shape[1:]), dtype))
        if self.is_identity:
            return unflatten(treespec, out)
        self._check_root(logical_feed_shapes, "logical_feed_shapes")
        specs = unflatten(treespec, out)
        numpy_only = leaves and all(not isinstance(s.dtype, torch.dtype) for s in out)
        specs[_KEY] = TensorSpec((fp,), np.dtype(np.int64) if numpy_only else torch.int64)
        return specs

    # -- in step --------------------------------------------------------------------------
    def physical_to_logical_batch(
        self, global_physical_batch: Any, /, *, check: bool | None = None
    ) -> Any:
        """The global logical batch: every dict holding the dispatch key (the root, for
        batches from ``logical_to_physical_batch``) loses it, and its other leaves keep the
        logical rows, in logical order, split over the mesh's axes like the input.

        In step, on global tensors (or plain tensors without a mesh). The key may be this
        class's row targets ``[P]`` or axlearn's one-hot matrix ``[P, L]``.
        ``global_physical_batch`` is not modified. One compiled graph per mesh, shapes and
        dtypes on torch_xla (nothing in the call reads values back, but the first call's
        check, below).

        The rows move as bits: floats and complex parts travel as integers of their width,
        so -0.0, NaN payloads (quiet and signalling) and subnormals arrive as they left. On
        torch_xla, row targets whose logical rows split evenly over the mesh move in one
        reduce-scatter (each device scatters the rows it holds to their targets); a one-hot
        key gathers (a masked gather and an all-reduce); DTensor gathers and reduce-scatters.
        A leaf that requires grad (grad mode on) moves as floats, so that it stays
        differentiable: the sum over devices turns -0.0 into 0.0 where no device holds -0.0,
        quiets signalling NaNs, and may flush subnormals and rewrite half floats' NaN payloads
        (docs/differences.md).

        Where the mesh's devices do not divide the logical rows (4 rows on 8 devices), torch_xla
        returns them replicated, ``P()``, by request: torch_xla 2.9 cannot keep such a split
        as a step's output and would replicate them itself, through a reshard that adds
        floats. DTensor keeps the uneven split (``Shard(0)``, the last ranks shorter).

        Args:
            global_physical_batch: the assembled physical batch.
            check: verify the key (each logical index once; one-hot columns), which reads it
                back (a sync). ``True``: every call; ``False``: never; ``None`` (default): the
                first call that carries a key, after which this dispatcher trusts its keys.
                That first check catches what a wrong configuration gives on every step: two
                feeds whose dispatchers claim the same ``physical_feed_index`` fill the same
                logical rows and leave others out.

        Raises:
            ShardingError: (a ``ValueError``) naming the path: no dispatch key although one
                is expected, a key or leaf of the wrong shape, (when checked) a bad key.
        """
        mesh = current_mesh()
        out_spec = None if mesh is None else PartitionSpec(mesh.axis_names)
        verify = (not self._verified) if check is None else check
        out, found = dispatch_dicts(
            global_physical_batch,
            argname="global_physical_batch",
            to_indices=self._key_to_indices(verify),
            out_spec=out_spec,
        )
        if found and verify:
            self._verified = True
        if not found and not self.is_identity:
            raise ShardingError(
                f"global_physical_batch: expected the dispatch key {_KEY!r} (added by "
                "logical_to_physical_batch), but no dict holds it; the leaves would keep "
                f"their {self._physical} physical rows instead of {self._logical}."
            )
        return out

    def _key_to_indices(self, check: bool) -> ToIndices:
        P, L = self._physical, self._logical

        def convert(key: torch.Tensor, where: str, physical: int) -> torch.Tensor | RowTargets:
            if physical != P:
                raise ShardingError(
                    at(
                        where,
                        f"the leaves beside the key must have the global physical batch "
                        f"size {P} in dim 0, but they have {physical}.",
                    )
                )
            if key.dim() == 2 and tuple(key.shape) == (P, L):
                return onehot_to_indices(whole_key(key), where, P, check)
            if key.dim() != 1 or key.shape[0] != P:
                raise ShardingError(
                    at(
                        where,
                        f"expected row targets of shape ({P},) (from "
                        f"logical_to_physical_batch) or a one-hot matrix of shape ({P}, {L}); "
                        f"got {tuple(key.shape)}.",
                    )
                )
            if key.dtype.is_floating_point or key.dtype.is_complex or key.dtype == torch.bool:
                raise TypeError(at(where, f"row targets must be integers; got {key.dtype}."))
            if not check:
                return RowTargets(key, L)
            whole = whole_key(key)
            check_row_targets(whole, L, where)
            return RowTargets(key, L, whole)

        return convert
