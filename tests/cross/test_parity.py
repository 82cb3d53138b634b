"""Cases where axlearn's and JAX's own tests (utils_test, host_array_test, input_dispatch_test;
array_test, multihost_utils_test) and torch_xla's (test_xla_sharding) expect a behaviour,
adapted to 8 emulated devices and virtual hosts. Expectations come from numpy slicing or from
torch_xla's own shard report, never from torchshard's index maths.
"""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")

import torch_xla
import torch_xla.distributed.spmd as xs
from helpers import host_segments, take_segments, torch_xla_placement, xla_shards

import torchshard as ts
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)

P = ts.P


def _check_shards(g, expected, mesh, spec):
    """Every device holds the numpy slice of ``expected`` at the indices torch_xla reports,
    and those are the indices of ``spec`` on ``mesh``."""
    if g.dtype == torch.complex128:  # torch_xla 2.9 reads these back without imaginary parts
        g, expected = torch.view_as_real(g), np.stack([expected.real, expected.imag], -1)
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(expected.shape)
    shards = xla_shards(g)
    assert sorted(shards) == list(range(8))
    for d, (ranges, data) in shards.items():
        assert ranges == tuple((s.start, s.stop) for s in index_map[d]), d
        np.testing.assert_array_equal(data.numpy(), expected[index_map[d]])


# -- read-back of tensors that were never annotated (JAX's process_allgather returns them) ----


def _unannotated(x):
    """A tensor moved with ``.to()`` and never annotated (a model output before its first
    annotated step): torch_xla gives it no sharding spec."""
    t = torch.as_tensor(x).to(torch_xla.device())
    assert torch_xla._XLAC._get_xla_sharding_spec(t) == ""
    return t


def test_unannotated_tensor_reads_back_whole(mesh42):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    t = _unannotated(x)
    np.testing.assert_array_equal(ts.global_to_host_array(t).numpy(), x)
    np.testing.assert_array_equal(ts.replicate_to_local_data({"t": t})["t"].numpy(), x)
    # mixed with sharded leaves in one tree
    g = ts.host_to_global_array(x, partition=P("data"))
    back = ts.global_to_host_array({"t": t, "g": g, "y": t * 2})
    for k, want in (("t", x), ("g", x), ("y", 2 * x)):
        np.testing.assert_array_equal(back[k].numpy(), want)


@pytest.mark.parametrize("hosts", [2, 4])
def test_unannotated_tensor_is_every_hosts_block(hosts):
    # SPMD holds an unannotated tensor whole on every device: every host's block is all of it.
    x = np.arange(8 * 3).reshape(8, 3)
    with virtual_hosts(hosts), ts.Mesh(np.arange(8), ("data",)):
        blocks = global_to_host_array_per_host({"t": _unannotated(x)})
    assert len(blocks) == hosts
    for b in blocks:
        np.testing.assert_array_equal(b["t"].numpy(), x)


def test_xla_sharded_tensor_from_mark_sharding_reads_back(mesh42):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    st = xs.mark_sharding(
        torch.from_numpy(x).to(torch_xla.device()), mesh42.xla_mesh, ("data", "model")
    )
    assert isinstance(st, xs.XLAShardedTensor)
    np.testing.assert_array_equal(ts.global_to_host_array(st).numpy(), x)
    np.testing.assert_array_equal(ts.replicate_to_local_data([st])[0].numpy(), x)
    with virtual_hosts(2):
        blocks = global_to_host_array_per_host(st)
    np.testing.assert_array_equal(blocks[0].numpy(), x[:4])
    np.testing.assert_array_equal(blocks[1].numpy(), x[4:])


# -- read-back outside a mesh: the tensor carries its sharding --------------------------------


def test_read_back_needs_no_mesh():
    x = np.arange(16).reshape(8, 2)
    with ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model")):
        g = ts.host_to_global_array({"x": x}, partition=P("data", "model"))
        y = g["x"] * 3
    assert ts.current_mesh() is None
    back = ts.global_to_host_array({"x": g["x"], "y": y, "t": _unannotated(x)})
    np.testing.assert_array_equal(back["x"].numpy(), x)
    np.testing.assert_array_equal(back["y"].numpy(), 3 * x)
    np.testing.assert_array_equal(back["t"].numpy(), x)
    np.testing.assert_array_equal(ts.replicate_to_local_data(g)["x"].numpy(), x)
    with virtual_hosts(4):  # no mesh: the emulated topology of the tensor's backend
        blocks = global_to_host_array_per_host(g["x"])
    for h in range(4):
        np.testing.assert_array_equal(blocks[h].numpy(), x[2 * h : 2 * h + 2])


def test_read_back_outside_a_mesh_of_an_empty_tree_or_a_host_array():
    assert ts.global_to_host_array({}) == {}
    assert ts.replicate_to_local_data([]) == []
    assert ts.global_to_host_array({"a": None}) == {"a": None}
    with pytest.raises(
        TypeError,
        match=re.escape(
            "global_arrays['a']: expected a global tensor of the xla backend (e.g. from "
            "host_to_global_array), but got Tensor on cpu."
        ),
    ):
        ts.global_to_host_array({"a": torch.zeros(2)})


# -- global_to_host_array(partition=...): kept, deprecated, ignored (axlearn) ------------------


@pytest.mark.usefixtures("fresh_deprecations")
def test_global_to_host_array_partition_is_deprecated_and_ignored(mesh42):
    x = np.arange(16).reshape(8, 2)
    g = ts.host_to_global_array(x, partition=P("data"))
    message = (
        "global_to_host_array: partition= is deprecated and ignored; each tensor's block "
        "follows its own sharding. Drop the argument."
    )
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as record:
        back = ts.global_to_host_array(g, partition=ts.DataPartitionType.REPLICATED)
    assert record[0].filename == __file__  # points at the caller
    np.testing.assert_array_equal(back.numpy(), x)
    # once per process; partition=None (axlearn's way of not passing it) never warns
    np.testing.assert_array_equal(ts.global_to_host_array(g, partition=P("model")).numpy(), x)
    np.testing.assert_array_equal(ts.global_to_host_array(g, partition=None).numpy(), x)


# -- P((), "x") is P(None, "x") (JAX) ----------------------------------------------------------


def test_empty_tuple_entry_is_not_split():
    assert P((), "x") == P(None, "x")
    assert hash(P((), "x")) == hash(P(None, "x"))
    assert P([], ("x", "y")) == P(None, ("x", "y"))
    assert P(()) == P(None) and P(()).axes == ()
    assert {P((), "x"): 1}[P(None, "x")] == 1
    assert repr(P((), "x")) == "P(None, 'x')"


def test_empty_tuple_entry_places_like_none(mesh42):
    x = np.arange(8 * 4).reshape(8, 4)
    g = ts.host_to_global_array(x, partition=P((), "model"))
    _check_shards(g, x, mesh42, P(None, "model"))


def test_spmd_input_dispatcher_accepts_an_empty_tuple_for_other_dims():
    # axlearn's input_dispatch_test builds SpmdInputDispatcher with P(("x",), ()).
    with virtual_hosts(2, process_index=1), ts.Mesh(np.arange(8).reshape(2, 4), ("x", "y")):
        d = ts.SpmdInputDispatcher(8, partition_spec=P(("x",), ()))
        assert d.feed_read_config() == {"num_shards": 2, "shard_index": 1}
        assert d.feed_logical_batch_size == 4
        assert d.partition_spec == P(("x",), None)


# -- complex64 and complex128 (torch_xla 2.9 places them) -------------------------------------


def test_torch_xla_reads_sharded_complex128_back_without_imaginary_parts(mesh42):
    """Why the xla backend reads complex128 through view_as_real: torch_xla's own copy to the
    host drops the imaginary parts (while the device data holds them). When this fails,
    torch_xla has fixed it and the workaround can go."""
    x = torch.tensor([1 + 2j, 3 + 4j] * 4, dtype=torch.complex128)
    t = x.to(torch_xla.device())
    xs.mark_sharding(t, mesh42.xla_mesh, ("data",))
    assert torch.imag(t).cpu().tolist() == [2.0, 4.0] * 4
    assert torch.imag(t.cpu()).tolist() == [0.0] * 8


def _complex(shape, dtype):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("spec", [P("data"), P("data", "model"), P(), P(None, ("model", "data"))])
def test_complex_round_trip(mesh42, dtype, spec):
    x = _complex((8, 8), dtype)
    for leaf in (x, torch.from_numpy(x)):
        g = ts.host_to_global_array({"x": leaf}, partition=spec)
        assert g["x"].dtype == torch.from_numpy(x).dtype
        _check_shards(g["x"], x, mesh42, spec)
        np.testing.assert_array_equal(ts.global_to_host_array(g)["x"].numpy(), x)
        np.testing.assert_array_equal(ts.replicate_to_local_data(g["x"] * 2).numpy(), 2 * x)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_per_host_and_background_route(dtype, monkeypatch):
    from torchshard._backend.registry import lookup
    from torchshard._backend.xla import backend as backend_xla
    from torchshard._mesh.context import current_topology
    from torchshard._place.call import read
    from torchshard._place.place import to_global

    x = _complex((8, 2), dtype)
    with virtual_hosts(2), ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model")) as mesh:
        g = host_to_global_array_per_host([x[:4], x[4:]], partition=P("data"))
        _check_shards(g, x, mesh, P("data"))
        blocks = global_to_host_array_per_host(g)
        np.testing.assert_array_equal(blocks[1].numpy(), x[4:])
        # the loader thread's GIL-free transfer (dim 0 split over every device)
        monkeypatch.setattr(backend_xla, "GIL_FREE_MIN_BYTES", 0)
        call = read([x[:4], x[4:]], current_topology(mesh), P(("data", "model")), per_host=True)
        g = to_global(mesh, lookup(mesh), current_topology(mesh), call, background=True)
        _check_shards(g, x, mesh, P(("data", "model")))


# -- global_shape= (JAX's make_array_from_process_local_data with global_shape) -------------

GLOBAL_SPECS = [P("data", "model"), P("model", "data"), P(("data", "model")), P(None, "model")]


@pytest.mark.parametrize("hosts", [2, 4])
@pytest.mark.parametrize("spec", GLOBAL_SPECS, ids=str)
@pytest.mark.parametrize("whole", [(False, False), (True, False), (False, True), (True, True)])
def test_global_shape_blocks_may_cover_whole_dimensions(hosts, spec, whole):
    """Along each dimension a host passes either the whole dimension or its own part; the
    expected placement is torch_xla's own (mark_sharding), the host parts come from it."""
    x = np.arange(8 * 8, dtype=np.int32).reshape(8, 8)
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
    placement = torch_xla_placement(x, mesh, spec)
    device_host = [d // (8 // hosts) for d in range(8)]
    parts = host_segments({d: r for d, (r, _) in placement.items()}, device_host, 2)
    blocks = [
        take_segments(x, [[(0, 8)] if whole[i] else parts[h][i] for i in range(2)])
        for h in range(hosts)
    ]
    with virtual_hosts(hosts), mesh:
        g = host_to_global_array_per_host(blocks, partition=spec, global_shape=(8, 8))
        back = global_to_host_array_per_host(g)
    assert tuple(g.shape) == (8, 8)
    for d, (ranges, data) in xla_shards(g).items():
        assert ranges == placement[d][0], d
        np.testing.assert_array_equal(data.numpy(), placement[d][1].numpy())
    for h in range(hosts):  # reading back gives each host its own part
        np.testing.assert_array_equal(back[h].numpy(), take_segments(x, parts[h]))


@pytest.mark.parametrize("hosts", [1, 2])
@pytest.mark.parametrize("spec", GLOBAL_SPECS, ids=str)
@pytest.mark.parametrize("block", [(8, 8), (4, 8), (8, 2), (4, 2), (8, 4)])
def test_host_to_global_specs_takes_global_shape_as_the_arrays_do(hosts, spec, block):
    """host_to_global_specs(global_shape=) says what host_to_global_array returns, or raises
    the same error (the oracle: the array call itself, on every host)."""
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
    x = np.zeros(block, np.float32)
    with virtual_hosts(hosts), mesh:
        try:
            g = host_to_global_array_per_host(
                [{"x": x}] * hosts, partition=spec, global_shape=(8, 8)
            )
        except ts.ShardingError as e:
            reason = str(e).split(": ", 1)[1]  # the same reason, after the leaf's path
            with pytest.raises(type(e), match="^" + re.escape(f"host_specs['x']: {reason}")):
                ts.host_to_global_specs({"x": x}, partition=spec, global_shape=(8, 8))
            return
        specs = ts.host_to_global_specs({"x": x}, partition=spec, global_shape=(8, 8))
    assert specs["x"].shape == tuple(g["x"].shape) == (8, 8)
    assert specs["x"].sharding == ts.NamedSharding(mesh, spec)


def test_global_shape_on_one_host_and_as_a_tree(mesh42):
    x = np.arange(16).reshape(8, 2)
    y = np.arange(8)
    out = ts.host_to_global_array(
        {"x": x, "y": y}, partition=P("data"), global_shape={"x": (8, 2), "y": None}
    )
    _check_shards(out["x"], x, mesh42, P("data"))
    _check_shards(out["y"], y, mesh42, P("data"))
    same = ts.host_to_global_array(x, partition=P("data", "model"), global_shape=[8, 2])
    _check_shards(same, x, mesh42, P("data", "model"))


def test_global_shape_a_host_slices_non_uniform_dims():
    """JAX's case of a non-uniform dimension: hosts whose devices hold overlapping but
    different sets of shards along it cannot infer a global shape; given one, each host
    passes the whole of that dimension."""
    mesh = ts.Mesh(np.array([[0, 1, 2, 3], [4, 6, 5, 7]]), ("a", "b"))
    x = np.arange(4 * 8).reshape(4, 8)
    spec = P("a", "b")  # along dim 1 the hosts hold the 'b' shards {0,1}, {2,3}, {0,2}, {1,3}
    blocks = [x[2 * (h // 2) : 2 * (h // 2) + 2] for h in range(4)]  # own rows, every column
    with virtual_hosts(4), mesh:
        with pytest.raises(ts.errors.NonUniformShardingError, match="dim 1 is not process-uniform"):
            host_to_global_array_per_host([b[:, :4] for b in blocks], partition=spec)
        g = host_to_global_array_per_host(blocks, partition=spec, global_shape=(4, 8))
    placement = torch_xla_placement(x, mesh, spec)
    for d, (ranges, data) in xla_shards(g).items():
        assert ranges == placement[d][0]
        np.testing.assert_array_equal(data.numpy(), placement[d][1].numpy())


@pytest.mark.parametrize(
    ("block", "global_shape", "error", "message"),
    [
        (
            np.zeros((3, 8)),
            (8, 8),
            ts.ShardingError,
            (
                "per_host_arrays[0]['x']: dim 0 of the host block has size 3, but with "
                "global_shape (8, 8) a host passes along it either the whole dimension, 8 (each "
                "host then takes the slices its devices need), or its own part, 4 (1 distinct "
                "shard(s) of 4 on its "
                "devices), under P('data', 'model') on mesh {'data': 2, 'model': 4}. Pass a block "
                "of one of those sizes, or fix global_shape."
            ),
        ),
        (
            np.zeros((4, 8)),
            (8, 8, 1),
            ts.ShardingError,
            (
                "per_host_arrays[0]['x']: global_shape (8, 8, 1) has 3 dimensions, but the host "
                "block has shape (4, 8) (2 dimensions); give one size per dimension."
            ),
        ),
        (
            np.zeros((4, 6)),
            (8, 6),
            ts.errors.IndivisibleError,
            "per_host_arrays[0]['x']: dim 1 has size 6, not divisible by 4",
        ),
        (
            np.zeros((4, 8)),
            (8, -8),
            ValueError,
            (
                # one shape for every leaf: checked once, naming global_shape itself
                "global_shape: every size of a shape must be >= 0, but dim 1 of (8, -8) is -8."
            ),
        ),
        (
            np.zeros((4, 8)),
            "88",
            TypeError,
            (
                "global_shape: expected a shape (a tuple of ints), or a tree of them (and None) "
                "matching per_host_arrays, but got str '88'."
            ),
        ),
        (
            np.zeros((4, 8)),
            {"y": (8, 8)},
            ts.errors.TreeStructureError,
            "global_shape",
        ),
    ],
)
def test_global_shape_errors(block, global_shape, error, message):
    with virtual_hosts(2), ts.Mesh(np.arange(8).reshape(2, 4), ("data", "model")):
        with pytest.raises(error, match="^" + re.escape(message)):
            host_to_global_array_per_host(
                [{"x": block}, {"x": block}],
                partition=P("data", "model"),
                global_shape=global_shape,
            )


# -- an already-global leaf: returned as it is when its layout matches (JAX) ------------------


def test_already_global_leaf_is_returned_as_it_is(mesh42):
    x = np.arange(16).reshape(8, 2)
    g = ts.host_to_global_array(x, partition=P("data", "model"))
    out = ts.host_to_global_array({"g": g, "h": x}, partition=P("data", "model"))
    assert out["g"] is g
    _check_shards(out["h"], x, mesh42, P("data", "model"))
    assert ts.host_to_global_array([g], partition=P("data", "model"), global_shape=(8, 2))[0] is g
    # an unannotated tensor is whole on every device: the layout of P()
    t = _unannotated(x)
    assert ts.host_to_global_array(t, partition=P()) is t
    # so is the XLAShardedTensor xs.mark_sharding returns, for its layout
    st = xs.mark_sharding(_unannotated(x), mesh42.xla_mesh, ("data", None))
    assert ts.host_to_global_array(st, partition=P("data")) is st
    with virtual_hosts(2):  # every host passes the same global tensor
        assert host_to_global_array_per_host([g, g], partition=P("data", "model")) is g


def test_already_global_leaf_laid_out_otherwise_is_refused(mesh42):
    x = np.arange(16).reshape(8, 2)
    g = ts.host_to_global_array(x, partition=P("data"))
    with pytest.raises(
        ts.ShardingError,
        match="^"
        + re.escape(
            "host_arrays['g']: already a global tensor, but not laid out as P('data', 'model') "
            "on Mesh({'data': 4, 'model': 2}) asks; found per device (global [start, stop) per "
            "dimension) 0: [(0, 2), (0, 2)], 1: [(0, 2), (0, 2)], 2: [(2, 4), (0, 2)]"
        ),
    ):
        ts.host_to_global_array({"g": g}, partition=P("data", "model"))
    with pytest.raises(ts.ShardingError, match=re.escape("or read it back first")):
        ts.host_to_global_array(_unannotated(x))  # FULL splits dim 0; it is whole everywhere
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "host_arrays[0]: already a global tensor of shape (8, 2), but global_shape is "
            "(16, 2). Drop global_shape for it, or give (8, 2)."
        ),
    ):
        ts.host_to_global_array([g], partition=P("data"), global_shape=(16, 2))
    with virtual_hosts(2):
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "per_host_arrays[1]: per_host_arrays[0] is already a global tensor, so every "
                "host must pass that same tensor here; got something else."
            ),
        ):
            host_to_global_array_per_host([g, x[4:]], partition=P("data"))
