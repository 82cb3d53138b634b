"""Lightning's mid-epoch resume on 2 processes (DDP on CPU, gloo), fed by torchshard; run with
``torchrun --nproc_per_node=2 examples/stacks/lightning_resume.py``.

Lightning keeps one checkpoint file, written by rank 0, so the loader state in it is rank 0's
alone; on resume every rank loads that one. A ``GlobalBatchLoader`` over
``host_sampler(data, P("dp"))`` keeps the epoch's global position (epoch, examples consumed) in
its common entry, so rank 1 resumes from it: its own stride of the order, from the next step.

The oracle is Lightning's own ``Trainer``: one run of 2 epochs uninterrupted, and the same
training stopped mid-epoch (``max_steps=3`` of 4 an epoch), saved by Lightning's
``ModelCheckpoint`` after step 3 and resumed with ``trainer.fit(model, ckpt_path=...)`` in a fresh
``Trainer`` and a fresh model: every rank sees exactly the examples of the uninterrupted run, in
its order, each once, and the losses are equal bit for bit.
"""

import os
import pathlib

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
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
        return {"x": self.x[i], "y": self.y[i], "id": torch.tensor(i)}


def torchshard_loader(data):
    """The loader of docs/stacks.md's Lightning section (``examples/stacks/lightning_ddp.py``)."""
    world = torch.distributed.get_world_size()
    mesh = ts.Mesh.from_device_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    with mesh:
        sampler = ts.host_sampler(data, ts.P("dp"), shuffle=True, drop_last=False)
    source = DataLoader(data, batch_size=2, sampler=sampler)
    return ts.GlobalBatchLoader(source, partition=ts.P("dp"), mesh=mesh, local=True)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.data = Examples(16)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.seen, self.losses = [], []  # (epoch, this rank's example ids) per step

    def train_dataloader(self):
        return torchshard_loader(self.data)

    def training_step(self, batch, i):
        self.seen.append((self.current_epoch, batch["id"].tolist()))
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(**kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.environ.get("TORCHSHARD_EXAMPLE_DIR", "."),
        **kwargs,
    )


out = pathlib.Path(os.environ.get("TORCHSHARD_EXAMPLE_DIR", "."))
whole = Model()
trainer(max_epochs=2).fit(whole)  # the oracle: 2 epochs of 4 steps, uninterrupted

# --- docs/stacks.md: lightning-resume
first = Model()
every3 = ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=3, save_top_k=-1)
stopped = trainer(max_epochs=2, max_steps=3, callbacks=[every3], enable_checkpointing=True)
stopped.fit(first)  # a job stopped mid-epoch 0, one step before its end
ckpt = out / "mid.ckpt"  # one file, written by rank 0 after step 3: its loader state only

resumed = Model()  # a fresh model and Trainer, as a restarted job has
trainer(max_epochs=2).fit(resumed, ckpt_path=ckpt)  # every rank from the step after 3
# --- end

rank = torch.distributed.get_rank()
assert len(whole.seen) == 8 and len(first.seen) == 3, (whole.seen, first.seen)
assert first.seen + resumed.seen == whole.seen, (rank, first.seen, resumed.seen, whole.seen)
assert torch.equal(torch.stack(first.losses + resumed.losses), torch.stack(whole.losses))
every = [None] * torch.distributed.get_world_size()
torch.distributed.all_gather_object(every, first.seen + resumed.seen)
for epoch in range(2):  # the ranks' examples of each epoch: all 16, each once
    ids = sorted(i for seen in every for e, step in seen if e == epoch for i in step)
    assert ids == list(range(16)), (epoch, ids)
line = (
    f"lightning_resume rank {rank}: stopped after step 3, resumed from rank 0's checkpoint at "
    "step 4, every example of the uninterrupted run once, losses equal"
)
print(line + "\n", end="", flush=True)
