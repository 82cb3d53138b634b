"""torchtitan's data loading on CPU (gloo, FSDP2 over dp), fed by torchshard; run with
``torchrun --standalone --nproc-per-node 2 examples/stacks/torchtitan_dp.py``.

torchtitan's stock ``ParallelAwareDataloader`` (each dp rank reads its shard) is the stack's
own feed; ``torchshard.integrations.torchtitan.dataloader`` wraps it in a ``GlobalBatchLoader``
on the data-loading mesh of ``ParallelDims`` (the block between the markers is the one in
docs/stacks.md). The same model, trained on each, has equal losses bit for bit; and the
loader's state, saved mid-epoch with torch.distributed.checkpoint as torchtitan's checkpointer
does and loaded into a fresh loader, continues with exactly the batches the first would have
given. torchtitan's Trainer does not run on CPU (its meshes are on its device type, CUDA), so
only its data-loading interface is used.
"""

import gc
import shutil
import tempfile
import types

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset, DistributedSampler
from torchtitan.components.dataloader import ParallelAwareDataloader

from torchshard.integrations.torchtitan import dataloader


class Examples(Dataset):
    """16 ``(input_dict, labels)`` pairs, torchtitan's batch layout, the same everywhere."""

    def __init__(self, n=16):
        gen = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input": self.x[i]}, self.y[i]


def parallel_dims(world):
    """torchtitan's ParallelDims (dp only); its fields where it does not import (torchtitan
    0.3.0's needs spmd_types==0.2.3)."""
    try:
        from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError:
        return types.SimpleNamespace(
            dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, world_size=world
        )
    return ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world)


def stock_loader(data, batch_rank, batch_degree):
    """torchtitan's own feed, as in the block: this dp rank's shard, shuffled (seed 3), 2
    examples a batch."""
    sampler = DistributedSampler(data, num_replicas=batch_degree, rank=batch_rank, seed=3)
    return ParallelAwareDataloader(
        data, dp_rank=batch_rank, dp_world_size=batch_degree, batch_size=2, sampler=sampler
    )


def trainer(dm):
    """An MLP under FSDP2 on ``dm`` and one SGD step per call; returns the losses' list."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    fully_shard(model, mesh=dm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []

    def step(inputs, labels):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs["input"]), labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())

    return step, losses


def resumes_from_dcp(data, dims, batch_rank, batch_degree):
    """Saves the loader's state after 2 of its 4 batches (dcp.save, as torchtitan's
    checkpointer: one key per dp rank), loads it into a fresh loader (dcp.load) and checks that
    the fresh one yields the first one's remaining batches."""
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)  # one checkpoint folder for every process
    first = dataloader(stock_loader(data, batch_rank, batch_degree), parallel_dims=dims)
    batches = iter(first)
    taken = [next(batches), next(batches)]
    dcp.save({"dataloader": first}, checkpoint_id=path[0])
    rest = list(batches)
    fresh = dataloader(stock_loader(data, batch_rank, batch_degree), parallel_dims=dims)
    dcp.load({"dataloader": fresh}, checkpoint_id=path[0])
    resumed = list(fresh)
    assert len(taken) + len(resumed) == 4 and len(resumed) == len(rest), (len(taken), resumed)
    for (x, y), (x0, y0) in zip(resumed, rest, strict=True):
        assert torch.equal(x["input"], x0["input"]) and torch.equal(y, y0), (x, x0)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0])


def main():
    dist.init_process_group("gloo")
    data, world = Examples(), dist.get_world_size()
    dims = parallel_dims(world)
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    # torchtitan's trainer: parallel_dims.get_mesh("batch")'s local rank and size (pp=cp=tp=1)
    batch_rank, batch_degree = dist.get_rank(), world

    step, theirs = trainer(dm)
    for inputs, labels in stock_loader(data, batch_rank, batch_degree):
        step(inputs, labels)

    step, ours = trainer(dm)
    # --- docs/stacks.md: torchtitan-dp
    sampler = DistributedSampler(data, num_replicas=batch_degree, rank=batch_rank, seed=3)
    stock = ParallelAwareDataloader(  # torchtitan's own loader: this dp rank's shard
        data, dp_rank=batch_rank, dp_world_size=batch_degree, batch_size=2, sampler=sampler
    )
    loader = dataloader(stock, parallel_dims=dims)  # a torchtitan BaseDataLoader
    for inputs, labels in loader:  # plain tensors: this dp rank's rows
        step(inputs, labels)
    # --- end
    assert len(ours) == len(theirs) == len(data) // (2 * world), (len(ours), len(theirs))
    assert torch.equal(torch.stack(ours), torch.stack(theirs)), (ours, theirs)
    resumes_from_dcp(data, dims, batch_rank, batch_degree)
    if dist.get_rank() == 0:
        print(
            f"torchtitan_dp: {world} processes, FSDP2, {len(ours)} steps: losses equal to "
            "torchtitan's ParallelAwareDataloader; resumed from dcp with the same batches"
        )
    # The models died with their functions; a cycle may keep DDP's reducer (or FSDP's
    # state), which holds the process group: free it first, or gloo may abort at exit
    # (pytorch/pytorch#190489).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
