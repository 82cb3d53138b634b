"""Context parallel sharding on CPU (gloo), fed by torchshard; run with
``torchrun --standalone --nproc-per-node 2 examples/stacks/context_parallel.py`` (cp=2; with 4
processes, dp=2 x cp=2).

torch's ``context_parallel`` balances a sequence head to tail (``torchshard.head_tail_order``).
Fed by torchshard (the block between the markers is the one in docs/stacks.md), each process
reads its dp shard's rows and only its cp part of each sequence; fed torch's way, every cp
rank holds the whole rows and ``context_parallel(dm["cp"], buffers=...)`` shards them. Every
rank's block of tokens, labels and positions is equal. CP training does not run on CPU (its
SDPA has no CPU kernel), so the check is the sharding, not a loss.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

import torchshard as ts

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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
