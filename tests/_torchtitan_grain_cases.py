"""Cases for ``torchshard.integrations.torchtitan.grain_dataloader`` (torchtitan main's grain
loader protocol) on real gloo processes (``_multiproc.py``), run as
``"_torchtitan_grain_cases:<case>"``. grain's own ``ElasticIterator`` on each dp rank's shard
is the oracle: what torchtitan's loader would read there, without torchshard."""

from __future__ import annotations

from typing import Any

GLOBAL_BATCH = 4


def _setup(n: int) -> tuple[Any, Any, Any]:
    import grain
    import numpy as np
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torchshard as ts

    world = dist.get_world_size()
    mesh = ts.Mesh.from_device_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))

    def pair(i: Any) -> Any:  # torchtitan's sample: (input_dict, labels)
        return {"input": np.full((3,), i, np.int64)}, np.full((3,), i + 1, np.int64)

    rows = grain.MapDataset.range(n).map(pair)
    return ts, mesh, rows


def _ids(batch: Any) -> list[int]:
    return batch[0]["input"][:, 0].tolist()


def _own(rows: Any, index: int = 0) -> list[list[int]]:
    """grain's own ElasticIterator on this rank's shard of this world, from ``index``."""
    import grain
    import torch.distributed as dist

    own = grain.experimental.ElasticIterator(
        rows,
        GLOBAL_BATCH,
        grain.sharding.ShardOptions(dist.get_rank(), dist.get_world_size(), True),
    )
    own.set_state({"global_next_index": index})
    return [b[0]["input"][:, 0].tolist() for b in own]


def finite(n: int, last_batch: str) -> dict[str, Any]:
    """Every batch of a finite pipeline of ``n`` samples, and grain's own batches per rank."""
    import torch

    from torchshard.integrations.torchtitan import grain_dataloader

    _, mesh, rows = _setup(n)
    loader = grain_dataloader(
        rows, global_batch_size=GLOBAL_BATCH, mesh=mesh, last_batch=last_batch
    )
    got, masks, kinds = [], [], set()
    for item in loader:
        batch = item[0] if last_batch == "pad" else item
        if last_batch == "pad":
            masks.append(item[1].tolist())
        kinds.add((type(batch[0]["input"]).__name__, type(batch[1]).__name__))
        got.append(_ids(batch))
        assert torch.equal(batch[1], batch[0]["input"] + 1) or last_batch == "pad"
    loader.close()
    return {
        "got": got,
        "masks": masks,
        "own": _own(rows),
        "kinds": sorted(kinds),
        "dp": (loader.dp_rank, loader.dp_world_size, loader.batch_size),
    }


def save(path: str, n: int, steps: int) -> dict[str, Any]:
    """``steps`` batches, then ``dcp.save({"dataloader": loader})`` as torchtitan's
    checkpointer saves it; the state's keys."""
    import torch.distributed.checkpoint as dcp

    from torchshard.integrations.torchtitan import grain_dataloader

    _, mesh, rows = _setup(n)
    loader = grain_dataloader(rows, global_batch_size=GLOBAL_BATCH, mesh=mesh)
    it = iter(loader)
    taken = [_ids(next(it)) for _ in range(steps)]
    state = loader.state_dict()
    dcp.save({"dataloader": loader}, checkpoint_id=path)
    loader.close()
    return {"taken": taken, "keys": sorted(state), "state": state}


def resume(n: int, index: int, path: str | None = None, state: Any = None) -> dict[str, Any]:
    """A fresh loader on this world resumed with ``dcp.load`` from ``path`` (or from
    ``state``, a dict as ``state_dict()`` gave it); the rest, and grain's own from ``index``."""
    import torch.distributed.checkpoint as dcp

    from torchshard.integrations.torchtitan import grain_dataloader

    _, mesh, rows = _setup(n)
    loader = grain_dataloader(rows, global_batch_size=GLOBAL_BATCH, mesh=mesh)
    if path is not None:
        dcp.load({"dataloader": loader}, checkpoint_id=path)
    else:
        loader.load_state_dict(state)
    rest = [_ids(b) for b in loader]
    loader.close()
    return {"rest": rest, "own": _own(rows, index)}
