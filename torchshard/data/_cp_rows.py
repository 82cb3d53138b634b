"""``context_parallel_rows``: each process's part of every packed row, in a context-parallel
order that respects the row's documents (a source over a source of packed batches).

A ``GlobalBatchLoader`` fed a ``Packer`` with a partition that splits the sequence dim refuses
it (``_packer.refuse_packed_context_parallel``): the rows would be cut as they come. Wrapped
here, every batch's rows are reordered by ``context_parallel_positions`` (``"per_document"`` or
``"ptrr"``, from the batch's own segment ids) and cut to this process's part: every cp rank of
a dp group packs the same rows (the same documents, a deterministic packer) and keeps its
``1 / cp``; the loader places them with the partition. A feeder: it imports nothing of the
loader's wing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from torchshard._core.checks import positive_int
from torchshard._core.context_parallel import (
    BLOCK_SIZE,
    DOCUMENT_BALANCERS,
    context_parallel_positions,
)
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh


def _methods(source: Any) -> tuple[str, str] | None:
    for get, put in (("state_dict", "load_state_dict"), ("get_state", "set_state")):
        if callable(getattr(source, get, None)) and callable(getattr(source, put, None)):
            return get, put
    return None


class ContextParallelRows:
    """What ``context_parallel_rows`` returns: an iterable source whose state is its source's.

    Attributes:
        source: the source of packed batches (a ``Packer``).
        partition: the batch's ``PartitionSpec`` (it splits dim 1, the sequence).
        balancer: ``"per_document"`` or ``"ptrr"``.
        block_size: PTRR's block.
        mesh: the mesh, or ``None`` for the current one (a loader's thread has its own).
    """

    def __init__(
        self,
        source: Iterable[Any],
        partition: Any,
        *,
        balancer: str = "per_document",
        block_size: int = BLOCK_SIZE,
        mesh: Mesh | None = None,
    ) -> None:
        if not isinstance(source, Iterable):
            raise TypeError(
                "context_parallel_rows: source must be an iterable of packed batches (a "
                f"torchshard.data.Packer), but got {type(source).__name__}."
            )
        if balancer not in DOCUMENT_BALANCERS:
            extra = (
                " 'head_tail' ignores documents: its causal SDPA (torch's context_parallel) "
                "attends across the documents of a packed row."
                if balancer == "head_tail"
                else ""
            )
            raise ShardingError(
                f"context_parallel_rows: balancer must be a layout that respects documents, "
                f"'per_document' or 'ptrr', but got {balancer!r}.{extra}"
            )
        self.source = source
        self.partition = partition
        self.balancer = balancer
        self.block_size = positive_int(block_size, "context_parallel_rows: block_size")
        self.mesh = mesh

    @property
    def batch_size(self) -> Any:
        """The source's rows per batch (``None`` where it has none)."""
        return getattr(self.source, "batch_size", None)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the source."""
        target = getattr(self.source, "set_epoch", None)
        if not callable(target):
            raise TypeError(
                f"context_parallel_rows.set_epoch({epoch}): the source "
                f"({type(self.source).__name__}) has no set_epoch."
            )
        target(epoch)

    def state_dict(self) -> Any:
        """The source's state (its position: this source keeps none of its own)."""
        methods = _methods(self.source)
        if methods is None:
            raise TypeError(
                f"context_parallel_rows: the source ({type(self.source).__name__}) saves no "
                "position (no state_dict or get_state)."
            )
        return getattr(self.source, methods[0])()

    def load_state_dict(self, state: Any) -> None:
        """Loads ``state`` into the source."""
        methods = _methods(self.source)
        if methods is None:
            raise TypeError(
                f"context_parallel_rows: the source ({type(self.source).__name__}) loads no "
                "position (no load_state_dict or set_state)."
            )
        getattr(self.source, methods[1])(state)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i, batch in enumerate(self.source):
            yield self._part(batch, i)

    def _part(self, batch: Any, index: int) -> dict[str, Any]:
        if not isinstance(batch, dict) or "segment_ids" not in batch:
            raise ShardingError(
                f"context_parallel_rows: batch {index} has no 'segment_ids' (a dict of "
                "[rows, seq_len] arrays, as torchshard.data.Packer yields), so its documents "
                f"cannot be told apart; got {type(batch).__name__}"
                + (f" with keys {sorted(batch)}." if isinstance(batch, dict) else ".")
            )
        ids = np.asarray(batch["segment_ids"])
        if ids.ndim != 2:
            raise ShardingError(
                f"context_parallel_rows: batch {index}: batch['segment_ids'] must be "
                f"[rows, seq_len], but has shape {tuple(ids.shape)}."
            )
        positions = context_parallel_positions(
            self.partition,
            ids.shape[1],
            mesh=self.mesh,
            balancer=self.balancer,
            segment_ids=ids,
            block_size=self.block_size,
        )
        out = {}
        for key, value in batch.items():
            array = np.asarray(value)
            if array.shape[:2] != ids.shape:
                raise ShardingError(
                    f"context_parallel_rows: batch {index}: batch[{key!r}] has shape "
                    f"{tuple(array.shape)}, but every leaf is cut along the sequence like the "
                    f"segment ids, of shape {tuple(ids.shape)}."
                )
            index_ = positions.reshape(positions.shape + (1,) * (array.ndim - 2))
            out[key] = np.take_along_axis(array, index_, axis=1)
        return out


def context_parallel_rows(
    source: Iterable[Any],
    partition: Any,
    *,
    balancer: str = "per_document",
    block_size: int = BLOCK_SIZE,
    mesh: Mesh | None = None,
) -> ContextParallelRows:
    """This process's part of every packed row of ``source``, in a context-parallel order that
    respects documents: a source for ``GlobalBatchLoader(..., partition=partition)``.

    Each batch of ``source`` (a dict of ``[rows, seq_len]`` arrays with ``segment_ids``, as
    ``torchshard.data.Packer`` yields) is reordered row by row by ``balancer``
    (``context_parallel_order``: ``"per_document"``, torch's ``_PerDocumentHeadTailLoadBalancer``,
    or ``"ptrr"``, its ``_PTRRLoadBalancer``) and cut to the positions this process reads
    (``context_parallel_positions``): every leaf, the segment ids and positions too, so each cp
    rank builds its document mask from its own part. Every process of a cp group must pack the
    same rows (the same documents in the same order). The state is the source's
    (``state_dict``/``load_state_dict`` forwarded), so a loader resumes it.

    Args:
        source: an iterable of packed batches (a ``Packer``).
        partition: the loader's partition, splitting dim 1 over the cp axis (``P("dp", "cp")``).
        balancer: ``"per_document"`` (documents padded to a multiple of ``2 * cp``:
            ``Packer(..., pad_to_multiple_of=2 * cp)``) or ``"ptrr"`` (``seq_len`` a multiple
            of ``block_size * cp``).
        block_size: PTRR's block (the block mask's ``BLOCK_SIZE``).
        mesh: the mesh; ``None``: the current mesh where it iterates (a loader's thread has the
            loader's).

    Raises:
        ShardingError: ``balancer="head_tail"`` (it ignores documents); at a batch, as
            ``context_parallel_positions``, or a batch without segment ids.

    Example (mesh ``(dp=2, cp=2)``, 4 hosts; host 1 is cp rank 1 of dp row 0):
        >>> from torchshard.testing import virtual_hosts
        >>> docs = [np.arange(1, 9), np.arange(1, 5)]
        >>> packer = torchshard.data.Packer(docs, seq_len=16, rows=1, pad_to_multiple_of=4)
        >>> rows = torchshard.data.context_parallel_rows(packer, torchshard.P("dp", "cp"))
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(2, 2, 2), ("dp", "cp", "tp"))
        >>> with virtual_hosts(4, process_index=1), mesh:
        ...     next(iter(rows))["tokens"]
        array([[3, 4, 5, 6, 2, 3, 0, 0]])
    """
    return ContextParallelRows(
        source, partition, balancer=balancer, block_size=block_size, mesh=mesh
    )
