"""accelerate on CPU (gloo, DDP), fed by torchshard, two epochs; run with
``torchrun --standalone --nproc-per-node 2 examples/stacks/accelerate_ddp.py``.

The same training runs twice: fed accelerate's own way (``accelerator.prepare`` of a
DataLoader over the whole dataset, which accelerate shards) and by a
``GlobalBatchLoader(..., local=True)`` over ``host_sampler(data, P("dp"))`` passed through
``torchshard.integrations.accelerate.prepare`` (the block between the markers is the one in
docs/stacks.md). Both shuffle with the same seed, so every step trains on the same 4 examples
and the second epoch has a new order. The inner DataLoader is refused, as accelerate would
shard it again, and so is a stream split per process by ``stream_shard``, which accelerate
would read as a whole one.
"""

import gc

import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset, IterableDataset

import torchshard as ts
from torchshard.integrations.accelerate import prepare


class Examples(Dataset):
    """16 regression examples ``{"x": [4], "y": [1], "i": index}``, the same everywhere."""

    def __init__(self, n=16):
        gen = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "i": i}


class Halves(IterableDataset):
    """A stream split per process by ``torchshard.stream_shard`` (each reads its own half)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __iter__(self):
        index, count = ts.stream_shard(mesh=self.mesh)
        yield from ({"i": i} for i in range(index, 16, count))


def mlp():
    """The same initial parameters on every process and for both feeds."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def train(accelerator, model, opt, loader):
    """Two epochs; per step, the loss averaged over the processes and the examples used."""
    losses, examples = [], []
    for epoch in range(2):
        loader.set_epoch(epoch)  # accelerate's: its sampler; torchshard's: host_sampler
        for batch in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)  # DDP: the gradients averaged over the processes
            opt.step()
            losses.append(accelerator.reduce(loss.detach().clone(), reduction="mean"))
            examples.append(accelerator.gather(batch["i"]).sort().values)
    return torch.stack(losses), examples


def fed_by_accelerate(accelerator, data):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    whole = DataLoader(data, batch_size=2, shuffle=True)  # accelerate shards it
    return train(accelerator, *accelerator.prepare(model, opt, whole))


def fed_by_torchshard(accelerator, data):
    # --- docs/stacks.md: accelerate-ddp
    dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    mesh = ts.Mesh.from_device_mesh(dm)
    with mesh:
        sampler = ts.host_sampler(data, ts.P("dp"), seed=3)  # accelerate's data_seed
    source = DataLoader(data, batch_size=2, sampler=sampler)
    loader = ts.GlobalBatchLoader(source, partition=ts.P("dp"), mesh=mesh, local=True)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = prepare(accelerator, model, opt, loader)  # integrations.accelerate's
    # --- end
    try:  # the DataLoader inside is refused: accelerate would split this process's shard
        prepare(accelerator, source)
        raise AssertionError("prepare took a DataLoader already on host_sampler")
    except ValueError as e:
        assert "is a DataLoader that already reads shard" in str(e), e
    try:  # so is a stream: accelerate would hand process 0's half of a split stream to both
        prepare(accelerator, DataLoader(Halves(mesh), batch_size=2))
        raise AssertionError("prepare took a stream split by stream_shard")
    except ValueError as e:
        world = dist.get_world_size()
        assert f"is a DataLoader over a stream (Halves, an IterableDataset) on {world}" in str(e)
    with loader:
        return train(accelerator, model, opt, loader)


def main():
    # use_seedable_sampler: accelerate shuffles with randperm(seed + epoch), as host_sampler.
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=3)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    data, world = Examples(), accelerator.num_processes
    theirs, their_examples = fed_by_accelerate(accelerator, data)
    ours, our_examples = fed_by_torchshard(accelerator, data)
    steps = 2 * len(data) // (2 * world)
    assert len(ours) == len(theirs) == steps, (len(ours), len(theirs))
    # Every step trains on the same examples; the second epoch in a new order.
    assert all(map(torch.equal, our_examples, their_examples)), (our_examples, their_examples)
    assert not torch.equal(our_examples[0], our_examples[steps // 2]), our_examples
    # Not bit for bit: accelerate gives rank r whole consecutive batches of its batch sampler
    # (examples 4k..4k+1 and 4k+2..4k+3 of step k), host_sampler strides as DistributedSampler
    # does (4k, 4k+2 and 4k+1, 4k+3), so DDP averages the same examples' gradients split
    # differently over the processes: the sums are rounded in another order.
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)
    if accelerator.is_main_process:
        print(
            f"accelerate_ddp: {world} processes, DDP, {steps} steps over 2 epochs: the examples "
            "of every step equal accelerate's feed, losses within float rounding"
        )
    # The models died with their functions; a cycle may keep DDP's reducer (or FSDP's
    # state), which holds the process group: free it first, or gloo may abort at exit
    # (pytorch/pytorch#190489).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
