"""Cases for ``torchshard.integrations.grain`` on real gloo processes (``_multiproc.py``): a
``GlobalBatchLoader`` over grain's ``ElasticIterator`` (``elastic_iterator``) saved with
torch.distributed.checkpoint on one number of processes and resumed on another. Run as
``"_grain_cases:<case>"``; grain's own ``ElasticIterator`` is the oracle."""

from __future__ import annotations

from typing import Any

N = 48
GLOBAL_BATCH = 8


def _setup() -> tuple[Any, Any, Any]:
    import grain
    import numpy as np
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torchshard as ts

    world = dist.get_world_size()
    mesh = ts.Mesh.from_device_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    rows = grain.MapDataset.range(N).map(lambda i: {"id": np.int64(i)})
    return ts, mesh, rows


def _loader(ts: Any, mesh: Any, rows: Any) -> Any:
    from torchshard.integrations.grain import elastic_iterator

    with mesh:
        source = elastic_iterator(rows, GLOBAL_BATCH, ts.P("dp"))
    return ts.GlobalBatchLoader(source, partition=ts.P("dp"), mesh=mesh, local=True)


def elastic_save(path: str, steps: int) -> dict[str, Any]:
    """``steps`` global batches on this world, then ``dcp.save({"loader": loader})``."""
    import torch.distributed.checkpoint as dcp

    ts, mesh, rows = _setup()
    loader = _loader(ts, mesh, rows)
    it = iter(loader)
    taken = [next(it)["id"].tolist() for _ in range(steps)]
    dcp.save({"loader": loader}, checkpoint_id=path)
    loader.close()
    return {"taken": [i for b in taken for i in b], "state": loader.state_dict()["common"]}


def elastic_resume(path: str, index: int) -> dict[str, Any]:
    """A loader on this world resumed with ``dcp.load`` (``allow_partial_load``: the saving
    processes' other keys are not this world's); the rest, and what grain's own
    ``ElasticIterator`` on this world's shards reads from the saved global ``index``."""
    import grain
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    ts, mesh, rows = _setup()
    loader = _loader(ts, mesh, rows)
    dcp.load(
        {"loader": loader}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    rest = [i for b in loader for i in b["id"].tolist()]
    rank, world = dist.get_rank(), dist.get_world_size()
    own = grain.experimental.ElasticIterator(
        rows, GLOBAL_BATCH, grain.sharding.ShardOptions(rank, world, True)
    )
    own.set_state({"global_next_index": index})
    oracle = [i for b in own for i in b["id"].tolist()]
    return {"rest": rest, "oracle": oracle}
