"""Context parallelism on the host: the head-tail order of torch's ``context_parallel``
(``head_tail_order``) and the positions of each sequence a process reads to feed it
(``context_parallel_positions``).

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) balances causal
attention by cutting each sequence into ``2 * cp`` chunks and giving cp rank ``r`` chunks ``r``
and ``2 * cp - 1 - r``: it reorders the whole sequence on every rank, then keeps block ``r``.
Here each host reorders only its own part: a global batch whose sequence dim holds the
sequences in head-tail order, split over the cp axis (``P("dp", "cp")``), gives every cp rank
exactly torch's shard, and each host reads only its ``1 / cp`` of every sequence. Pure maths.
"""

from __future__ import annotations

from typing import Any

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


def context_parallel_positions(
    partition: Any, seq_len: int, *, seq_dim: int = 1, mesh: Mesh | None = None
) -> list[int]:
    """The positions of every sequence this process reads, in the order it feeds them, for a
    batch laid out by ``partition`` (e.g. ``P("dp", "cp")``) whose dim ``seq_dim`` holds the
    sequences in torch's head-tail order (``head_tail_order``) over the shards of that dim.

    The recipe: each host reads the examples ``feed_read_config(partition)`` names and, of
    each, only the positions given here; every sequence leaf (inputs, labels, position ids
    alike) is indexed with them (``x[:, positions]``, or read so from the source); the batch is
    fed with ``partition``. Each cp rank's local block then equals what torch's
    ``context_parallel(cp_mesh, buffers=..., buffer_seq_dims=...)`` keeps of the whole batch,
    and no host reads or copies the other ``cp - 1`` parts of a sequence. Read back: a block
    read with ``global_to_host_array`` holds these positions (``out[:, positions] = block``); a
    global value (``replicate_to_local_data``) is in head-tail order:
    ``value[:, head_tail_order(seq_len, cp, inverse=True)]`` is the original.

    ``cp`` is the number of shards of dim ``seq_dim`` under ``partition`` (the cp axis's size
    for ``P("dp", "cp")``). A cp axis of size 1 gives every position in its order
    (``list(range(seq_len))``, any length): one cp rank keeps the whole sequence, as torch's
    ``context_parallel`` does, so a job configured with ``cp=1`` runs the same code.

    Args:
        partition: the batch's ``PartitionSpec``; it must split dim ``seq_dim``.
        seq_len: the global sequence length (a multiple of ``2 * cp``).
        seq_dim: the sequence dimension of the sequence leaves (1 for ``[batch, seq, ...]``).
        mesh: a ``torchshard.Mesh``; ``None``: the current mesh.

    Raises:
        ShardingError: ``partition`` names no mesh axis for dim ``seq_dim``, or this process's
            shards of it are not neighbours; as ``feed_slices`` otherwise.
        ValueError: as ``head_tail_order``; a negative ``seq_dim``.

    Example (mesh ``(dp=2, cp=2)``, 4 hosts of 2 devices; host 1 is cp rank 1 of dp row 0):
        >>> from torchshard.testing import virtual_hosts
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(2, 2, 2), ("dp", "cp", "tp"))
        >>> with virtual_hosts(4, process_index=1), mesh:
        ...     torchshard.context_parallel_positions(torchshard.P("dp", "cp"), 8)
        [2, 3, 4, 5]
    """
    caller = "context_parallel_positions"
    mesh = resolve_mesh(mesh, caller)
    spec = resolve_spec(partition, mesh, caller)
    n = positive_int(seq_len, f"{caller}: seq_len")
    dim = nonnegative_int(seq_dim, f"{caller}: seq_dim")
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
    order = head_tail_order(n, cp)
    topology = process_topology(mesh, caller)
    return order[process_slice(caller, mesh, spec, axes, dim, n, topology)]
