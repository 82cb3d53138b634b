"""Context parallel sharding on CPU (gloo), fed by torchshard; run with
``torchrun --standalone --nproc-per-node 2 examples/stacks/context_parallel.py`` (cp=2; with 4
processes, dp=2 x cp=2).

torch's ``context_parallel`` balances a sequence head to tail (``torchshard.head_tail_order``).
Fed by torchshard (the block between the markers is the one in docs/stacks.md), each process
reads its dp shard's rows and only its cp part of each sequence; fed torch's way, every cp
rank holds the whole rows and ``context_parallel(dm["cp"], buffers=...)`` shards them. Every
rank's block of tokens, labels and positions is equal. CP training does not run on CPU (its
SDPA has no CPU kernel), so the check is the sharding, not a loss.

Packed rows (``packed()``): each dp shard's documents packed by ``torchshard.data.Packer``
(every document padded to a multiple of ``2 * cp``), then each host reads its part of every row
in a layout that respects documents (``balancer="per_document"`` and ``"ptrr"``): every rank's
tokens, segment ids and positions equal what torch's own balancer
(``_PerDocumentHeadTailLoadBalancer``, ``_PTRRLoadBalancer`` over the document mask's
``BlockMask``) and ``_context_parallel_shard`` keep of the whole rows (torch >= 2.13; before,
the plain reference: the rows indexed by ``context_parallel_order``), and the document mask each
rank builds from its segment ids and positions lets no query see a key of another document
(checked against the documents the rows were packed from). torch's private balancers are
reached through torchshard's one module of private torch names.
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

import torchshard as ts
from torchshard._backend.dtensor._torch_private import (
    context_parallel_shard,
    document_load_balancer,
)

BATCH, SEQ = 4, 16
TOKENS = 1000 * torch.arange(BATCH)[:, None] + torch.arange(SEQ)  # row r: 1000 r + position


def read(key, rows, positions):
    """What a host reads of the source: only these positions of these rows."""
    tokens = TOKENS[list(rows)][:, positions]
    if key == "positions":
        return torch.tensor(positions).expand(len(rows), -1).contiguous()
    return tokens + 1 if key == "labels" else tokens


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dp, cp = world // 2, 2
    # --- docs/stacks.md: context-parallel
    dm = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    mesh, partition = ts.Mesh.from_device_mesh(dm), ts.P("dp", "cp")
    config = ts.feed_read_config(partition, mesh=mesh)  # which rows
    rows = range(BATCH)[config["shard_index"] :: config["num_shards"]]
    positions = ts.context_parallel_positions(partition, SEQ, mesh=mesh)  # which tokens
    host = {k: read(k, rows, positions) for k in ("tokens", "labels", "positions")}
    with mesh:
        batch = ts.host_to_global_array(host, partition=partition)
    local = ts.to_local(batch)  # what context_parallel(dm["cp"], buffers=...) keeps
    # --- end

    # torch's own: the dp shard's whole rows on every cp rank, sharded by context_parallel.
    whole = {k: read(k, rows, list(range(SEQ))) for k in ("tokens", "labels", "positions")}
    buffers = [whole["tokens"], whole["labels"], whole["positions"]]
    with context_parallel(dm["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1]):
        torchs = {k: v.clone() for k, v in whole.items()}  # sharded in place on entering
    for k in local:
        assert torch.equal(local[k], torchs[k]), (k, local[k], torchs[k])
    assert len(positions) == SEQ // cp  # each host read 1/cp of every sequence
    # Read back: head_tail_order(inverse=True) restores the order of the replicated value.
    with mesh:
        replicated = ts.replicate_to_local_data(batch)["tokens"]
    restore = ts.head_tail_order(SEQ, cp, inverse=True)
    shards = [range(BATCH)[s :: config["num_shards"]] for s in range(config["num_shards"])]
    assert torch.equal(replicated[:, restore], TOKENS[[r for s in shards for r in s]])
    if dist.get_rank() == 0:
        print(
            f"context_parallel: {world} processes on (dp={dp}, cp={cp}), {SEQ} tokens: every "
            "rank's tokens, labels and positions equal torch's context_parallel shard"
        )
    oracle = packed(dm, mesh, partition, cp)
    if dist.get_rank() == 0:
        print(
            f"context_parallel: packed rows of {PACKED_SEQ}, per_document and ptrr: every "
            f"rank's tokens, segment ids and positions equal {oracle}, and no query "
            "sees a key of another document"
        )
    dist.destroy_process_group()


PACKED_SEQ, PACKED_ROWS, BLOCK = 64, 2, 8
LEAVES = ("tokens", "segment_ids", "positions")


def documents(shard, count):
    """The documents of dp shard ``shard``: lengths 1-30, token d * 100 + i."""
    lengths = [1 + (7 * d + 3) % 30 for d in range(40)]
    return [100 * d + np.arange(n) for d, n in enumerate(lengths)][shard::count]


def document_causal(ids):
    """FlexAttention's mask_mod of rows of segment ids: the same run (document), kv <= q."""
    doc = torch.tensor(np.cumsum(np.diff(ids, prepend=-1, axis=1) != 0, axis=1))

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (doc[b, q] == doc[b, kv])

    return mask_mod


def packed(dm, mesh, partition, cp):
    """Packed rows under per_document and ptrr: torch's shard, and the document mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    config = ts.feed_read_config(partition, mesh=mesh)
    docs = documents(config["shard_index"], config["num_shards"])
    packer = ts.data.Packer(docs, seq_len=PACKED_SEQ, rows=PACKED_ROWS, pad_to_multiple_of=2 * cp)
    oracle = "the reference's shard (rows indexed by context_parallel_order)"
    for balancer in ("per_document", "ptrr"):
        # --- docs/stacks.md: context-parallel-packed
        rows = next(iter(packer))  # every cp rank of a dp shard packs the same rows
        positions = ts.context_parallel_positions(
            partition,
            PACKED_SEQ,
            mesh=mesh,
            balancer=balancer,  # or "ptrr"
            segment_ids=rows["segment_ids"],
            block_size=BLOCK,
        )  # each row's positions this host reads, [rows, seq_len / cp]
        host = {k: np.take_along_axis(rows[k], positions, axis=1) for k in LEAVES}
        with mesh:
            batch = ts.host_to_global_array(host, partition=partition)
        local = ts.to_local(batch)  # each rank builds its document mask from these
        # --- end
        ids = rows["segment_ids"]
        whole = [torch.from_numpy(rows[k].astype(np.int64)) for k in LEAVES]
        if balancer == "per_document":
            lengths = [
                np.diff(np.flatnonzero(np.diff(r, prepend=-1, append=-1))).tolist() for r in ids
            ]
            torchs = document_load_balancer(balancer, cp, lengths=lengths)
        else:
            block_mask = create_block_mask(
                document_causal(ids), len(ids), 1, PACKED_SEQ, PACKED_SEQ, device="cpu",
                BLOCK_SIZE=BLOCK,
            )  # fmt: skip
            torchs = document_load_balancer(balancer, cp, block_mask=block_mask)
        if torchs is not None:  # torch >= 2.13: torch's balancer and _context_parallel_shard
            expected = context_parallel_shard(dm["cp"], whole, [1, 1, 1], torchs)
            oracle = "torch's balancers' shard"
        else:
            orders = [
                ts.context_parallel_order(r, cp, balancer=balancer, block_size=BLOCK) for r in ids
            ]
            rank, part = dm["cp"].get_local_rank(), PACKED_SEQ // cp
            mine = np.asarray(orders)[:, rank * part : (rank + 1) * part]
            expected = [torch.from_numpy(np.take_along_axis(x.numpy(), mine, 1)) for x in whole]
        for k, want in zip(LEAVES, expected, strict=True):
            assert torch.equal(local[k].long(), want.long()), (balancer, k, local[k], want)
        check_mask(local, mesh, batch, rows, positions, balancer, cp)
    return oracle


def check_mask(local, mesh, batch, rows, positions, balancer, cp):
    """The document mask of this rank's queries against every key, built from segment ids and
    positions as a step would, lets no query see a key of another document and keeps every
    causal pair of one (checked against the documents the rows were packed from)."""
    with mesh:
        keys = ts.replicate_to_local_data(batch)  # every key, in the layout's order
    first = ts.feed_read_config(ts.P("dp", "cp"), mesh=mesh)["shard_index"] * PACKED_ROWS
    ids = rows["segment_ids"]
    doc = np.cumsum(np.diff(ids, prepend=-1, axis=1) != 0, axis=1)  # the packed documents
    for r in range(PACKED_ROWS):
        q_seg, q_pos = local["segment_ids"][r].numpy(), local["positions"][r].numpy()
        k_seg, k_pos = keys["segment_ids"][first + r].numpy(), keys["positions"][first + r].numpy()
        mask = (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        order = ts.context_parallel_order(ids[r], cp, balancer=balancer, block_size=BLOCK)
        q_at, k_at = positions[r], np.asarray(order)  # where each query and key was packed
        same = doc[r][q_at][:, None] == doc[r][k_at][None, :]
        assert not (mask & ~same).any(), "a query sees a key of another document"
        real = q_seg != 0  # padding (positions all 0) may see all padding: it carries no loss
        causal = same & (k_at[None, :] <= q_at[:, None])
        assert (mask[real] == causal[real]).all(), "a pair of one document was lost"


if __name__ == "__main__":
    main()
