"""describe_layout and ShardingLayout (torchshard._core.layout), against independent oracles:
the conformance vectors (torch_xla's and JAX's index maps), torch_xla's own reported shards
(``XLAShardedTensor.local_shards``), the placement rule written out with numpy
(``helpers.reference_ranges``), and the virtual-host rule d // (8 // n). The plain text:
test_layout_text.py; drawing a placed tensor, rich and PNGs: tests/visualize/test_sharding.py."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla.distributed.spmd as xs
from helpers import (
    CONFORMANCE,
    host_segments,
    index_map_ranges,
    reference_ranges,
    take_segments,
    torch_xla_placement,
    virtual_host_of,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import torchshard as ts
from torchshard.testing import make_virtual_topology

MESH42 = np.arange(8).reshape(4, 2)


def _load(name):
    with open(CONFORMANCE / f"{name}.json") as f:
        return json.load(f)["cases"]


def _mesh(case):
    return ts.Mesh(np.asarray(case["device_ids"]).reshape(case["mesh_shape"]), case["axis_names"])


def _spec(case):
    return ts.P(*[tuple(e) if isinstance(e, list) else e for e in case["spec"]])


def _xla_shards(t):
    """{device: ranges} as torch_xla reports them (its public XLAShardedTensor API)."""
    out = {}
    for s in xs.XLAShardedTensor(t).local_shards:
        device = int(s.shard_device.split(":")[1])
        if s.indices is Ellipsis:
            out[device] = tuple((0, n) for n in t.shape)
        else:
            out[device] = tuple(sl.indices(n)[:2] for sl, n in zip(s.indices, t.shape, strict=True))
    return out


def _ranges(layout):
    return {b.device: b.ranges for b in layout.blocks}


# -- the index maths -------------------------------------------------------------------------


@st.composite
def layouts(draw):
    rank = draw(st.integers(1, 3))
    sizes = {1: [(8,)], 2: [(4, 2), (2, 4), (8, 1), (1, 8)], 3: [(2, 2, 2), (2, 1, 4)]}[rank]
    shape = draw(st.sampled_from(sizes))
    names = ("a", "b", "c")[:rank]
    ids = draw(st.permutations(range(8)))
    mesh = ts.Mesh(np.asarray(ids).reshape(shape), names)
    ndim = draw(st.integers(1, 3))
    free = list(names)
    spec = []
    for _ in range(draw(st.integers(0, ndim))):
        k = draw(st.integers(0, min(2, len(free))))
        picked = draw(st.permutations(free))[:k]
        free = [a for a in free if a not in picked]
        spec.append(None if not picked else picked[0] if k == 1 else tuple(picked))
    gshape = tuple(draw(st.integers(0, 12)) for _ in range(ndim))
    return mesh, ts.P(*spec), gshape, draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_describe_layout_agrees_with_the_numpy_reference(case):
    # The oracle is the placement rule written out with numpy (helpers.reference_ranges, itself
    # checked against torch_xla's mark_sharding below) and the virtual-host rule d // (8 // n);
    # nothing here calls NamedSharding.
    mesh, spec, shape, hosts = case
    layout = ts.describe_layout(mesh, spec, shape, num_hosts=hosts)
    want = reference_ranges(mesh, spec, shape)
    assert _ranges(layout) == want
    assert index_map_ranges(layout.devices_indices_map(), shape) == want
    assert layout.devices == tuple(range(8))
    owners = virtual_host_of(hosts)
    assert [b.host for b in layout.blocks] == list(owners)
    assert make_virtual_topology(8, hosts).device_process == owners
    segments = host_segments(want, owners, len(shape))
    glob = np.arange(int(np.prod(shape))).reshape(shape)
    for h, (devices, local) in layout.host_blocks().items():
        assert devices == tuple(d for d in range(8) if owners[d] == h)
        assert local == take_segments(glob, segments[h]).shape


@pytest.mark.parametrize(
    ("ids", "names", "spec", "shape"),
    [
        (np.arange(8).reshape(4, 2), ("data", "model"), ("data", "model"), (8, 4)),
        (np.arange(8).reshape(4, 2), ("data", "model"), (("model", "data"),), (16, 3)),
        (np.arange(8).reshape(4, 2), ("data", "model"), (("data", "model"),), (5,)),
        (np.arange(8).reshape(4, 2), ("data", "model"), ("data", None), (10, 3)),
        (np.array([0, 4, 1, 5, 2, 6, 3, 7]).reshape(2, 4), ("a", "b"), ("b", "a"), (8, 6)),
        (np.array([3, 1, 7, 5, 0, 2, 6, 4]).reshape(2, 4), ("x", "y"), (None, ("y", "x")), (2, 8)),
        (
            np.array([5, 2, 7, 0, 1, 6, 4, 3]).reshape(2, 2, 2),
            ("a", "b", "c"),
            (("c", "a"), "b"),
            (7, 4),
        ),
        (np.arange(8), ("data",), (), (5,)),
    ],
)
def test_numpy_reference_agrees_with_torch_xla_mark_sharding(ids, names, spec, shape):
    # The oracle of the property above, checked against torch_xla itself.
    mesh = ts.Mesh(ids, names)
    placed = torch_xla_placement(np.zeros(shape, np.float32), mesh, spec)
    assert {d: r for d, (r, _) in placed.items()} == reference_ranges(mesh, spec, shape)


@pytest.mark.parametrize("case", _load("index_maps"), ids=lambda c: c["id"])
def test_describe_layout_matches_conformance_index_maps(case):
    layout = ts.describe_layout(_mesh(case), _spec(case), case["global_shape"], num_hosts=1)
    want = {int(d): tuple(tuple(r) for r in rs) for d, rs in case["indices"].items()}
    assert _ranges(layout) == want


@pytest.mark.parametrize(
    "case",
    [c for c in _load("host_layouts") if c["hosts"] is not None and c["indices"] is not None],
    ids=lambda c: c["id"],
)
def test_describe_layout_matches_conformance_host_layouts(case):
    layout = ts.describe_layout(
        _mesh(case), _spec(case), case["global_shape"], num_hosts=case["num_hosts"]
    )
    want = {int(d): tuple(tuple(r) for r in rs) for d, rs in case["indices"].items()}
    assert _ranges(layout) == want
    got = layout.host_blocks()
    for host in case["hosts"]:
        assert got[host["host"]] == (tuple(host["devices"]), tuple(host["local_shape"]))


# -- against the shards torch_xla reports -----------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "names", "spec", "shape"),
    [
        (MESH42, ("data", "model"), ts.P("data"), (16, 8)),
        (MESH42, ("data", "model"), ts.P("data", "model"), (16, 8)),
        (MESH42, ("data", "model"), ts.P(("data", "model"), None), (16, 3)),
        (MESH42, ("data", "model"), ts.P(None, "model"), (4, 6, 2)),
        (np.array([3, 1, 7, 5, 0, 2, 6, 4]).reshape(2, 4), ("x", "y"), ts.P("y", "x"), (8, 4)),
        (np.arange(8), ("data",), ts.P(), (5,)),
    ],
)
def test_layout_agrees_with_torch_xla_shards_placed_by_torchshard(ids, names, spec, shape):
    mesh = ts.Mesh(ids, names)
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    with mesh:
        g = ts.host_to_global_array(x, partition=spec)
        described = ts.describe_layout(mesh, spec, shape)  # runtime topology: one host
        shown = ts.visualize_sharding(g, file=io.StringIO(), use_rich=False)
        assert _ranges(described) == _xla_shards(g) == _ranges(shown)
    assert shown.num_hosts == described.num_hosts == 1
    assert {b.host for b in described.blocks} == {0}


@pytest.mark.parametrize(
    ("spec", "shape"),
    [(("data", None), (10, 3)), (("data", "model"), (5, 3)), ((("data", "model"),), (5,))],
)
def test_layout_agrees_with_torch_xla_on_uneven_mark_sharding(mesh42, spec, shape):
    t = torch.zeros(shape).to("xla")
    xs.mark_sharding(t, mesh42.xla_mesh, spec)
    described = ts.describe_layout(mesh42, spec, shape)
    assert _ranges(described) == _xla_shards(t)
    assert _ranges(ts.visualize_sharding(t, file=io.StringIO(), use_rich=False)) == _ranges(
        described
    )
    assert "splits unevenly" in described.to_text()


# -- the value ---------------------------------------------------------------------------------


def test_a_layout_made_of_arrays_equals_one_made_of_its_blocks():
    """describe_layout keeps its blocks as arrays and makes the LayoutBlocks when read; a
    layout of the same blocks (as layout_of_tensor makes it) is equal, hashes alike and has
    the same repr."""
    mesh = ts.Mesh(MESH42, ("data", "model"))
    described = ts.describe_layout(mesh, ts.P("data"), (16, 8), num_hosts=2)
    rebuilt = ts.ShardingLayout((16, 8), described.blocks, 2, mesh, ts.P("data"))
    assert rebuilt == described and hash(rebuilt) == hash(described)
    assert repr(rebuilt) == repr(described)
    assert repr(described).startswith(
        "ShardingLayout(global_shape=(16, 8), blocks=(LayoutBlock(device=0, host=0, "
        "ranges=((0, 4), (0, 8))), LayoutBlock(device=1, host=0, ranges=((0, 4), (0, 8))),"
    )
    assert str(rebuilt) == str(described)
    assert described.host_of(5) == 1 and described.devices == tuple(range(8))
    other = ts.describe_layout(mesh, ts.P("model"), (16, 8), num_hosts=2)
    assert other != described
    with pytest.raises(KeyError, match="device 8 is not in this layout"):
        described.host_of(8)
    with pytest.raises(AttributeError):
        described.global_shape = (8, 8)


# -- bad input ---------------------------------------------------------------------------------


def test_bad_arguments():
    mesh = ts.Mesh(MESH42, ("data", "model"))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "num_hosts must be a positive divisor of the 8 devices, but got 3; each host owns an "
            "equal, contiguous group of device ids."
        ),
    ):
        ts.describe_layout(mesh, ts.P("data"), (16, 8), num_hosts=3)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "describe_layout: global_shape: expected a shape (a sequence of ints >= 0), but got "
            "16 of type int."
        ),
    ):
        ts.describe_layout(mesh, ts.P("data"), 16)
    with pytest.raises(
        TypeError, match=re.escape("describe_layout: mesh must be a torchshard.Mesh")
    ):
        ts.describe_layout(MESH42, ts.P("data"), (16, 8))
    with pytest.raises(ts.ShardingError, match=re.escape("names mesh axis 'batch'")):
        ts.describe_layout(mesh, ts.P("batch"), (16, 8), num_hosts=1)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "visualize_sharding: expected a global (XLA) tensor or a ShardingLayout, but got "
            "ndarray."
        ),
    ):
        ts.visualize_sharding(np.zeros(3))
