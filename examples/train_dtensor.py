"""Data-parallel training on torch.distributed DTensor: a GlobalBatchLoader feeding DDP.

Every process runs this script (one process per device; gloo on the CPU, nccl on GPUs). Each
feeds its own block of the batch from a DataLoader; the loader turns the blocks into DTensors
split over the "data" axis, and the step takes this process's rows with ``.to_local()``.

Run: torchrun --standalone --nproc-per-node 2 examples/train_dtensor.py
"""

import gc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import torchshard as ts

STEPS_PER_EPOCH, EPOCHS, GLOBAL_BATCH = 32, 3, 64


def dataset() -> TensorDataset:
    """A separable 4-class problem, the same on every process (seeded)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * GLOBAL_BATCH, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial parameters on every process
    # Without torch_xla (or with it, once the process group exists) the mesh is DTensor's.
    mesh = ts.create_device_mesh((world,), ("data",))
    data = dataset()
    with mesh:  # the feed from the mesh: each process reads the shard of the rows it holds
        sampler = ts.host_sampler(data, ts.P("data"))
    source = DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    with mesh, ts.GlobalBatchLoader(source) as loader:
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:  # DTensors: dim 0 split over the processes
                assert tuple(x.shape) == (GLOBAL_BATCH, 16)
                loss = torch.nn.functional.cross_entropy(model(x.to_local()), y.to_local())
                optimizer.zero_grad()
                loss.backward()  # DDP averages the gradients over the processes
                optimizer.step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / world)
    stats = loader.stats
    if rank == 0:
        print(
            f"{world} processes, mesh {dict(mesh.shape)}, {len(losses)} steps of "
            f"{GLOBAL_BATCH} rows: loss {losses[0]:.3f} -> {losses[-1]:.3f}; input wait "
            f"{stats.input_wait_fraction:.1%} of step time after each epoch's first batch"
        )
    assert losses[-1] < 0.5 * losses[0], losses
    # DDP's reducer holds the process group: free it first, or gloo may abort at exit
    # (pytorch/pytorch#190489).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
