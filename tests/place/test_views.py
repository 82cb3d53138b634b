"""The views each device receives (torchshard._place.views): one view of its owner's host
tensor per planned device, checked against numpy slicing of the global array (one host, and
several virtual hosts each passing its block); views, never copies; ``one_host_placer``'s
single ``tensor_split``."""

import numpy as np
import pytest
import torch
from helpers import host_segments, index_map_ranges, take_segments, virtual_host_of

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard._core.blocks import plan_from_local
from torchshard._core.mesh import Mesh
from torchshard._place import views

MESH42 = Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
PERMUTED = Mesh(np.array([5, 2, 7, 0, 3, 6, 1, 4]).reshape(2, 2, 2), ("a", "b", "c"))
ALL = tuple(range(8))
CASES = [
    (MESH42, ts.P("data"), (8, 3)),
    (MESH42, ts.P("data", "model"), (8, 6)),
    (MESH42, ts.P("model", "data"), (4, 8)),
    (MESH42, ts.P(None, ("data", "model")), (2, 16)),
    (MESH42, ts.P(), (3, 2)),
    (PERMUTED, ts.P(("c", "a"), None, "b"), (8, 3, 4)),
    (PERMUTED, ts.P("b", "c"), (4, 6)),
]


@pytest.mark.parametrize(("mesh", "spec", "shape"), CASES, ids=str)
def test_one_host_device_shards_are_numpy_slices(mesh, spec, shape):
    x = torch.arange(int(np.prod(shape))).reshape(shape)
    plan = plan_from_local(mesh, spec, shape, (0,) * 8, ALL)
    shards = views.device_shards(plan, [x], {0: 0})
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(shape)
    assert len(shards) == 8
    for d, shard in zip(ALL, shards, strict=True):
        np.testing.assert_array_equal(shard.numpy(), x.numpy()[index_map[d]])
        assert shard.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view


# Every case on 2 hosts; on 4, those whose hosts each pass a block of one shape (on the
# permuted mesh the 4 hosts' devices hold blocks of different shapes).
HOST_CASES = [(*case, 2) for case in CASES] + [(*case, 4) for case in CASES if case[0] is MESH42]


@pytest.mark.parametrize(("mesh", "spec", "shape", "hosts"), HOST_CASES, ids=str)
def test_each_host_block_is_cut_as_numpy_slices_the_global_array(mesh, spec, shape, hosts):
    owners = virtual_host_of(hosts)
    G = np.arange(int(np.prod(shape))).reshape(shape)
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(shape)
    segments = host_segments(index_map_ranges(index_map, shape), owners, len(shape))
    blocks = [
        torch.from_numpy(np.ascontiguousarray(take_segments(G, segments[h]))) for h in range(hosts)
    ]
    local = tuple(blocks[0].shape)
    assert all(tuple(b.shape) == local for b in blocks)
    plan = plan_from_local(mesh, spec, local, owners, ALL)
    assert plan.global_shape == shape
    shards = views.device_shards(plan, blocks, {h: h for h in range(hosts)})
    for d, piece, shard in zip(ALL, plan.pieces, shards, strict=True):
        assert piece.device == d and piece.owner == owners[d]
        np.testing.assert_array_equal(shard.numpy(), G[index_map[d]])
        owner = blocks[owners[d]]
        assert shard.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()


def test_narrowed_applies_the_cuts_in_order():
    x = torch.arange(24).reshape(4, 6)
    out = views.narrowed(x, ((0, 1, 2), (1, 3, 3)))
    np.testing.assert_array_equal(out.numpy(), x.numpy()[1:3, 3:6])
    assert out.data_ptr() == x[1, 3].data_ptr()
    assert views.narrowed(x, ()) is x


def test_one_host_placer_splits_once_when_the_pieces_are_in_order():
    plan = plan_from_local(MESH42, ts.P(("data", "model")), (16, 2), (0,) * 8, ALL)
    assert plan.single_split == (0, 2) and plan.split_parts == ALL
    made = []
    placer = views.one_host_placer(plan, lambda shards: made.append(shards) or "global")
    x = torch.arange(32).reshape(16, 2)
    assert placer(x) == "global"
    (shards,) = made
    assert type(shards) is tuple and len(shards) == 8  # tensor_split's own tuple
    for d, shard in enumerate(shards):
        np.testing.assert_array_equal(shard.numpy(), x.numpy()[2 * d : 2 * d + 2])


@pytest.mark.parametrize(("mesh", "spec", "shape"), CASES, ids=str)
def test_one_host_placer_gives_the_device_shards(mesh, spec, shape):
    plan = plan_from_local(mesh, spec, shape, (0,) * 8, ALL)
    made = []
    placer = views.one_host_placer(plan, lambda shards: made.append(list(shards)))
    x = torch.arange(int(np.prod(shape))).reshape(shape)
    placer(x)
    expected = views.device_shards(plan, [x], {0: 0})
    assert len(made[0]) == len(expected) == 8
    for got, want in zip(made[0], expected, strict=True):
        assert torch.equal(got, want)


def test_empty_pieces_are_narrowed_not_split():
    plan = plan_from_local(MESH42, ts.P(("data", "model")), (0, 3), (0,) * 8, ALL)
    assert plan.single_split is None  # zero-length chunks: narrow
    shards = views.device_shards(plan, [torch.zeros(0, 3)], {0: 0})
    assert [tuple(s.shape) for s in shards] == [(0, 3)] * 8


def test_each_device_receives_only_its_shard(mesh42, monkeypatch):
    """No full copy per device: the backend is handed one shard-sized view per device."""
    backend = lookup(ts.current_mesh())
    seen = []
    real = backend.place.make_global

    def spy(mesh, axes, global_shape, shards):
        seen.append([tuple(s.shape) for s in shards])
        return real(mesh, axes, global_shape, shards)

    monkeypatch.setattr(backend.place, "make_global", spy)
    ts.host_to_global_array({"x": np.zeros((16, 4))}, partition=ts.P("data", "model"))
    assert seen == [[(4, 2)] * 8]


class _WholeMaker:
    """A maker that cuts the blocks itself (as torchax's does): records what it was given."""

    def __init__(self):
        self.got = []

    def __call__(self, shards):
        self.got.append(("shards", len(shards)))
        return shards[0]

    def from_whole(self, t):
        self.got.append(("whole", tuple(t.shape)))
        return t


def test_a_maker_that_cuts_blocks_itself_gets_the_whole_tensor_only_when_it_is_global():
    x = torch.arange(24).reshape(8, 3)
    one_host = plan_from_local(MESH42, ts.P("data"), (8, 3), (0,) * 8, ALL)
    make = _WholeMaker()
    assert views.one_host_placer(one_host, make)(x) is x
    assert make.got == [("whole", (8, 3))]
    # a process's block of a larger global array: the views, as for any maker
    owners = virtual_host_of(2)
    mine = tuple(d for d in ALL if owners[d] == 0)
    block = plan_from_local(MESH42, ts.P("data"), (4, 3), owners, mine)
    assert block.global_shape == (8, 3)
    make = _WholeMaker()
    views.one_host_placer(block, make)(x[:4])
    assert make.got == [("shards", 4)]
