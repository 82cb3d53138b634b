"""Context parallelism on the host: the orders of torch's context-parallel load balancers
(``head_tail_order`` for whole sequences; ``context_parallel_order`` for packed rows, whose
documents ``per_document`` and ``ptrr`` respect) and the positions of each sequence a process
reads to feed them (``context_parallel_positions``).

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) balances causal
attention by cutting each sequence into ``2 * cp`` chunks and giving cp rank ``r`` chunks ``r``
and ``2 * cp - 1 - r``: it reorders the whole sequence on every rank, then keeps block ``r``.
Here each host reorders only its own part: a global batch whose sequence dim holds the
sequences in head-tail order, split over the cp axis (``P("dp", "cp")``), gives every cp rank
exactly torch's shard, and each host reads only its ``1 / cp`` of every sequence.

Packed rows (several documents per row, told apart by segment ids; ``torchshard.data.Packer``)
have two more layouts, torch's balancers for FlexAttention with a document mask: per-document
head-tail (torch's ``_PerDocumentHeadTailLoadBalancer``: each document cut into ``2 * cp``
chunks on its own) and PTRR (``_PTRRLoadBalancer``: the mask's query blocks dealt out by their
work, largest first, in a snake). Whole-row head-tail is refused for packed rows: it is the
layout of ``context_parallel``'s causal SDPA, which attends across documents. A *document* is a
run of equal segment ids (a run of padding, segment id 0, is one too: it attends to itself), and
the document mask is ``kv <= q`` within one document. Pure maths (numpy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchshard._core.checks import nonnegative_int, positive_int
from torchshard._core.errors import ShardingError
from torchshard._core.feed import process_slice, process_topology, resolve_mesh, resolve_spec
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import dim_axes, shard_counts


def head_tail_order(seq_len: int, cp_size: int, *, inverse: bool = False) -> list[int]:
    """The head-tail order of torch's ``context_parallel`` for ``seq_len`` positions over
    ``cp_size`` ranks: ``order[i]`` is the original position at position ``i`` of the reordered
    sequence (``inverse=True``: where each original position went, so that
    ``reordered[..., head_tail_order(n, cp, inverse=True)]`` is the original).

    The sequence is cut into ``2 * cp_size`` chunks of ``c = seq_len // (2 * cp_size)``; rank
    ``r``'s block of the reordered sequence is chunk ``r`` then chunk ``2 * cp_size - 1 - r``.
    Equal to torch's ``_HeadTailLoadBalancer(seq_len, cp_size, device)._generate_indices(
    restore=inverse)[0]`` (torch 2.14; ``_generate_round_robin_indices`` in torch 2.9).

    Raises:
        ValueError: ``seq_len`` or ``cp_size`` not a positive int, or ``seq_len`` not a multiple
            of ``2 * cp_size`` (torch then does not balance: torch 2.9 fails, torch 2.14 shards
            the sequence in contiguous blocks; pad the sequences).
        TypeError: ``inverse`` not a bool.

    Example (16 positions over 2 cp ranks: rank 0 holds 0-3 and 12-15):
        >>> torchshard.head_tail_order(16, 2)
        [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
        >>> torchshard.head_tail_order(8, 2, inverse=True)
        [0, 1, 4, 5, 6, 7, 2, 3]
    """
    n = positive_int(seq_len, "head_tail_order: seq_len")
    cp = positive_int(cp_size, "head_tail_order: cp_size")
    if not isinstance(inverse, bool):
        raise TypeError(f"head_tail_order: inverse must be a bool, but got {inverse!r}.")
    if n % (2 * cp):
        raise ValueError(
            f"head_tail_order: seq_len {n} is not a multiple of 2 * cp_size = {2 * cp}: the "
            f"head-tail order cuts each sequence into {2 * cp} equal chunks (torch's "
            "context_parallel does not balance such a sequence: torch 2.9 fails, torch 2.14 "
            f"shards it in contiguous blocks). Pad the sequences to a multiple of {2 * cp}."
        )
    c = n // (2 * cp)
    order: list[int] = []
    for r in range(cp):
        tail = 2 * cp - 1 - r
        order.extend(range(r * c, (r + 1) * c))
        order.extend(range(tail * c, (tail + 1) * c))
    if not inverse:
        return order
    restore = [0] * n
    for i, p in enumerate(order):
        restore[p] = i
    return restore


BALANCERS = ("head_tail", "per_document", "ptrr")
"""The context-parallel layouts, by their ``balancer=`` name."""

DOCUMENT_BALANCERS = ("per_document", "ptrr")
"""The layouts that respect a packed row's documents."""

BLOCK_SIZE = 128
"""FlexAttention's default block size (``create_block_mask``'s ``BLOCK_SIZE``), PTRR's unit."""

_RESPECTING = "balancer='per_document' or balancer='ptrr'"


def _balancer(balancer: Any, caller: str) -> str:
    if not isinstance(balancer, str) or balancer not in BALANCERS:
        raise ValueError(
            f"{caller}: balancer must be one of {', '.join(repr(b) for b in BALANCERS)}, but got "
            f"{balancer!r}."
        )
    return balancer


def _segment_rows(segment_ids: Any, where: str) -> np.ndarray:
    """``segment_ids`` as a 2-D int64 array ``[rows, seq_len]`` (a 1-D row is one row)."""
    try:
        ids = np.asarray(segment_ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{where}: expected integer segment ids, but got {e}") from None
    if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(
            f"{where}: expected integer segment ids (an array of shape [seq_len] or "
            f"[rows, seq_len]), but got dtype {ids.dtype}."
        )
    if ids.ndim not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(
            f"{where}: expected segment ids of shape [seq_len] or [rows, seq_len], but got "
            f"shape {tuple(ids.shape)}."
        )
    return ids.reshape(-1, ids.shape[-1]).astype(np.int64, copy=False)


def documents(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documents of one row of segment ids: their starts and lengths (runs of equal ids,
    a run of padding included)."""
    starts = np.flatnonzero(np.concatenate(([True], row[1:] != row[:-1])))
    lengths = np.diff(np.append(starts, len(row)))
    return starts, lengths


def _show_documents(row: np.ndarray, picked: np.ndarray | None = None, limit: int = 6) -> str:
    starts, lengths = documents(row)
    which = range(len(starts)) if picked is None else picked
    shown = [f"{lengths[d]} at {starts[d]}" for d in list(which)[:limit]]
    more = len(which) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _refuse_packed(row: np.ndarray, where: str, caller: str) -> None:
    ids = row[np.flatnonzero(np.concatenate(([True], row[1:] != row[:-1])))]
    if np.count_nonzero(ids) > 1:
        raise ShardingError(
            f"{caller}: {where} holds {np.count_nonzero(ids)} documents (length at offset of each "
            f"run of segment ids: "
            f"{_show_documents(row)}), but balancer='head_tail' ignores documents: it cuts the "
            "whole row into 2 * cp chunks, the layout of torch's context_parallel, whose causal "
            "SDPA attends across the documents of a packed row. Use a layout that respects "
            f"documents, {_RESPECTING} (FlexAttention with a document mask built from the "
            "segment ids, which travel with the tokens)."
        )


def per_document_order(row: np.ndarray, cp: int, where: str, caller: str) -> np.ndarray:
    """torch's ``_PerDocumentHeadTailLoadBalancer`` order of one row: each document cut into
    ``2 * cp`` chunks, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r`` of every
    document, the ranks' parts one after another."""
    starts, lengths = documents(row)
    bad = np.flatnonzero(lengths % (2 * cp))
    if len(bad):
        raise ShardingError(
            f"{caller}: balancer='per_document' cuts every document into 2 * cp_size = {2 * cp} "
            f"equal chunks, but {where} has {len(bad)} document{'s' if len(bad) > 1 else ''} "
            f"whose length is not a multiple of {2 * cp} (length at offset: "
            f"{_show_documents(row, bad)}). Pack with torchshard.data.Packer(..., "
            f"pad_to_multiple_of={2 * cp}), which pads each document (and the row's end) to a "
            f"multiple of {2 * cp}, or use balancer='ptrr'."
        )
    parts = []
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        chunks = np.arange(start, start + length).reshape(2 * cp, -1)
        parts.append(np.concatenate((chunks[:cp], chunks[::-1][:cp]), axis=1))
    return np.concatenate(parts, axis=1).reshape(-1)


def query_block_work(row: np.ndarray, block_size: int) -> np.ndarray:
    """The work of each query block of one row under the document mask: how many key blocks
    it touches (FlexAttention's ``kv_num_blocks + full_kv_num_blocks`` for the mask, which
    ``_PTRRLoadBalancer`` balances). Query block ``i`` touches the key blocks from its first
    query's document start to itself."""
    starts, lengths = documents(row)
    doc_start = np.repeat(starts, lengths)
    first = np.arange(0, len(row), block_size)
    return first // block_size - doc_start[first] // block_size + 1


def ptrr_order(row: np.ndarray, cp: int, block_size: int, where: str, caller: str) -> np.ndarray:
    """torch's ``_PTRRLoadBalancer`` order of one row: the query blocks sorted by their work
    (stable, largest first), dealt to the ranks in a snake (``0 .. cp - 1``, then
    ``cp - 1 .. 0``), each rank's blocks in ascending order, the ranks one after another."""
    n = len(row)
    if n % block_size or (n // block_size) % cp:
        raise ShardingError(
            f"{caller}: balancer='ptrr' deals whole blocks of block_size={block_size} to the "
            f"{cp} ranks, so seq_len must be a multiple of block_size * cp_size = "
            f"{block_size * cp}, but {where} has {n} positions ({n / block_size:g} blocks). "
            f"Pack rows of a multiple of {block_size * cp} (Packer(seq_len=...)), or pass a "
            "smaller block_size (the BLOCK_SIZE of the block mask)."
        )
    work = query_block_work(row, block_size)
    ranked = np.argsort(-work, kind="stable").reshape(-1, cp)
    ranked[1::2] = ranked[1::2, ::-1]
    groups = np.sort(ranked.T, axis=1).reshape(-1)
    return (groups[:, None] * block_size + np.arange(block_size)).reshape(-1)


def row_orders(
    segment_ids: Any,
    cp_size: int,
    *,
    balancer: str,
    block_size: int = BLOCK_SIZE,
    where: str,
    caller: str,
) -> np.ndarray:
    """The order of every row of ``segment_ids`` (``[rows, seq_len]`` int64 out); errors name
    ``where`` (the argument) and ``caller``."""
    rows = _segment_rows(segment_ids, where)
    n = rows.shape[1]
    out = np.empty(rows.shape, dtype=np.int64)
    for i, row in enumerate(rows):
        at_row = where if np.ndim(segment_ids) == 1 else f"{where}[{i}]"
        if balancer == "head_tail":
            _refuse_packed(row, at_row, caller)
            out[i] = head_tail_order(n, cp_size)
        elif balancer == "per_document":
            out[i] = per_document_order(row, cp_size, at_row, caller)
        else:
            out[i] = ptrr_order(row, cp_size, block_size, at_row, caller)
    return out


def context_parallel_order(
    segment_ids: Any,
    cp_size: int,
    *,
    balancer: str = "head_tail",
    inverse: bool = False,
    block_size: int = BLOCK_SIZE,
) -> list[int]:
    """The context-parallel order of one row of ``seq_len`` positions over ``cp_size`` ranks,
    from its segment ids: ``order[i]`` is the original position at position ``i`` of the
    reordered row, whose ``r``-th ``1 / cp_size`` cp rank ``r`` holds (``inverse=True``: where
    each original position went, so that ``reordered[..., inverse_order]`` is the original).

    Balancers (``balancer=``):

    - ``"head_tail"``: the whole row in ``2 * cp_size`` chunks, rank ``r`` holding chunks ``r``
      and ``2 * cp_size - 1 - r`` (``head_tail_order``; torch's ``context_parallel``). Refused
      for a packed row (more than one document): its causal SDPA attends across documents.
    - ``"per_document"``: the same cut inside every document (a run of equal segment ids,
      padding included), so each rank holds a head and a tail of every document: torch's
      ``_PerDocumentHeadTailLoadBalancer(lengths, cp_size, device)._generate_indices()``. Every
      document's length must be a multiple of ``2 * cp_size``
      (``torchshard.data.Packer(..., pad_to_multiple_of=2 * cp_size)`` pads them).
    - ``"ptrr"``: processing-time round robin over FlexAttention's blocks of ``block_size``:
      each query block's work is the key blocks it touches under the document mask (``kv <=
      q`` inside a document), the blocks are dealt largest first in a snake: torch's
      ``_PTRRLoadBalancer(create_block_mask(document_causal, ...), cp_size)
      ._generate_indices()``. ``seq_len`` must be a multiple of ``block_size * cp_size``.

    Each cp rank builds its document mask from the segment ids (and positions) reordered
    alike: feed them with the tokens.

    Args:
        segment_ids: one row's segment ids, shape ``[seq_len]`` (a list, numpy array or CPU
            tensor of ints; 0 for padding).
        cp_size: the number of cp ranks.
        balancer: ``"head_tail"``, ``"per_document"`` or ``"ptrr"``.
        inverse: return the inverse permutation.
        block_size: PTRR's block (the block mask's ``BLOCK_SIZE``; FlexAttention's default 128).

    Raises:
        ShardingError: a packed row under ``"head_tail"``; a document ``"per_document"`` cannot
            cut, or a row ``"ptrr"`` cannot deal (naming the lengths and the fix).
        ValueError: as ``head_tail_order``; an unknown ``balancer``; a non-positive size.
        TypeError: segment ids that are not integers; ``inverse`` not a bool.

    Example (documents of 8 and 4 tokens, then 4 of padding, over 2 cp ranks):
        >>> ids = [1] * 8 + [2] * 4 + [0] * 4
        >>> torchshard.context_parallel_order(ids, 2, balancer="per_document")
        [0, 1, 6, 7, 8, 11, 12, 15, 2, 3, 4, 5, 9, 10, 13, 14]
        >>> torchshard.context_parallel_order([0] * 8, 2)  # not packed: whole-row head-tail
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    caller = "context_parallel_order"
    cp = positive_int(cp_size, f"{caller}: cp_size")
    kind = _balancer(balancer, caller)
    block = positive_int(block_size, f"{caller}: block_size")
    if not isinstance(inverse, bool):
        raise TypeError(f"{caller}: inverse must be a bool, but got {inverse!r}.")
    if np.ndim(segment_ids) != 1:
        raise ValueError(
            f"{caller}: segment_ids must be one row, of shape [seq_len], but got shape "
            f"{tuple(np.shape(segment_ids))} (context_parallel_positions takes several rows)."
        )
    order = row_orders(
        segment_ids, cp, balancer=kind, block_size=block, where="segment_ids", caller=caller
    )[0]
    if inverse:
        order = np.argsort(order, kind="stable")
    return [int(i) for i in order]


def context_parallel_positions(
    partition: Any,
    seq_len: int,
    *,
    seq_dim: int = 1,
    mesh: Mesh | None = None,
    balancer: str = "head_tail",
    segment_ids: Any = None,
    block_size: int = BLOCK_SIZE,
) -> Any:
    """The positions of every sequence this process reads, in the order it feeds them, for a
    batch laid out by ``partition`` (e.g. ``P("dp", "cp")``) whose dim ``seq_dim`` holds the
    sequences in a context-parallel order over the shards of that dim: torch's head-tail order
    (``head_tail_order``; the default), or for packed rows one of the orders that respect
    documents (``context_parallel_order``'s ``"per_document"`` and ``"ptrr"``).

    The recipe: each host reads the examples ``feed_read_config(partition)`` names and, of
    each, only the positions given here; every sequence leaf (inputs, labels, position ids,
    segment ids alike) is indexed with them (``x[:, positions]``, or read so from the source);
    the batch is fed with ``partition``. Each cp rank's local block then equals what torch's
    ``context_parallel(cp_mesh, buffers=..., buffer_seq_dims=...)`` keeps of the whole batch
    (for packed rows: ``_context_parallel_shard`` with the same balancer), and no host copies
    the other ``cp - 1`` parts of a sequence. Read back: a block read with
    ``global_to_host_array`` holds these positions (``out[:, positions] = block``); a global
    value (``replicate_to_local_data``) is in the layout's order:
    ``value[:, head_tail_order(seq_len, cp, inverse=True)]`` (``context_parallel_order(...,
    inverse=True)`` per row) is the original.

    ``cp`` is the number of shards of dim ``seq_dim`` under ``partition`` (the cp axis's size
    for ``P("dp", "cp")``). A cp axis of size 1 gives every position in its order
    (``list(range(seq_len))``, any length): one cp rank keeps the whole sequence, as torch's
    ``context_parallel`` does, so a job configured with ``cp=1`` runs the same code.

    Args:
        partition: the batch's ``PartitionSpec``; it must split dim ``seq_dim``.
        seq_len: the global sequence length (a multiple of ``2 * cp`` for head-tail).
        seq_dim: the sequence dimension of the sequence leaves (1 for ``[batch, seq, ...]``).
        mesh: a ``torchshard.Mesh``; ``None``: the current mesh.
        balancer: ``"head_tail"``, ``"per_document"`` or ``"ptrr"`` (``context_parallel_order``).
        segment_ids: the segment ids of the rows this process reads, ``[rows, seq_len]`` (or one
            row, ``[seq_len]``): needed by ``"per_document"`` and ``"ptrr"``, whose order differs
            per row; given with ``"head_tail"``, a packed row is refused.
        block_size: PTRR's block (the block mask's ``BLOCK_SIZE``).

    Returns:
        Without ``segment_ids``: a list of ints, the same for every sequence. With them: an int64
        numpy array of shape ``segment_ids.shape[:-1] + (seq_len * held // cp,)``, each row's
        positions (``np.take_along_axis(x, positions, axis=1)`` gathers a ``[rows, seq_len]``
        leaf).

    Raises:
        ShardingError: ``partition`` names no mesh axis for dim ``seq_dim``, or this process's
            shards of it are not neighbours; packed ``segment_ids`` under ``"head_tail"``
            (naming the row and the layouts that respect documents); as
            ``context_parallel_order`` and
            ``feed_slices`` otherwise.
        ValueError: as ``head_tail_order``; a negative ``seq_dim``; ``segment_ids`` of another
            length than ``seq_len``, or missing for ``"per_document"``/``"ptrr"``.

    Example (mesh ``(dp=2, cp=2)``, 4 hosts of 2 devices; host 1 is cp rank 1 of dp row 0):
        >>> from torchshard.testing import virtual_hosts
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(2, 2, 2), ("dp", "cp", "tp"))
        >>> with virtual_hosts(4, process_index=1), mesh:
        ...     torchshard.context_parallel_positions(torchshard.P("dp", "cp"), 8)
        ...     ids = [[1] * 4 + [2] * 4]
        ...     torchshard.context_parallel_positions(
        ...         torchshard.P("dp", "cp"), 8, balancer="per_document", segment_ids=ids
        ...     )
        [2, 3, 4, 5]
        array([[1, 2, 5, 6]])
    """
    caller = "context_parallel_positions"
    kind = _balancer(balancer, caller)
    block = positive_int(block_size, f"{caller}: block_size")
    mesh = resolve_mesh(mesh, caller)
    spec = resolve_spec(partition, mesh, caller)
    n = positive_int(seq_len, f"{caller}: seq_len")
    dim = nonnegative_int(seq_dim, f"{caller}: seq_dim")
    if segment_ids is None and kind != "head_tail":
        raise ValueError(
            f"{caller}: balancer={kind!r} orders each row by its documents, so it needs the "
            "segment ids of the rows this process reads: pass segment_ids=batch['segment_ids'] "
            "(shape [rows, seq_len])."
        )
    if segment_ids is not None and np.shape(segment_ids)[-1:] != (n,):
        raise ValueError(
            f"{caller}: segment_ids must have seq_len = {n} positions in their last dim, but "
            f"got shape {tuple(np.shape(segment_ids))}."
        )
    try:
        axes = dim_axes(mesh, spec, max(len(spec), dim + 1))
    except ShardingError as e:
        raise ShardingError(f"{caller}: {e}") from None
    cp = shard_counts(mesh, axes)[dim]
    if cp == 1 and axes[dim]:  # a cp axis of size 1: torch's context_parallel keeps it whole
        return list(range(n))
    if cp == 1:
        raise ShardingError(
            f"{caller}: {spec!r} does not split dim {dim} (seq_dim) on {mesh!r}, so there is no "
            "context parallelism: every process reads whole sequences, in their order. Split "
            f"the sequence dim over the cp axis (e.g. P('dp', 'cp') for seq_dim=1), or pass the "
            "seq_dim that the spec splits."
        )
    if segment_ids is None:
        order = head_tail_order(n, cp)
        topology = process_topology(mesh, caller)
        return order[process_slice(caller, mesh, spec, axes, dim, n, topology)]
    orders = row_orders(
        segment_ids, cp, balancer=kind, block_size=block, where="segment_ids", caller=caller
    )
    topology = process_topology(mesh, caller)
    part = orders[:, process_slice(caller, mesh, spec, axes, dim, n, topology)]
    return part.reshape(*np.shape(segment_ids)[:-1], part.shape[-1])
