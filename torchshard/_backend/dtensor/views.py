"""DTensor's local views (the backend's ``LocalViews``): a DTensor's local block, and a DTensor
re-homed on a sub-mesh of its ``DeviceMesh`` (``device_mesh["tp"]`` of a (dp, tp) mesh), for
modules that live there (tensor and sequence parallel).

Neither copies: ``to_local`` is ``DTensor.to_local()``; ``to_submesh`` wraps the same local
tensor with ``DTensor.from_local`` on the sub-mesh, with the placements of the sub-mesh's axes
and the global shape of the block that this process's peers along them hold together (the
other axes' splits applied at this process's coordinates, in mesh order, as DTensor applies
them: ``torch.chunk``'s ceil-sized chunks). Both are differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from torchshard._backend.dtensor._torch_private import is_strided_shard
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import shard_range


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _axis_names(dm: DeviceMesh) -> tuple[str, ...]:
    names = dm.mesh_dim_names
    return tuple(names) if names is not None else tuple(f"dim {k}" for k in range(dm.ndim))


def _partial_axes(x: DTensor, axes: Sequence[int]) -> list[str]:
    names = _axis_names(x.device_mesh)
    return [names[k] for k in axes if x.placements[k].is_partial()]


class DTensorViews:
    """``LocalViews`` of DTensors."""

    def to_local(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x
        partial = _partial_axes(x, range(x.device_mesh.ndim))
        if partial:
            raise ShardingError(
                f"the DTensor of shape {tuple(x.shape)} is a partial sum (Partial) over the mesh "
                f"axes {partial}: its local tensor is this process's summand, not a block of its "
                "value. Reduce it first (x.redistribute(x.device_mesh, placements with "
                "Replicate() or Shard(d) in place of Partial())), or call x.to_local() if the "
                "summand is what the step needs."
            )
        return x.to_local()

    def to_submesh(self, x: torch.Tensor, submesh: Mesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x
        dm = x.device_mesh
        grid = dm.mesh.detach().cpu().numpy()
        what = f"the DTensor of shape {tuple(x.shape)}"
        if dm.mesh_dim_names is None:
            raise ShardingError(
                f"{what} lives on a DeviceMesh without mesh_dim_names (ranks {grid.tolist()}), "
                "so no axis of a sub-mesh can be found in it; build the mesh with "
                "init_device_mesh(device_type, shape, mesh_dim_names=(...))."
            )
        names = tuple(dm.mesh_dim_names)
        sub = submesh.axis_names
        missing = [a for a in sub if a not in names]
        if missing:
            raise ShardingError(
                f"{what} lives on a DeviceMesh with the axes {names} (ranks {grid.tolist()}), "
                f"which does not contain the sub-mesh {submesh!r}: it has no axis "
                f"{', '.join(map(repr, missing))}. to_submesh re-homes a DTensor on a sub-mesh "
                "of its own mesh (e.g. device_mesh['tp'] of a (dp, tp) mesh)."
            )
        ordered = tuple(sorted(sub, key=names.index))
        if sub != ordered:
            raise ShardingError(
                f"the axes {sub} of the sub-mesh {submesh!r} are not in the order of the "
                f"DTensor's mesh {names}; take the sub-mesh with its axes in mesh order, "
                f"device_mesh[{ordered!r}]."
            )
        coord = dm.get_coordinate()
        rank = dist.get_rank()
        if coord is None:
            raise ShardingError(
                f"this process (rank {rank}) is not in the DeviceMesh of {what} (ranks "
                f"{grid.tolist()}), so it holds no block of it to re-home."
            )
        index = tuple(
            slice(None) if n in sub else int(c) for n, c in zip(names, coord, strict=True)
        )
        expected = grid[index]
        if not np.array_equal(expected, submesh.devices):
            raise ShardingError(
                f"{submesh!r} (ranks {submesh.devices.tolist()}) is not the sub-mesh of the "
                f"DTensor's mesh (axes {names}, ranks {grid.tolist()}) that holds this process "
                f"(rank {rank}) along {sub}: that one has the ranks {expected.tolist()}. Pass "
                f"device_mesh[{(sub if len(sub) > 1 else sub[0])!r}] of the mesh the DTensor "
                "lives on."
            )
        native = submesh.native
        if native is dm or (len(sub) == len(names) and native is None):
            return x
        kept = [k for k, n in enumerate(names) if n in sub]
        dropped = [k for k, n in enumerate(names) if n not in sub]
        placements = tuple(x.placements)
        for k, p in enumerate(placements):
            if is_strided_shard(p):
                raise ShardingError(
                    f"{what} has the placement {p!r} (a _StridedShard, the layout FSDP2 + TP "
                    f"give a dim split over two mesh axes right to left) on the mesh axis "
                    f"{names[k]!r}; its rows on a sub-mesh are no block DTensor can name. "
                    "Redistribute it to Shard/Replicate placements first (x.redistribute("
                    "x.device_mesh, [...]))."
                )
        partial = _partial_axes(x, dropped)
        if partial:
            raise ShardingError(
                f"{what} is a partial sum (Partial) over the mesh axes {partial}, which the "
                f"sub-mesh {submesh!r} does not have: its local tensor is no part of its value "
                "there. Reduce it first (x.redistribute(x.device_mesh, placements with "
                f"Replicate() on {partial})), or re-home it on a sub-mesh that keeps those axes."
            )
        _check_blocks(what, names, placements, kept, dropped, submesh, x.ndim)
        shape = list(x.shape)
        for k in dropped:  # in mesh order, as DTensor applies its placements
            p = placements[k]
            if p.is_shard():
                d = _shard_dim(p, len(shape))
                start, stop = shard_range(shape[d], int(grid.shape[k]), int(coord[k]))
                shape[d] = stop - start
        if not isinstance(native, DeviceMesh):
            key = sub if len(sub) > 1 else sub[0]
            try:
                native = dm[key]
            except (KeyError, RuntimeError, ValueError) as e:
                raise ShardingError(
                    f"the DeviceMesh of {what} gave no sub-mesh {key!r} ({type(e).__name__}: "
                    f"{e}); pass the DeviceMesh sub-mesh itself (device_mesh[{key!r}])."
                ) from None
        return DTensor.from_local(
            x.to_local(),
            native,
            [placements[k] for k in kept],
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )


def _shard_dim(p: Placement, ndim: int) -> int:
    d = int(p.dim)  # type: ignore[attr-defined]  # a Shard
    return d + ndim if d < 0 else d


def _check_blocks(
    what: str,
    names: tuple[str, ...],
    placements: tuple[Placement, ...],
    kept: list[int],
    dropped: list[int],
    submesh: Any,
    ndim: int,
) -> None:
    """Every dim split over both a kept and a dropped axis must be split over the dropped ones
    first (mesh order: earlier axes are major); else this process's peers along the kept axes
    hold strided rows, which no ``Shard`` of the sub-mesh describes."""
    by_dim: dict[int, list[int]] = {}
    for k, p in enumerate(placements):
        if p.is_shard():
            by_dim.setdefault(_shard_dim(p, ndim), []).append(k)
    for d, ks in sorted(by_dim.items()):
        first_kept = min((k for k in ks if k in kept), default=None)
        if first_kept is None:
            continue
        late = [k for k in ks if k in dropped and k > first_kept]
        if late:
            split = tuple(names[k] for k in ks)
            raise ShardingError(
                f"dim {d} of {what} is split over the mesh axes {split} (major to minor), and "
                f"the sub-mesh {submesh!r} keeps {names[first_kept]!r} but not the later "
                f"{[names[k] for k in late]}: this process's peers on the sub-mesh hold strided "
                "parts of the dim, which no Shard of the sub-mesh describes. Re-home on a "
                f"sub-mesh that keeps {[names[k] for k in late]} too, or lay the dim out with "
                "the dropped axes first."
            )
