"""An independent check of in-step shardings: the shard indices torch_xla reports for a placed
tensor (its public ``XLAShardedTensor.local_shards``) against the placement rule written out
with numpy (``helpers.reference_ranges``). Neither side calls torchshard's index maths
(``NamedSharding``, ``describe_layout``, host plans)."""

from __future__ import annotations

import torch
import torch_xla
from helpers import Ranges, reference_ranges, xla_shards

import torchshard as ts


def placed_ranges(t: torch.Tensor, mesh: ts.Mesh) -> dict[int, Ranges]:
    """Every device's global ``[start, stop)`` per dimension, as torch_xla reports it (after
    running and waiting for the pending step); checks that it reports every device of
    ``mesh``."""
    torch_xla.sync(wait=True)
    out = {d: ranges for d, (ranges, _) in xla_shards(t).items()}
    assert sorted(out) == sorted(mesh.device_ids), (sorted(out), mesh)
    return out


def expected_ranges(
    mesh: ts.Mesh, spec: ts.PartitionSpec, shape: tuple[int, ...]
) -> dict[int, Ranges]:
    """The ranges the placement rule gives ``spec`` on ``mesh`` for a global ``shape``,
    computed by ``helpers.reference_ranges`` (numpy, from the mesh's device ids and axis
    names only)."""
    return reference_ranges(mesh, tuple(spec), shape)


def assert_sharded_as(t: torch.Tensor, mesh: ts.Mesh, spec: ts.PartitionSpec) -> None:
    """``t`` is laid out over ``mesh`` exactly as ``spec`` says."""
    placed = placed_ranges(t, mesh)
    expected = expected_ranges(mesh, spec, tuple(t.shape))
    wrong = {d: (placed.get(d), expected.get(d)) for d in expected if placed.get(d) != expected[d]}
    assert placed == expected, f"{spec!r} on {mesh!r}: device -> (placed, expected): {wrong}"
