"""DTensor's local views (torchshard._backend.dtensor.views), on real gloo processes (2 and 4
ranks): ``to_local`` is this rank's block of the value (numpy slicing of the global value is
the oracle), ``to_submesh`` re-homes a DTensor on a sub-mesh of its DeviceMesh with the
placements of the sub-mesh's axes (DTensor's ``full_tensor()`` on the sub-mesh is the block
the oracle cuts along the dropped axes), without copying; every error names the leaf."""

from __future__ import annotations

import re

import _stacks_cases  # noqa: F401 -- the workers import it; here it must import too
import numpy as np
import pytest
import torch
from _dtensor_cases import block_slices

from torchshard._backend.dtensor.views import contiguous_stride

G22 = [[0, 1], [2, 3]]
DT = ("dp", "tp")

# (world, grid, axis names, spec entries, shape, sub-mesh axes)
VIEWS = [
    (4, G22, DT, ["dp"], (4, 3), ["tp"]),  # TP's input: the dp row's rows, Replicate on tp
    (4, G22, DT, ["dp", "tp"], (4, 6, 2), ["tp"]),  # SP's input: Shard(1) on tp
    (4, G22, DT, [("dp", "tp")], (8, 3), ["tp"]),  # rows split again over tp
    (4, G22, DT, ["tp"], (4, 3), ["dp"]),  # the other sub-mesh
    (4, G22, DT, [None, "dp"], (2, 4), ["dp"]),  # nothing dropped splits: the whole value
    (4, [[0, 2], [1, 3]], DT, ["dp", "tp"], (4, 6), ["tp"]),  # a transposed grid
    (4, [[[0, 1]], [[2, 3]]], ("dp", "cp", "tp"), ["dp", "tp"], (4, 6), ["cp", "tp"]),
    (2, [0, 1], ("dp",), ["dp"], (4, 3), ["dp"]),  # the whole mesh: the DTensor itself
]


def _id(case: tuple) -> str:
    world, grid, _names, spec, shape, sub = case
    return f"{world}p-{np.asarray(grid).tolist()}-{spec}-{list(shape)}-on-{sub}".replace(" ", "")


def _expected(grid, names, spec, shape, sub, rank):
    """The block of the global value that the re-homed tensor holds (the splits of the axes
    the sub-mesh drops, at this rank's coordinates), its placements on the sub-mesh, and the
    sub-mesh's ranks."""
    arr = np.asarray(grid)
    dropped = [
        tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a not in sub) for e in spec
    ]
    block = block_slices(arr, names, dropped, tuple(shape), rank)
    placements = []
    for axis in sub:
        dims = [
            d for d, e in enumerate(spec) if axis in ((e,) if isinstance(e, str) else (e or ()))
        ]
        placements.append(f"S({dims[0]})" if dims else "R")
    coord = [int(c[0]) for c in np.nonzero(arr == rank)]
    index = tuple(slice(None) if n in sub else coord[k] for k, n in enumerate(names))
    return block, placements, arr[index].tolist()


@pytest.mark.parametrize("case", VIEWS, ids=_id)
def test_local_views_and_rehoming_match_the_oracle(pools, case):
    world, grid, names, spec, shape, sub = case
    results = pools(world).run(
        "_stacks_cases:views", grid=grid, names=names, spec=spec, shape=shape, sub=sub
    )
    for rank, r in enumerate(results):
        g = r["g"]
        # to_local: this rank's block, the DTensor's own memory, other leaves untouched
        assert r["local_is_plain"] and r["shares_memory"] and r["others_kept"]
        assert torch.equal(r["local"], r["block"])
        assert torch.equal(r["local"], g[block_slices(np.asarray(grid), names, spec, shape, rank)])
        # to_submesh: the dropped axes' block, on the given DeviceMesh, the same local tensor
        block, placements, ranks = _expected(grid, names, spec, shape, sub, rank)
        assert r["sub_is_dtensor"] and r["sub_mesh_is_given"] and r["sub_local_same"]
        assert r["sub_ranks"] == ranks
        assert r["sub_shape"] == tuple(g[block].shape)
        assert r["sub_placements"] == placements
        assert torch.equal(r["sub_full"], g[block])
        assert torch.equal(r["via_mesh_full"], g[block]) and r["via_mesh_is_given"]
        assert torch.equal(r["via_bare_full"], g[block])
        assert r["same_mesh_kept"]


def test_rehoming_an_uneven_split_keeps_dtensors_chunks(pools):
    # (5, 7) split Shard(0) over dp and Shard(1) over tp: rows 3 | 2 (torch.chunk), so the
    # re-homed tensor on tp is (3, 7) on dp row 0 and (2, 7) on dp row 1.
    results = pools(4).run("_stacks_cases:views_uneven")
    for rank, r in enumerate(results):
        rows = slice(0, 3) if rank < 2 else slice(3, 5)
        assert r["shape"] == (3 if rank < 2 else 2, 7)
        assert r["placements"] == ["S(1)"]
        assert torch.equal(r["full"], r["g"][rows])
        assert torch.equal(r["local"], r["x_local"])


def test_every_error_names_the_leaf_and_the_fix(pools):
    results = pools(4).run("_stacks_cases:views_errors")
    for rank, r in enumerate(results):
        assert r["partial_local"].startswith(
            "ShardingError: tree['a'][0]: the DTensor of shape (4, 3) is a partial sum (Partial) "
            "over the mesh axes ['dp']: its local tensor is this process's summand"
        )
        assert "Reduce it first" in r["partial_local"]
        assert r["partial_dropped"].startswith(
            "ShardingError: tree['a']: the DTensor of shape (4, 3) is a partial sum (Partial) "
            "over the mesh axes ['dp'], which the sub-mesh Mesh({'tp': 2}"
        )
        assert r["partial_kept"] == ["P"]  # a partial sum over a kept axis stays one
        assert re.match(
            re.escape("ShardingError: tree['s']: the DTensor of shape (8, 3) has the placement ")
            + r"_StridedShard\(.*\) "
            + re.escape("(a _StridedShard, the layout FSDP2 + TP give"),
            r["strided"],
        ), r["strided"]
        assert r["kept_before_dropped"].startswith(
            "ShardingError: tree['k']: dim 0 of the DTensor of shape (8, 3) is split over the "
            "mesh axes ('dp', 'tp') (major to minor), and the sub-mesh Mesh({'dp': 2}, "
        )
        assert "keeps 'dp' but not the later ['tp']" in r["kept_before_dropped"]
        assert r["dropped_before_kept"] == ["S(0)"]
        assert r["not_contained"] == (
            "ShardingError: tree['f']: the DTensor of shape (8, 3) lives on a DeviceMesh with the "
            "axes ('data',) (ranks [0, 1, 2, 3]), which does not contain the sub-mesh "
            f"Mesh({{'tp': 2}}{'' if rank < 2 else ', devices=[2, 3]'}): it has no axis 'tp'. "
            "to_submesh re-homes a DTensor on a sub-mesh of its own mesh (e.g. "
            "device_mesh['tp'] of a (dp, tp) mesh)."
        )
        own, far = ([0, 1], [2, 3]) if rank < 2 else ([2, 3], [0, 1])
        assert r["other_slice"].startswith(
            f"ShardingError: tree['x']: Mesh({{'tp': 2}}{', devices=[2, 3]' if rank < 2 else ''}) "
            f"(ranks {far}) is not the sub-mesh of the DTensor's mesh (axes ('dp', 'tp'), ranks "
            f"[[0, 1], [2, 3]]) that holds this process (rank {rank}) along ('tp',): that one "
            f"has the ranks {own}."
        )
        assert r["out_of_order"].startswith(
            "ShardingError: tree['x']: the axes ('tp', 'dp') of the sub-mesh "
        )
        assert "device_mesh[('dp', 'tp')]" in r["out_of_order"]
        assert r["not_a_mesh"] == (
            "TypeError: to_submesh: submesh must be a torch.distributed DeviceMesh (a sub-mesh of "
            "the DTensors' mesh, e.g. device_mesh['tp']) or a torchshard.Mesh over one, but got "
            "str."
        )
        assert r["xla_mesh"].startswith(
            "TypeError: to_submesh: submesh Mesh({'tp': 2}) is a mesh of the xla backend, whose "
            "step takes global tensors"
        )


def test_contiguous_stride():
    assert contiguous_stride((2, 3, 4)) == torch.empty(2, 3, 4).stride()
    assert contiguous_stride((0, 3)) == (3, 1)
    assert contiguous_stride(()) == ()
