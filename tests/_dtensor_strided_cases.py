"""DTensors with a ``_StridedShard`` placement (FSDP2 + TP's layout), on real processes.

Run by the gloo workers of ``_multiproc.py`` (``pool.run("_dtensor_strided_cases:strided",
layout)``); pure torch. Each rank builds its block of a known global value with numpy (the
oracle below applies the placements left to right, as DTensor defines them), wraps it with
``DTensor.from_local`` and reports what dispatch, a constraint and a read-back give, for
``tests/backend/dtensor/test_torch_private.py`` to compare with numpy indexing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from _dtensor_cases import _mesh, placement_names

KEY = "__physical_to_logical_batch_dispatch"
PHYSICAL, LOGICAL, WIDTH = 8, 6, 3
# Physical row of each logical row (logical row l is physical row PICK[l]).
PICK = [5, 2, 6, 0, 7, 3]

# name -> (rank grid, axis names, placements as (kind, dim, split factor))
LAYOUTS: dict[str, tuple[list[Any], tuple[str, ...], list[tuple[str, int, int]]]] = {
    "1d": ([0, 1], ("data",), [("strided", 0, 2)]),
    "2x1": ([[0], [1]], ("data", "model"), [("strided", 0, 2), ("shard", 0, 1)]),
    "2x2": ([[0, 1], [2, 3]], ("data", "model"), [("strided", 0, 2), ("shard", 0, 1)]),
}


def global_batch() -> np.ndarray:
    """The global physical batch: row ``i`` is ``[10 i, 10 i + 1, 10 i + 2]`` (int64)."""
    return (10 * np.arange(PHYSICAL)[:, None] + np.arange(WIDTH)).astype(np.int64)


def rows_held(layout: str, rank: int) -> list[int]:
    """The global rows ``rank`` holds (the numpy oracle). Left to right over the mesh axes:
    ``Shard(0)`` splits the rows held so far into contiguous chunks; ``_StridedShard(0, k)``
    splits them into ``k * n`` chunks and the axis coordinate ``c`` keeps chunks
    ``c, c + n, ...`` (a split that a later axis's split happened before)."""
    grid, _, placements = LAYOUTS[layout]
    coords = [int(c) for c in np.argwhere(np.asarray(grid) == rank)[0]]
    sizes = np.asarray(grid).shape
    rows = np.arange(PHYSICAL)
    for (kind, _dim, k), c, n in zip(placements, coords, sizes, strict=True):
        if kind == "shard":
            rows = np.array_split(rows, n)[c]
        else:
            rows = rows.reshape(k, n, -1)[:, c].reshape(-1)
    return rows.tolist()


def strided(layout: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import torchshard as ts
    from torchshard._backend.dtensor._torch_private import StridedShard

    grid, names, spec = LAYOUTS[layout]
    rank = dist.get_rank()
    mesh = _mesh(grid, names)
    dm = mesh.native
    placements = [
        StridedShard(d, split_factor=k) if kind == "strided" else Shard(d) for kind, d, k in spec
    ]
    g = torch.as_tensor(global_batch())
    held = rows_held(layout, rank)
    x = DTensor.from_local(
        g[held].clone(), dm, placements, run_check=False, shape=g.shape, stride=g.stride()
    )
    onehot = torch.zeros(PHYSICAL, LOGICAL, dtype=torch.bool)
    onehot[PICK, torch.arange(LOGICAL)] = True
    key = DTensor.from_local(onehot, dm, [Replicate()] * dm.ndim, run_check=False)
    with mesh:
        # One feed (the key alone says which physical row each logical row is).
        dispatcher = ts.InputDispatcher(
            LOGICAL,
            global_physical_batch_size=PHYSICAL,
            num_physical_feeds=1,
            physical_feed_index=0,
        )
        out = dispatcher.physical_to_logical_batch({"x": x, KEY: key}, check=True)
        rows = ts.with_sharding_constraint(x, ts.P("data"))
        back = ts.global_to_host_array(x)
    return {
        "input_placements": placement_names(x.placements),
        "held": held,
        "full": x.full_tensor(),  # torch's own reading of the layout
        "dispatched": out["x"].full_tensor(),
        "dispatched_keys": sorted(out),
        "constrained": placement_names(rows.placements),
        "constrained_local": rows.to_local().clone(),
        "constrained_full": rows.full_tensor(),
        "back": torch.as_tensor(back),
        "input_untouched": torch.equal(x.to_local(), g[held]),
    }
