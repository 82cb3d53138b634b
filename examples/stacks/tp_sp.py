"""Tensor and sequence parallel on a (dp=2, tp=2) mesh on CPU (gloo), with FSDP2 over dp, fed
by torchshard; run with ``torchrun --standalone --nproc-per-node 4 examples/stacks/tp_sp.py``.

The MLP's layers are split over ``dm["tp"]`` (``parallelize_module``; SP: a LayerNorm under
``SequenceParallel`` first, the sequence split over tp). Fed by torchshard (the block between
the markers is the one in docs/stacks.md), the batch is made on the 2-D mesh, the tp peers
read the same rows (``host_sampler(dataset, P("dp"))``) and ``to_submesh`` re-homes it on the
sub-mesh the TP modules live on. Fed the stack's own way, a ``DistributedSampler`` over the dp
rows (each tp rank slicing its part of the sequence for SP). The losses are equal bit for bit.
"""

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import torchshard as ts

SEQ, WIDTH = 4, 6


class Examples(Dataset):
    """8 examples ``{"x": [WIDTH], "y": [1]}`` (SP: ``[SEQ, WIDTH]``, ``[SEQ, 1]``)."""

    def __init__(self, sp, n=8):
        gen = torch.Generator().manual_seed(7)
        shape, target = ((SEQ, WIDTH), (SEQ, 1)) if sp else ((WIDTH,), (1,))
        self.x = torch.randn(n, *shape, generator=gen)
        self.y = torch.randn(n, *target, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def mlp(sp):
    """The same initial parameters on every process and for both feeds."""
    torch.manual_seed(0)
    layers = [torch.nn.LayerNorm(WIDTH)] if sp else []
    layers += [torch.nn.Linear(WIDTH, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)]
    return torch.nn.Sequential(*layers)


def plan(sp):
    """TP: column- then row-wise; SP: the sequence (dim 1) split over tp around them."""
    if not sp:
        return {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1)),
    }


def trainer(model):
    """One SGD step per call; returns the list the losses go to."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())

    return step, losses


def fed_by_torchshard(dataset, sp):
    # --- docs/stacks.md: tp-sp
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = ts.Mesh.from_device_mesh(dm)
    model = parallelize_module(mlp(sp), dm["tp"], plan(sp))  # Colwise, Rowwise; SP: Sequence
    fully_shard(model, mesh=dm["dp"])  # FSDP2 over dp, optional
    step, losses = trainer(model)  # step(x, y): forward, loss, backward, optimizer step
    partition = ts.P("dp", "tp") if sp else ts.P("dp")  # SP: the sequence over tp
    with mesh:
        sampler = ts.host_sampler(dataset, partition, seed=5)  # the tp peers read the same rows
    for rows in DataLoader(dataset, batch_size=2, sampler=sampler):
        if sp:  # each process reads its part of every sequence
            cut = ts.feed_slices(partition, (4, SEQ, WIDTH), mesh=mesh)[1]
            rows = {k: v[:, cut] for k, v in rows.items()}
        with mesh:
            batch = ts.host_to_global_array(rows, partition=partition)
        x = ts.to_submesh(batch["x"], dm["tp"])  # Replicate() on tp; SP: Shard(1)
        step(x, ts.to_local(batch["y"]))
    # --- end
    return losses


def fed_by_distributed_sampler(dataset, sp):
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(mlp(sp), dm["tp"], plan(sp))
    fully_shard(model, mesh=dm["dp"])
    step, losses = trainer(model)
    dp_rank, tp_rank = dm.get_coordinate()
    sampler = DistributedSampler(dataset, num_replicas=2, rank=dp_rank, shuffle=True, seed=5)
    part = slice(tp_rank * SEQ // 2, (tp_rank + 1) * SEQ // 2)
    for rows in DataLoader(dataset, batch_size=2, sampler=sampler):
        if sp:  # SequenceParallel takes a plain input as this rank's part of the sequence
            rows = {k: v[:, part] for k, v in rows.items()}
        step(rows["x"], rows["y"])
    return losses


def main():
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 4, "run with torchrun --nproc-per-node 4"
    for sp in (False, True):
        dataset = Examples(sp)
        ours, theirs = fed_by_torchshard(dataset, sp), fed_by_distributed_sampler(dataset, sp)
        assert len(ours) == len(theirs) == 2, (sp, len(ours), len(theirs))
        assert torch.equal(torch.stack(ours), torch.stack(theirs)), (sp, ours, theirs)
    if dist.get_rank() == 0:
        print(
            "tp_sp: 4 processes on (dp=2, tp=2), TP and SP with FSDP2 over dp, 2 steps each: "
            "losses equal to a DistributedSampler feed"
        )
    # The models died with their functions; a cycle may keep DDP's reducer (or FSDP's
    # state), which holds the process group: free it first, or gloo may abort at exit
    # (pytorch/pytorch#190489).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
