"""Lightning DDP on CPU (gloo), fed by torchshard, two epochs; run with
``torchrun --nproc_per_node=2 examples/stacks/lightning_ddp.py``.

The same training is run twice: fed Lightning's own way (a DataLoader, into which Lightning
puts a DistributedSampler) and by a ``GlobalBatchLoader(..., local=True)`` over
``host_sampler(data, P("dp"))`` (``torchshard_loader``, between the markers: the block in
docs/stacks.md). Lightning calls ``set_epoch`` on ``loader.sampler`` each epoch, so the second
epoch has a new order, and the losses are equal bit for bit.
"""

import os

import lightning as L
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset

import torchshard as ts


class Examples(Dataset):
    def __init__(self, n):
        gen = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


# --- docs/stacks.md: lightning-ddp
def torchshard_loader(data):
    """What ``train_dataloader`` returns: Lightning passes it through (it is no DataLoader, so
    no DistributedSampler goes in) and calls ``set_epoch`` on ``loader.sampler`` each epoch."""
    world = torch.distributed.get_world_size()  # Lightning's DDP has started the group
    mesh = ts.Mesh.from_device_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    with mesh:
        sampler = ts.host_sampler(data, ts.P("dp"), shuffle=True, drop_last=False)
    source = DataLoader(data, batch_size=2, sampler=sampler)
    return ts.GlobalBatchLoader(source, partition=ts.P("dp"), mesh=mesh, local=True)


# --- end


class Model(L.LightningModule):
    def __init__(self, feed):
        super().__init__()
        self.feed, self.data = feed, Examples(16)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.losses, self.firsts = [], []

    def train_dataloader(self):
        if self.feed == "lightning":  # Lightning shards it with its DistributedSampler
            return DataLoader(self.data, batch_size=2, shuffle=True)
        return torchshard_loader(self.data)

    def training_step(self, batch, i):
        if i == 0:
            self.firsts.append(batch["x"].clone())
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(feed):
    torch.manual_seed(0)
    model = Model(feed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.environ.get("TORCHSHARD_EXAMPLE_DIR", "."),
    )
    trainer.fit(model)
    return model


theirs, ours = run("lightning"), run("torchshard")
rank = torch.distributed.get_rank()
assert len(ours.losses) == len(theirs.losses) == 8, (len(ours.losses), len(theirs.losses))
assert torch.equal(torch.stack(ours.losses), torch.stack(theirs.losses)), (
    ours.losses,
    theirs.losses,
)
assert len(ours.firsts) == 2 and not torch.equal(ours.firsts[0], ours.firsts[1])
line = (
    f"lightning_ddp rank {rank}: 2 epochs, new order each epoch, losses equal to Lightning's feed"
)
print(line + "\n", end="", flush=True)  # one write (atomic on a pipe): the ranks' lines never mix
