"""torch_xla's dispatch primitives (``torchshard._backend.xla.rows``): ``take_rows`` by gather
indices and ``move_rows`` by row targets, against numpy indexing, bit for bit, on every dtype
they move, on meshes whose devices are permuted and split over some axes only; and where
``move_rows`` declines (the caller then gathers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
from bit_patterns import FLOATS, bits, differing, odd_values

import torchshard as ts
from torchshard._backend.xla import rows

OTHER = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def _values(dtype, n):
    if dtype in FLOATS:
        return odd_values(dtype, n)
    if dtype == torch.bool:
        return torch.arange(n) % 3 == 0
    return (torch.arange(n) * 37 - 50).to(dtype)


def _targets(physical, logical, seed):
    """Row targets: ``logical`` rows at random physical rows, in random logical order."""
    rng = np.random.default_rng(seed)
    targets = np.full(physical, -1, np.int64)
    targets[rng.choice(physical, logical, replace=False)] = rng.permutation(logical)
    return targets


def _want(x, targets, logical):
    out = torch.empty((logical, *x.shape[1:]), dtype=x.dtype)
    for p, t in enumerate(targets):
        if t >= 0:
            out[t] = x[p]
    return out


@pytest.mark.parametrize("dtype", FLOATS + OTHER, ids=str)
def test_take_rows_moves_bits(mesh8, dtype):
    x = _values(dtype, 24).reshape(8, 3)
    index = torch.tensor([5, 0, 7, 7, 2])
    g = ts.host_to_global_array(x, partition=ts.P("data"))
    out = ts.global_to_host_array(rows.take_rows(g, index))
    want = x[index]
    assert out.dtype == dtype
    same = torch.equal(bits(out), bits(want)) if dtype in FLOATS else torch.equal(out, want)
    assert same, differing(out, want) if dtype in FLOATS else (out, want)


# (mesh devices, axis names, the axes that split dim 0, the spec torch_xla reports)
LAYOUTS = [
    (np.arange(8), ("data",), ("data",), "{devices=[8,1]0,1,2,3,4,5,6,7}"),
    (
        np.array([[3, 1], [0, 2], [7, 5], [6, 4]]),
        ("data", "model"),
        ("data", "model"),
        "{devices=[8,1]3,1,0,2,7,5,6,4}",
    ),
    (
        np.array([[3, 1], [0, 2], [7, 5], [6, 4]]),
        ("data", "model"),
        ("data",),
        "{devices=[4,1,2]1,3,0,2,5,7,4,6 last_tile_dim_replicate}",  # pairs sorted
    ),
    (
        np.arange(8).reshape(4, 2),
        ("data", "model"),
        ("model", "data"),
        "{devices=[8,1]0,2,4,6,1,3,5,7}",
    ),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: f"{c[0].tolist()}-{c[2]}")
def test_move_rows_puts_each_row_at_its_target(layout):
    """Every dtype in one graph per layout: the rows land at their targets, bit for bit, split
    over the given axes in their order (major to minor), on permuted devices too."""
    devices, names, axes, spec = layout
    physical, logical = 16, 8
    targets = _targets(physical, logical, seed=len(axes))
    data = {str(dt): _values(dt, physical * 2).reshape(physical, 2) for dt in FLOATS + OTHER}
    data["rank3"] = torch.arange(physical * 6, dtype=torch.int32).reshape(physical, 3, 2)
    with ts.Mesh(devices, names) as mesh:
        g = ts.host_to_global_array(data, partition=ts.P(axes))
        key = ts.host_to_global_array(targets, partition=ts.P(axes))
        out = {k: rows.move_rows(v, key, logical, mesh, axes) for k, v in g.items()}
        assert all(v is not None for v in out.values())
        torch_xla.sync()
        back = ts.global_to_host_array(out)
    wrong = []
    for k, x in data.items():
        want = _want(x, targets, logical)
        same = torch.equal(bits(back[k]), bits(want)) if x.dtype in FLOATS else None
        if same is None:
            same = torch.equal(back[k], want)
        if not same or back[k].dtype != x.dtype:
            wrong.append(k)
        if x.dim() == 2:
            assert torch_xla._XLAC._get_xla_sharding_spec(out[k]) == spec, k
    assert not wrong


def test_move_rows_reshards_inputs_split_otherwise(mesh42):
    """Leaves and a key placed with another split (columns over "model", the key replicated)
    are constrained to the rows' split first: the result is the same."""
    physical, logical = 16, 8
    targets = _targets(physical, logical, seed=3)
    x = torch.arange(physical * 4, dtype=torch.float32).reshape(physical, 4)
    g = ts.host_to_global_array(x, partition=ts.P(None, "model"))
    key = ts.host_to_global_array(targets, partition=ts.P())
    out = rows.move_rows(g, key, logical, mesh42, ("data", "model"))
    assert torch.equal(ts.global_to_host_array(out), _want(x, targets, logical))


def test_move_rows_declines_what_it_cannot_move(mesh8):
    """None, so that the caller gathers: plain tensors, a leaf that needs grad, rows the axes
    do not split evenly, no axes."""
    physical = 16
    x = ts.host_to_global_array(torch.zeros(physical, 2), partition=ts.P("data"))
    key = ts.host_to_global_array(_targets(physical, 8, 0), partition=ts.P("data"))
    assert rows.move_rows(torch.zeros(physical, 2), key, 8, mesh8, ("data",)) is None
    assert rows.move_rows(x.clone().requires_grad_(True), key, 8, mesh8, ("data",)) is None
    assert rows.move_rows(x, key, 4, mesh8, ("data",)) is None  # 4 rows over 8 devices
    assert rows.move_rows(x, key, 8, mesh8, ()) is None
    assert rows.move_rows(x, key, 8, mesh8, ("data",)) is not None
