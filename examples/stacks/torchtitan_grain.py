"""torchtitan main's grain loader protocol on CPU (gloo, FSDP2 over dp 2), with torchshard as
its distributed layer; run with
``torchrun --standalone --nproc-per-node 2 examples/stacks/torchtitan_grain.py``.

torchtitan's main branch feeds from a grain pipeline (``GrainDataLoader``) and refuses finite
data (``repeat=False``) with more than one dp rank: grain's shards of 23 samples in global
batches of 4 give rank 0 six batches and rank 1 five, and rank 0's sixth step would wait in
FSDP2's collectives for ever. ``grain_dataloader`` reads the same map-style pipeline through
grain's ``ElasticIterator`` on each rank's feed and stops every rank after the same step. The
oracle is grain's own ``ElasticIterator`` on each rank's shard: the batches are its first
five, and a loader saved after step 2 with torch.distributed.checkpoint (torchtitan's
checkpointer, its state layout ``version``/``dp_world_size``/``dp_rank_<r>``) and loaded into a
fresh one continues with exactly its batches 3 to 5.
"""

import shutil
import tempfile

import grain
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torchshard as ts
from torchshard.integrations.torchtitan import grain_dataloader


def sample(i):
    """torchtitan's sample: ``(input_dict, labels)`` of fixed shapes."""
    x = np.random.default_rng(int(i)).standard_normal(4).astype(np.float32)
    return {"input": x, "id": np.int64(i)}, x[:1] * 2


def trainer(dm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    fully_shard(model, mesh=dm)  # every step runs FSDP2's collectives on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = []

    def train_step(inputs, labels):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(inputs["input"]), labels).backward()
        opt.step()
        ids.append(inputs["id"].tolist())

    return train_step, ids


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dm = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
mesh = ts.Mesh.from_device_mesh(dm)
train_step, ids = trainer(dm)
path = tempfile.mkdtemp() if rank == 0 else None
objects = [path]
dist.broadcast_object_list(objects)
path = objects[0]

# --- docs/stacks.md: torchtitan-grain
rows = grain.MapDataset.range(23).shuffle(seed=3).map(sample)  # not sliced per dp rank
loader = grain_dataloader(rows, global_batch_size=4, mesh=mesh)  # or parallel_dims=
for step, (inputs, labels) in enumerate(loader):  # every dp rank stops after the same step
    train_step(inputs, labels)
    if step == 1:
        dcp.save({"dataloader": loader}, checkpoint_id=path)  # torchtitan's checkpointer
# --- end

own = grain.experimental.ElasticIterator(rows, 4, grain.sharding.ShardOptions(rank, world, True))
theirs = [b[0]["id"].tolist() for b in own]  # what grain alone gives this rank
assert len(theirs) == [6, 5][rank], (rank, theirs)  # uneven: without torchshard, a hang
assert ids == theirs[:5], (rank, ids, theirs)

resumed = grain_dataloader(rows, global_batch_size=4, mesh=mesh)
dcp.load({"dataloader": resumed}, checkpoint_id=path)
rest = [inputs["id"].tolist() for inputs, _ in resumed]
assert rest == theirs[2:5], (rank, rest, theirs)
assert sorted(resumed.state_dict()) == sorted(["version", "dp_world_size", f"dp_rank_{rank}"])
dist.barrier()
if rank == 0:
    shutil.rmtree(path, ignore_errors=True)
    print(
        "torchtitan_grain: 2 processes, FSDP2, 23 samples: every rank stopped after step 5 "
        "(grain alone: 6 and 5); resumed from dcp with grain's own batches",
        flush=True,
    )
dist.destroy_process_group()
