"""Cases for the stacks people train with, on real gloo processes (``_multiproc.py``): local
views (``to_local``, ``to_submesh``), feeds from the mesh (``feed_read_config``,
``feed_slices``), context parallel against torch's own ``context_parallel``, and FSDP2 / TP /
SP training fed by torchshard against the same training fed by ``DistributedSampler``.

Run by the workers as ``"_stacks_cases:<case>"``; pure torch (no torch_xla). Each case returns
plain, picklable values for the test process to assert on; the oracles are numpy slicing of a
known global value (``_dtensor_cases.block_slices``), DTensor's ``full_tensor()``, torch's own
``context_parallel`` sharding and a ``DistributedSampler`` feed of the same model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from _dtensor_cases import _mesh, block_slices, global_value


def _ts() -> Any:
    import torchshard

    return torchshard


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# -- feeds from the mesh --------------------------------------------------------------------


def feeds(
    grid: Any, names: tuple[str, ...], spec: list[Any], shape: tuple[int, ...]
) -> dict[str, Any]:
    """``feed_read_config`` and ``feed_slices`` on every rank, and a batch fed from them."""
    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    mesh = _mesh(arr, names)
    g = global_value(tuple(shape), "float32")
    partition = ts.P(*spec)
    config = ts.feed_read_config(partition, mesh=mesh)
    with mesh:
        current = ts.feed_read_config(partition)
        slices = ts.feed_slices(partition, shape)
        x = ts.host_to_global_array(g[slices], partition=partition)
        full = x.full_tensor()
    return {
        "config": config,
        "current": current,
        "old_recipe": {"num_shards": ts.process_count(), "shard_index": ts.process_index()},
        "slices": [(s.start, s.stop) for s in slices],
        "local": x.to_local().clone(),
        "full_equal": bool(torch.equal(full, g)),
        "oracle": g[block_slices(arr, names, spec, tuple(shape), _rank())].clone(),
    }
