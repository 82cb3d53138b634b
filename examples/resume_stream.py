"""A stream of tar shards (webdataset-style) saved on one number of processes and resumed on
another: ``torchshard.data.sharded_stream`` records each shard's position, and the resumed job
splits the unfinished shards over its processes, each example once.

Run (the first command writes the shards and saves after 3 global batches, the second resumes
on 1 process and checks that the examples read before and after are every example once):

    torchrun --standalone --nproc-per-node 2 examples/resume_stream.py save /tmp/stream
    torchrun --standalone --nproc-per-node 1 examples/resume_stream.py resume /tmp/stream
"""

import io
import json
import pathlib
import sys
import tarfile
from collections.abc import Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

import torchshard as ts

SHARDS, GLOBAL_BATCH, SAVE_AFTER = 5, 4, 3
SIZES = [7, 4, 9, 5, 6]  # examples per tar: the feeds end unevenly


def write_shards(root: pathlib.Path) -> list[str]:
    """``SHARDS`` tar files of ``<key>.id`` members, as webdataset writes them."""
    names = []
    for s, size in enumerate(SIZES):
        name = root / f"shard-{s:04d}.tar"
        with tarfile.open(name, "w") as tar:
            for j in range(size):
                data = str(100 * s + j).encode()
                info = tarfile.TarInfo(f"{s:04d}{j:04d}.id")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        names.append(str(name))
    return names


def read_tar(name: str, start: int) -> Iterator[int]:
    """The examples of one tar from example ``start`` on (a resumed shard skips what was read)."""
    with tarfile.open(name) as tar:
        for k, member in enumerate(m for m in tar if m.isfile()):
            if k >= start:
                f = tar.extractfile(member)
                assert f is not None
                yield int(f.read())


def main(mode: str, root: pathlib.Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = ts.create_device_mesh((world,), ("data",))
    if mode == "save" and rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        write_shards(root)
    dist.barrier()
    shards = sorted(str(p) for p in root.glob("shard-*.tar"))
    with mesh:
        stream = ts.data.sharded_stream(
            shards, read_tar, ts.P("data"), batch_size=GLOBAL_BATCH // world
        )
    loader = ts.GlobalBatchLoader(stream, mesh=mesh, last_batch="pad")
    if mode == "resume":  # saved on any number of processes
        state = {"loader": loader}
        dcp.load(
            state,
            checkpoint_id=str(root / "ckpt"),
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
    ids = []
    for step, (batch, mask) in enumerate(loader):  # (batch, mask): the padding rows masked off
        full, keep = ts.replicate_to_local_data((batch, mask))
        ids += full[keep].tolist()
        if mode == "save" and step + 1 == SAVE_AFTER:
            dcp.save({"loader": loader}, checkpoint_id=str(root / "ckpt"))
            break
    loader.close()
    if rank == 0 and mode == "save":
        (root / "taken.json").write_text(json.dumps({"world": world, "ids": ids}))
        print(f"resume_stream: {world} processes read {len(ids)} examples, saved")
    if rank == 0 and mode == "resume":
        taken = json.loads((root / "taken.json").read_text())
        every = taken["ids"] + ids
        expected = [100 * s + j for s, size in enumerate(SIZES) for j in range(size)]
        assert sorted(every) == expected, (sorted(every), expected)
        print(
            f"resume_stream: saved on {taken['world']} processes after {len(taken['ids'])} "
            f"examples, resumed on {world}: {len(every)} examples, each once"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], pathlib.Path(sys.argv[2]))
