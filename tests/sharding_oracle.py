"""An independent check of in-step shardings: torch_xla's own shard indices against
``NamedSharding.devices_indices_map``."""

from __future__ import annotations

import torch
import torch_xla

import torchshard as ts
from torchshard._backend import get_backend


def placed_ranges(t: torch.Tensor, mesh: ts.Mesh) -> dict[int, tuple[tuple[int, int], ...]]:
    """Every device's global ``[start, stop)`` per dimension, as torch_xla reports it (after
    running and waiting for the pending step)."""
    torch_xla.sync(wait=True)
    return {s.device: s.ranges for s in get_backend(mesh).local_shards([t])[0]}


def expected_ranges(
    mesh: ts.Mesh, spec: ts.PartitionSpec, shape: tuple[int, ...]
) -> dict[int, tuple[tuple[int, int], ...]]:
    """The ranges ``NamedSharding(mesh, spec)`` names for a global ``shape``."""
    return {
        d: tuple((s.start, s.stop) for s in idx)
        for d, idx in ts.NamedSharding(mesh, spec).devices_indices_map(shape).items()
    }


def assert_sharded_as(t: torch.Tensor, mesh: ts.Mesh, spec: ts.PartitionSpec) -> None:
    """``t`` is laid out over ``mesh`` exactly as ``spec`` says."""
    assert placed_ranges(t, mesh) == expected_ranges(mesh, spec, tuple(t.shape))
