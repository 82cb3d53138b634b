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
from _dtensor_cases import _catch, _mesh, block_slices, global_value, placement_names


def _ts() -> Any:
    import torchshard

    return torchshard


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# -- local views ----------------------------------------------------------------------------


def views(
    grid: Any, names: tuple[str, ...], spec: list[Any], shape: tuple[int, ...], sub: list[str]
) -> dict[str, Any]:
    """A global value placed with ``spec`` on ``grid``; its local view and its re-homing on
    the sub-mesh of the axes ``sub`` (given as the DeviceMesh slice)."""
    from torch.distributed.tensor import DTensor

    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    g = global_value(tuple(shape), "float32")
    block = g[block_slices(arr, names, spec, tuple(shape), _rank())].clone()
    mesh = _mesh(arr, names)
    with mesh:
        x = ts.host_to_global_array(block, partition=ts.P(*spec))
    tree = {"x": x, "n": 3, "plain": torch.ones(2), "none": None, "arr": np.zeros(2)}
    local = ts.to_local(tree)
    key = tuple(sub) if len(sub) > 1 else sub[0]
    dm_sub = mesh.native[key]
    moved = ts.to_submesh(tree, dm_sub)
    y = moved["x"]
    # The same through a torchshard.Mesh over the sub-mesh, with and without its DeviceMesh.
    via_mesh = ts.to_submesh(x, ts.Mesh.from_device_mesh(dm_sub))
    bare = ts.Mesh(dm_sub.mesh.numpy(), tuple(sub), backend="dtensor")
    via_bare = ts.to_submesh(x, bare)
    return {
        "local_is_plain": type(local["x"]) is torch.Tensor,
        "local": local["x"].clone(),
        "block": block,
        "shares_memory": local["x"].data_ptr() == x.to_local().data_ptr(),
        "others_kept": (local["n"], local["none"]) == (3, None)
        and local["plain"] is tree["plain"]
        and local["arr"] is tree["arr"]
        and moved["plain"] is tree["plain"],
        "sub_is_dtensor": isinstance(y, DTensor),
        "sub_mesh_is_given": y.device_mesh is dm_sub,
        "sub_ranks": y.device_mesh.mesh.tolist(),
        "sub_shape": tuple(y.shape),
        "sub_placements": placement_names(y.placements),
        "sub_local_same": y.to_local().data_ptr() == x.to_local().data_ptr(),
        "sub_full": y.full_tensor().clone(),
        "via_mesh_full": via_mesh.full_tensor().clone(),
        "via_mesh_is_given": via_mesh.device_mesh is dm_sub,
        "via_bare_full": via_bare.full_tensor().clone(),
        "same_mesh_kept": ts.to_submesh(y, dm_sub) is y,
        "g": g,
    }


def views_uneven() -> dict[str, Any]:
    """Uneven splits on (dp=2, tp=2): DTensor's own uneven layout, re-homed on ``tp``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ts = _ts()
    mesh = _mesh([[0, 1], [2, 3]], ("dp", "tp"))
    dm = mesh.native
    g = global_value((5, 7), "float32")
    full = DTensor.from_local(g.clone(), dm, [Replicate(), Replicate()], run_check=False)
    x = full.redistribute(dm, [Shard(0), Shard(1)])  # rows 3 | 2, columns 4 | 3
    y = ts.to_submesh(x, dm["tp"])
    return {
        "shape": tuple(y.shape),
        "placements": placement_names(y.placements),
        "full": y.full_tensor().clone(),
        "g": g,
        "local": y.to_local().clone(),
        "x_local": x.to_local().clone(),
    }


def views_errors() -> dict[str, str]:
    """Every error of to_local / to_submesh, on (dp=2, tp=2)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from torchshard._backend.dtensor._torch_private import StridedShard

    ts = _ts()
    mesh = _mesh([[0, 1], [2, 3]], ("dp", "tp"))
    dm = mesh.native
    t = torch.ones(2, 3)
    other = _mesh([0, 1, 2, 3], ("data",))  # a mesh of other axes

    def dt(placements: list[Any], shape: tuple[int, ...] = (4, 3), on: Any = dm) -> Any:
        stride = (shape[1], 1)
        return DTensor.from_local(t, on, placements, run_check=False, shape=shape, stride=stride)

    flat = dt([Shard(0)], (8, 3), other.native)
    rank = _rank()
    far_row = [[2, 3], [0, 1]][rank // 2]  # the tp row that does not hold this process
    return {
        "partial_local": _catch(lambda: ts.to_local({"a": [dt([Partial(), Replicate()])]})),
        "partial_dropped": _catch(
            lambda: ts.to_submesh({"a": dt([Partial(), Replicate()])}, dm["tp"])
        ),
        "partial_kept": placement_names(
            ts.to_submesh(dt([Replicate(), Partial()]), dm["tp"]).placements
        ),
        "strided": _catch(
            lambda: ts.to_submesh(
                {"s": dt([StridedShard(0, split_factor=2), Shard(0)], (8, 3))}, dm["tp"]
            )
        ),
        "kept_before_dropped": _catch(
            lambda: ts.to_submesh({"k": dt([Shard(0), Shard(0)], (8, 3))}, dm["dp"])
        ),
        "dropped_before_kept": placement_names(
            ts.to_submesh(dt([Shard(0), Shard(0)], (8, 3)), dm["tp"]).placements
        ),
        "not_contained": _catch(lambda: ts.to_submesh({"f": flat}, dm["tp"])),
        "other_slice": _catch(
            lambda: ts.to_submesh(
                {"x": dt([Shard(0), Replicate()])}, ts.Mesh(far_row, ("tp",), backend="dtensor")
            )
        ),
        "out_of_order": _catch(
            lambda: ts.to_submesh(
                {"x": dt([Shard(0), Replicate()])},
                ts.Mesh(np.array([[0, 2], [1, 3]]), ("tp", "dp"), backend="dtensor"),
            )
        ),
        "not_a_mesh": _catch(lambda: ts.to_submesh({"x": t}, "tp")),
        "xla_mesh": _catch(lambda: ts.to_submesh({"x": t}, ts.Mesh(np.arange(2), ("tp",)))),
    }


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
