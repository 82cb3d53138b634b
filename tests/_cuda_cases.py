"""Cases for ``cross/test_cuda.py``: run on every rank of a pool whose process group is
``cpu:gloo,cuda:nccl`` with one GPU per rank (``_multiproc.py``). Each returns plain values:
devices as strings, tensors moved to the CPU (the test process may not touch the GPU)."""

from __future__ import annotations

from typing import Any

import _dtensor_cases as base
import numpy as np
import torch


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _expected_device() -> str:
    return f"cuda:{torch.cuda.current_device()}"


def assemble_readback() -> dict[str, Any]:
    """``host_to_global_array`` on a mesh torchshard builds, then read-back, and the same on a
    user's ``init_device_mesh("cuda", ...)``: where every shard lives and what it holds."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchshard as ts

    rank, world = _rank_world()
    g = base.global_value((4 * world, 3), "float32")
    gi = base.global_value((4 * world, 5), "int64", seed=1)
    rows = slice(4 * rank, 4 * rank + 4)
    mesh = ts.create_device_mesh((world,), ("data",), backend="dtensor")
    x, y = g[rows].clone(), gi[rows].clone()
    with mesh:
        out = ts.host_to_global_array(
            {"x": x, "y": y, "r": torch.arange(6.0)},
            partition={"x": ts.P("data"), "y": ts.P("data"), "r": ts.P()},
        )
        x.zero_()  # the global tensors own their memory
        y.zero_()
        back = ts.global_to_host_array(out)
        full = ts.replicate_to_local_data(out)
    dm = init_device_mesh("cuda", (world,), mesh_dim_names=("data",))
    with ts.Mesh.from_device_mesh(dm):
        user = ts.host_to_global_array(g[rows].clone(), partition=ts.P("data"))
        user_back = ts.global_to_host_array(user)
    return {
        "expected_device": _expected_device(),
        "mesh_device_type": mesh.native.device_type,
        "devices": {k: str(v.to_local().device) for k, v in out.items()},
        "locals": {k: v.to_local().cpu() for k, v in out.items()},
        "back_devices": {k: str(v.device) for k, v in back.items()},
        "back": back,
        "full": full,
        "global": {"x": g, "y": gi},
        "rows": (4 * rank, 4 * rank + 4),
        "user_device": str(user.to_local().device),
        "user_back": user_back,
    }


def dispatch(key: str) -> dict[str, Any]:
    """The in-step dispatch primitives (``_dtensor_cases.dispatch_primitives``) on CUDA."""
    out = base.dispatch_primitives("replicated", key)
    return {
        "expected_device": _expected_device(),
        "device": str(out["local"].device),
        "local": out["local"].cpu(),
        "full": out["full"].cpu(),
        "expected": out["expected"],
        "expected_local": out["expected_local"],
        "placements": out["placements"],
    }


def loader(prefetch: int, batches: int = 5) -> dict[str, Any]:
    """A ``GlobalBatchLoader`` on CUDA: each batch's shard device and values, as the step
    sees them (a kernel on the consumer's stream reads the batch right away)."""
    import torchshard as ts

    rank, world = _rank_world()
    mesh = ts.create_device_mesh((world,), ("data",), backend="dtensor")
    source = [
        {"x": np.full((64, 256), 1000 * rank + b, dtype=np.float32), "i": np.arange(8) + b}
        for b in range(batches)
    ]
    devices, sums, backs = [], [], []
    with mesh:
        loader = ts.GlobalBatchLoader(source, prefetch=prefetch)
        for batch in loader:
            devices.append({k: str(v.to_local().device) for k, v in batch.items()})
            sums.append(float(batch["x"].to_local().sum().item()))  # on the consumer's stream
            backs.append(ts.global_to_host_array(batch))
        loader.close()
    return {
        "expected_device": _expected_device(),
        "devices": devices,
        "sums": sums,
        "backs": backs,
        "rank": rank,
        "world": world,
    }
