"""FSDP2 and DDP on CPU (gloo), fed by torchshard; run with
``torchrun --standalone --nproc-per-node 2 examples/stacks/fsdp2_ddp.py`` (or 4 processes).

Each wrapper (``fully_shard`` on a 1-D dp mesh, ``DistributedDataParallel``) trains the same
MLP twice, two epochs: fed by a ``GlobalBatchLoader(..., local=True)`` over
``host_sampler(dataset, P("dp"))`` (the block between the markers is the one in
docs/stacks.md), and fed the stack's own way, a ``DistributedSampler`` per rank. The losses of
every step are equal bit for bit, and the second epoch has a new order.
"""

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import torchshard as ts


class Examples(Dataset):
    """16 regression examples ``{"x": [4], "y": [1]}``, the same on every process."""

    def __init__(self, n=16):
        gen = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def mlp():
    """The same initial parameters on every process and for both feeds."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def wrap(model, dm, wrapper):
    """FSDP2 (parameters sharded over dp) or DDP (replicated, gradients averaged)."""
    return fully_shard(model, mesh=dm) if wrapper == "fsdp2" else DistributedDataParallel(model)


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


def fed_by_torchshard(dataset, wrapper):
    # --- docs/stacks.md: fsdp2-ddp
    dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    mesh = ts.Mesh.from_device_mesh(dm)
    model = wrap(mlp(), dm, wrapper)  # fully_shard(model, mesh=dm) or DistributedDataParallel
    step, losses = trainer(model)  # step(x, y): forward, loss, backward, optimizer step
    with mesh:
        sampler = ts.host_sampler(dataset, ts.P("dp"), seed=3)
    source = DataLoader(dataset, batch_size=2, sampler=sampler)
    with mesh, ts.GlobalBatchLoader(source, partition=ts.P("dp"), local=True) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)  # reaches the sampler: a new order per epoch
            for batch in loader:  # plain tensors: this process's rows
                step(batch["x"], batch["y"])
    # --- end
    return losses, list(sampler)  # the last epoch's order of this shard


def fed_by_distributed_sampler(dataset, wrapper):
    dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    step, losses = trainer(wrap(mlp(), dm, wrapper))
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)  # rank and world: the group's
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in DataLoader(dataset, batch_size=2, sampler=sampler):
            step(batch["x"], batch["y"])
    return losses, list(sampler)


def main():
    dist.init_process_group("gloo")
    dataset, world = Examples(), dist.get_world_size()
    for wrapper in ("fsdp2", "ddp"):
        ours, order = fed_by_torchshard(dataset, wrapper)
        theirs, their_order = fed_by_distributed_sampler(dataset, wrapper)
        steps = 2 * len(dataset) // (2 * world)
        assert len(ours) == len(theirs) == steps, (wrapper, len(ours), len(theirs))
        assert torch.equal(torch.stack(ours), torch.stack(theirs)), (wrapper, ours, theirs)
        first = DistributedSampler(dataset, shuffle=True, seed=3)  # epoch 0
        assert order == their_order != list(first), f"{wrapper}: epoch 1 has not a new order"
    if dist.get_rank() == 0:
        print(
            f"fsdp2_ddp: {world} processes, FSDP2 and DDP, {steps} steps over 2 epochs each: "
            "losses equal to a DistributedSampler feed"
        )
    # The models died with their functions; a cycle may keep DDP's reducer (or FSDP's
    # state), which holds the process group: free it first, or gloo may abort at exit
    # (pytorch/pytorch#190489).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
