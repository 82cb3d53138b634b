"""Cases for ``torchshard.integrations.ray`` on real gloo processes (``_multiproc.py``), each
process joining the local Ray cluster the test started (``address``): a ``GlobalBatchLoader``
over ``feed_split`` on a ``(dp, tp)`` mesh, its batches, masks and position, and a resume from
its state through a new hub. Run as ``"_ray_cases:<case>"``; the test compares what every rank
read with Ray's own ``streaming_split`` consumed directly (the oracle)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _join(address: str) -> Any:
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a second process joins a local cluster so
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    return ray


def _mesh(tp: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torchshard as ts

    world = dist.get_world_size()
    dm = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return ts.Mesh.from_device_mesh(dm)


def _read(loader: Any, stop: int | None = None) -> tuple[list[list[int]], list[list[bool]], Any]:
    """The ids and masks of each batch (this process's rows); with ``stop``, the state after
    that many batches too."""
    ids, masks, state = [], [], None
    for i, (batch, mask) in enumerate(loader):
        ids.append(np.asarray(batch["id"]).tolist())
        masks.append(np.asarray(mask).tolist())
        if stop is not None and i + 1 == stop:
            state = loader.state_dict()
    return ids, masks, state


def feeds(
    address: str, name: str, tp: int, rows: int, blocks: int, batch: int, equal: bool, stop: int
) -> dict[str, Any]:
    """One pass over ``ray.data.range(rows)`` through ``feed_split`` (``P("dp")``, ``last_batch=
    "pad"``, ``local=True``), the state after ``stop`` batches, and the rest read again by a new
    loader over a new hub (another ``name``) resumed from that state; then a second pass."""
    ray = _join(address)
    import torchshard as ts
    from torchshard.integrations.ray import feed_split

    mesh = _mesh(tp)
    dataset = ray.data.range(rows, override_num_blocks=blocks)
    with mesh:
        source = feed_split(dataset, ts.P("dp"), batch_size=batch, equal=equal, name=name)
    loader = ts.GlobalBatchLoader(
        source, partition=ts.P("dp"), mesh=mesh, last_batch="pad", local=True
    )
    ids, masks, state = _read(loader, stop)
    second, second_masks, _ = _read(loader)  # the next pass: the same rows
    loader.close()
    with mesh:
        again = feed_split(dataset, ts.P("dp"), batch_size=batch, equal=equal, name=name + "-b")
    resumed = ts.GlobalBatchLoader(
        again, partition=ts.P("dp"), mesh=mesh, last_batch="pad", local=True
    )
    resumed.load_state_dict(state)
    rest, rest_masks, _ = _read(resumed)
    resumed.close()
    ray.shutdown()
    return {
        "feed": source.feed,
        "feeds": source.num_feeds,
        "ids": ids,
        "masks": masks,
        "second": second,
        "second_masks": second_masks,
        "rest": rest,
        "rest_masks": rest_masks,
        "state": source.state_dict(),
    }
