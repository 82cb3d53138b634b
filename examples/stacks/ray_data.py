"""Ray Data feeding a torchrun job through torchshard; run on a Ray cluster (its head's address):

    ray start --head --port 6379 --num-cpus 2      # the data node(s)
    torchrun --standalone --nproc-per-node 2 examples/stacks/ray_data.py --address 127.0.0.1:6379

(with ``RAY_AUTH_MODE=disabled`` in both environments on a cluster without authentication).
Each process joins the cluster; ``feed_split`` splits the dataset once per feed of the mesh
(``--tp 2``: the two processes of a dp row are tp peers, which read one split and get the same
rows), ``GlobalBatchLoader(..., last_batch="pad")`` ends every process together on the ragged
end, and the loader's state after 2 batches resumes a new loader exactly where it was. The
script checks that every row of the dataset came once per pass (gathered over the feeds), that
the tp peers read alike and that the resumed loader read the rest, then prints one line.
"""

import argparse

import ray
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import torchshard as ts
from torchshard.integrations.ray import feed_split

ROWS, BATCH = 50, 4


def rows(dataset_rows):
    """The dataset: ``ROWS`` rows, a few CPU-side transforms (on the Ray cluster)."""
    return dataset_rows.map_batches(lambda b: {"id": b["id"], "x": b["id"] * 0.5})


def read(loader, stop=None):
    """This process's real ids of each batch (the mask's rows), and the state after ``stop``."""
    ids, state = [], None
    for step, (batch, mask) in enumerate(loader):
        ids.append(batch["id"][mask].tolist())
        if step + 1 == stop:
            state = loader.state_dict()
    return ids, state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True, help="the Ray head, host:port")
    parser.add_argument("--tp", type=int, default=1, help="tp peers per dp row")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    world = dist.get_world_size()
    # --- docs/stacks.md: ray-data
    dm = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    mesh = ts.Mesh.from_device_mesh(dm)
    dataset = rows(ray.data.range(ROWS, override_num_blocks=5))  # preprocessed on Ray's nodes
    with mesh:  # one split per dp row: its tp peers read the same rows
        source = feed_split(dataset, ts.P("dp"), batch_size=BATCH, equal=False)
    loader = ts.GlobalBatchLoader(source, partition=ts.P("dp"), last_batch="pad", local=True)
    with mesh:
        for batch, mask in loader:  # the ragged end: padded rows have mask False
            x = batch["x"][mask]  # this process's real rows
    # --- end
    with mesh:
        ids, state = read(loader, stop=2)
        again = feed_split(dataset, ts.P("dp"), batch_size=BATCH, equal=False)
        resumed = ts.GlobalBatchLoader(again, partition=ts.P("dp"), last_batch="pad", local=True)
        resumed.load_state_dict(state)  # a new hub runs the dataset again, skipping 2 batches
        rest, _ = read(resumed)
    assert x.dtype == torch.float64
    assert rest == ids[2:], (rest, ids)
    mine = [i for b in ids for i in b]
    every = [None] * world
    dist.all_gather_object(every, mine)
    dp_rows = [every[r] for r in range(0, world, args.tp)]
    assert sorted(i for r in dp_rows for i in r) == list(range(ROWS)), dp_rows
    for r in range(world):  # the tp peers of a dp row read the same rows
        assert every[r] == every[r - r % args.tp]
    if dist.get_rank() == 0:
        print(
            f"ray_data: {world} processes on (dp={world // args.tp}, tp={args.tp}), {ROWS} rows in "
            f"batches of {BATCH} per feed: every row once per pass, tp peers alike, resumed "
            "after 2 batches with the rest"
        )
    ray.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
