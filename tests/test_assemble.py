"""host_to_global_array, host_to_global_specs, global_to_host_array, replicate_to_local_data
(torchshard._place.host_to_global, _engine, _readback): types, dtypes, shardings, threads,
deprecations, read-back."""

import collections
import dataclasses
import re
import threading
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla: pip install 'torchshard[xla]'")
import torch_xla
import torch_xla.distributed.spmd as xs
from helpers import DTYPES, to_numpy, xla_shards

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Batch:
    ids: object
    mask: object = None


def _check_shards(g, expected, mesh, spec):
    """Each device holds the numpy slice devices_indices_map names; torch_xla agrees."""
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(tuple(expected.shape))
    shards = xla_shards(g)
    assert sorted(shards) == list(range(8))
    for d, (ranges, data) in shards.items():
        assert ranges == tuple((s.start, s.stop) for s in index_map[d])
        np.testing.assert_array_equal(
            to_numpy(data), to_numpy(torch.as_tensor(expected))[index_map[d]]
        )


# -- structure --


def test_tree_types_are_kept_and_none_passes_through(mesh42):
    x = np.arange(16).reshape(8, 2)
    tree = {
        "d": {"a": x, "b": None},
        "l": [x, torch.from_numpy(x)],
        "t": (x,),
        "p": Point(x, None),
        "c": Batch(ids=x),
        "n": None,
    }
    g = ts.host_to_global_array(tree)
    assert type(g["t"]) is tuple and type(g["p"]) is Point and type(g["c"]) is Batch
    assert type(g["l"]) is list and len(g["l"]) == 2
    assert g["d"]["b"] is None and g["p"].y is None and g["c"].mask is None and g["n"] is None
    assert all(t.device.type == "xla" for t in (g["d"]["a"], g["l"][0], g["t"][0], g["c"].ids))
    back = ts.global_to_host_array(g)
    assert type(back["t"]) is tuple and type(back["p"]) is Point and type(back["c"]) is Batch
    assert back["n"] is None and back["p"].y is None
    for leaf in (back["d"]["a"], back["l"][0], back["l"][1], back["t"][0], back["c"].ids):
        assert isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"
        np.testing.assert_array_equal(leaf.numpy(), x)


def test_a_single_array_is_a_tree(mesh42):
    g = ts.host_to_global_array(np.arange(8))
    assert isinstance(g, torch.Tensor) and tuple(g.shape) == (8,)
    assert ts.global_to_host_array(g).tolist() == list(range(8))
    assert ts.host_to_global_array(None) is None
    assert ts.host_to_global_array({}) == {}


def test_zero_d_leaves_under_a_replicated_spec(mesh42):
    g = ts.host_to_global_array(
        {"s": np.float32(2.5), "t": torch.tensor(7), "v": np.zeros(3)}, partition=ts.P()
    )
    assert g["s"].shape == () and g["t"].shape == ()
    _check_shards(g["s"], np.float32(2.5), ts.current_mesh(), ts.P())
    back = ts.global_to_host_array(g)
    assert back["s"].item() == 2.5 and back["t"].item() == 7


def test_zero_d_leaf_under_full_is_a_clear_error(mesh42):
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "host_arrays['s']: partition spec P(('data', 'model'),) has 1 entries but the array "
            "has rank 0; a spec may not be longer than the rank of the array it shards."
        ),
    ):
        ts.host_to_global_array({"s": np.float32(1)})


def test_empty_batch(mesh42):
    g = ts.host_to_global_array({"x": np.zeros((0, 3), np.float32)})
    assert tuple(g["x"].shape) == (0, 3)
    assert tuple(ts.global_to_host_array(g)["x"].shape) == (0, 3)


# -- dtypes --


def _values(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen
    ).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("source", ["torch", "numpy"])
def test_every_dtype_round_trips_bit_exact(mesh42, dtype, source):
    x = _values(dtype, (8, 4))
    if source == "numpy":
        if dtype == torch.bfloat16:
            pytest.skip("numpy has no bfloat16; bfloat16 host data is a torch.Tensor")
        x = x.numpy()
    spec = ts.P("data", "model")
    g = ts.host_to_global_array({"x": x}, partition=spec)
    assert g["x"].dtype == dtype
    _check_shards(g["x"], torch.as_tensor(x), ts.current_mesh(), spec)
    back = ts.global_to_host_array(g)["x"]
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), torch.as_tensor(x).view(torch.uint8))


def test_nan_and_signed_zero_are_bit_exact(mesh42):
    x = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")] * 2, dtype=torch.bfloat16)
    back = ts.global_to_host_array(ts.host_to_global_array(x))
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


def test_non_contiguous_host_arrays(mesh42):
    x = torch.arange(64).reshape(4, 16).T  # a transposed view
    y = np.arange(64).reshape(16, 4)[::-1]  # negative strides
    g = ts.host_to_global_array({"x": x, "y": y}, partition=ts.P("data", "model"))
    back = ts.global_to_host_array(g)
    assert torch.equal(back["x"], x)
    np.testing.assert_array_equal(back["y"].numpy(), y)


def test_host_data_is_not_modified(mesh42):
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    before = x.copy()
    g = ts.host_to_global_array({"x": x})
    np.testing.assert_array_equal(x, before)
    x[:] = -1  # the global tensor does not alias host memory
    np.testing.assert_array_equal(ts.global_to_host_array(g)["x"].numpy(), before)


# -- partitions --


@pytest.mark.parametrize(
    "spec",
    [
        ts.P(("data", "model")),
        ts.P(("model", "data")),
        ts.P("data"),
        ts.P("model"),
        ts.P(None, "model"),
        ts.P("data", "model"),
        ts.P("model", "data"),
        ts.P(None, None, "data"),
        ts.P(),
    ],
    ids=str,
)
def test_specs_on_a_permuted_mesh(spec):
    mesh = ts.Mesh(np.array([5, 2, 7, 0, 3, 6, 1, 4]).reshape(4, 2), ("data", "model"))
    x = np.arange(8 * 8 * 4).reshape(8, 8, 4)
    with mesh:
        g = ts.host_to_global_array({"x": x}, partition=spec)
        _check_shards(g["x"], x, mesh, spec)
        np.testing.assert_array_equal(ts.global_to_host_array(g)["x"].numpy(), x)


def test_spec_tree_prefix(mesh42):
    x = np.arange(16).reshape(8, 2)
    tree = {"a": x, "b": {"c": x, "d": [x, x]}}
    partition = {"a": ts.P("data"), "b": {"c": None, "d": ts.P(None, "model")}}
    g = ts.host_to_global_array(tree, partition=partition)
    mesh = ts.current_mesh()
    _check_shards(g["a"], x, mesh, ts.P("data"))
    _check_shards(g["b"]["c"], x, mesh, ts.P())
    _check_shards(g["b"]["d"][1], x, mesh, ts.P(None, "model"))
    assert ts.global_to_host_array(g)["b"]["d"][0].tolist() == x.tolist()


def test_partition_none_replicates(mesh42):
    g = ts.host_to_global_array({"x": np.arange(3)}, partition=None)
    _check_shards(g["x"], np.arange(3), ts.current_mesh(), ts.P())


def test_full_spreads_over_every_axis_and_checks_batch_agreement(mesh42):
    g = ts.host_to_global_array({"x": np.arange(8), "y": np.zeros((8, 3))})
    _check_shards(g["x"], np.arange(8), ts.current_mesh(), ts.P(("data", "model")))


def test_batch_partition_infers_the_global_shape_from_the_mesh(fresh_deprecations):
    # BATCH is P(("data",), ("seq",)) here; with 2 hosts each host holds half of the rows
    # (mesh rows follow hosts) and every column block, so the global batch is 2 x the local one.
    mesh = ts.Mesh(np.arange(8).reshape(2, 2, 2), ("data", "seq", "model"))
    x = np.arange(8 * 4).reshape(8, 4)
    with virtual_hosts(2), mesh:
        with pytest.warns(DeprecationWarning, match="Passing a DataPartitionType"):
            g = host_to_global_array_per_host([x[:4], x[4:]], partition=ts.DataPartitionType.BATCH)
        assert tuple(g.shape) == (8, 4)
        _check_shards(g, x, mesh, ts.P(("data",), ("seq",)))
        back = global_to_host_array_per_host(g)
    np.testing.assert_array_equal(back[0].numpy(), x[:4])
    np.testing.assert_array_equal(back[1].numpy(), x[4:])


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


# -- host_to_global_specs --


def test_host_to_global_specs_matches_host_to_global_array(mesh42):
    host = {"x": np.zeros((8, 2), np.float32), "y": [torch.zeros(8, dtype=torch.int8)]}
    specs = ts.host_to_global_specs(host)
    g = ts.host_to_global_array(host)
    mesh = ts.current_mesh()
    assert specs == {
        "x": ts.TensorSpec(
            (8, 2), np.dtype(np.float32), ts.NamedSharding(mesh, ts.P(("data", "model")))
        ),
        "y": [ts.TensorSpec((8,), torch.int8, ts.NamedSharding(mesh, ts.P(("data", "model"))))],
    }
    assert specs["x"].shape == tuple(g["x"].shape) and specs["y"][0].shape == tuple(g["y"][0].shape)


def test_host_to_global_specs_leaves(mesh42):
    @dataclasses.dataclass
    class ShapeDtype:  # a dataclass with .shape/.dtype is a leaf here, not a node
        shape: tuple
        dtype: object

    ShapeNT = collections.namedtuple("ShapeNT", "shape dtype")
    host = {
        "a": ts.TensorSpec((8, 3), torch.bfloat16),
        "b": ShapeDtype((8,), torch.int32),
        "c": ShapeNT((8, 1), np.float32),
        "d": None,
    }
    out = ts.host_to_global_specs(
        host, partition={"a": ts.P("data"), "b": None, "c": ts.P("model"), "d": None}
    )
    mesh = ts.current_mesh()
    assert out["a"] == ts.TensorSpec((8, 3), torch.bfloat16, ts.NamedSharding(mesh, ts.P("data")))
    assert out["b"] == ts.TensorSpec((8,), torch.int32, ts.NamedSharding(mesh, ts.P()))
    assert out["c"] == ts.TensorSpec((8, 1), np.float32, ts.NamedSharding(mesh, ts.P("model")))
    assert out["d"] is None


def test_host_to_global_specs_under_virtual_hosts(mesh42):
    with virtual_hosts(2):
        out = ts.host_to_global_specs({"x": ts.TensorSpec((4, 3), torch.float32)})
    assert out["x"].shape == (8, 3)


def test_host_to_global_specs_errors_name_the_leaf(mesh42):
    with pytest.raises(
        ts.errors.IndivisibleError,
        match=re.escape("host_specs['x']: dim 0 has size 6, not divisible by 8"),
    ):
        ts.host_to_global_specs({"x": ts.TensorSpec((6,), torch.float32)})
    with pytest.raises(
        TypeError,
        match=re.escape(
            "host_specs['y']: expected a TensorSpec or an object with .shape and .dtype, but got "
            "int."
        ),
    ):
        ts.host_to_global_specs({"y": 3})
    with pytest.raises(
        ts.ShardingError,
        match=re.escape("host_specs['x']: partition spec P('nope',) names mesh axis 'nope'"),
    ):
        ts.host_to_global_specs({"x": ts.TensorSpec((8,), torch.float32)}, partition=ts.P("nope"))


# -- read-back --


def test_global_to_host_array_reads_local_shards_without_compiling(mesh42, monkeypatch):
    import torch_xla.debug.metrics as met

    g = ts.host_to_global_array({"x": np.arange(16).reshape(8, 2)}, partition=ts.P("data"))
    backend = lookup(ts.current_mesh())

    def no_gather(x):
        raise AssertionError("global_to_host_array must not gather")

    monkeypatch.setattr(backend.read, "gather", no_gather)
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: no_gather(self))
    before = met.metric_data("CompileTime")
    back = ts.global_to_host_array(g)
    full = ts.replicate_to_local_data(g)  # one host holds everything: no gather either
    assert met.metric_data("CompileTime") == before
    monkeypatch.undo()
    assert back["x"].tolist() == np.arange(16).reshape(8, 2).tolist()
    assert full["x"].tolist() == back["x"].tolist()


def test_step_outputs_with_padded_shards_read_back(mesh42):
    # torch_xla pads uneven shards; reading back crops the padding.
    x = torch.arange(30).reshape(10, 3)
    t = x.to(torch_xla.device())
    xs.mark_sharding(t, ts.current_mesh().xla_mesh, ("data", "model"))
    back = ts.global_to_host_array({"t": t, "y": t * 2})
    assert torch.equal(back["t"], x) and torch.equal(back["y"], x * 2)
    assert torch.equal(ts.replicate_to_local_data(t), x)


def test_unsharded_xla_tensors_read_back(mesh42):
    t = torch.arange(5, device=torch_xla.device())
    assert ts.global_to_host_array(t).tolist() == list(range(5))


def test_replicate_to_local_data_falls_back_to_gather_when_blocks_are_missing(mesh42, monkeypatch):
    g = ts.host_to_global_array({"x": np.arange(8)})
    backend = lookup(ts.current_mesh())
    real = backend.read.local_shards
    monkeypatch.setattr(backend.read, "local_shards", lambda ts_: [s[:4] for s in real(ts_)])
    gathered = []
    monkeypatch.setattr(backend.read, "gather", lambda x: gathered.append(x) or x.cpu())
    assert ts.replicate_to_local_data(g)["x"].tolist() == list(range(8))
    assert len(gathered) == 1


def test_read_back_needs_global_tensors(mesh42):
    for fn, name in ((ts.global_to_host_array, "global_arrays"), (ts.replicate_to_local_data, "x")):
        with pytest.raises(
            TypeError,
            match=re.escape(
                f"{name}['a'][1]: expected a global tensor of the xla backend (e.g. from "
                "host_to_global_array), but got ndarray."
            ),
        ):
            fn({"a": [torch.zeros(1, device=torch_xla.device()), np.zeros(3)]})
        with pytest.raises(TypeError, match=re.escape("but got Tensor on cpu.")):
            fn({"a": [torch.zeros(1, device=torch_xla.device()), torch.zeros(3)]})


def test_non_grid_layout_in_the_emulation_and_on_a_real_run(monkeypatch):
    """A host whose two devices hold rows 0:2 x cols 0:3 and rows 2:4 x cols 3:6 has the block
    rows 0:4 x cols 0:6, half of it on host 1's devices (conformance case hl005)."""
    mesh = ts.Mesh(np.array([0, 2, 3, 1, 4, 6, 7, 5]).reshape(4, 2), ("x", "y"))
    G = np.arange(48).reshape(8, 6)
    per = [G[0:4], G[0:4], G[4:8], G[4:8]]
    with virtual_hosts(4), mesh:
        g = host_to_global_array_per_host(per, partition=ts.P("x", "y"))
        _check_shards(g, G, mesh, ts.P("x", "y"))
        for h, block in enumerate(global_to_host_array_per_host(g)):
            np.testing.assert_array_equal(block.numpy(), per[h])
        # On a real multi-host run only the process's own devices are addressable.
        backend = lookup(mesh)
        real = backend.read.local_shards
        monkeypatch.setattr(
            backend.read,
            "local_shards",
            lambda t: [[s for s in x if s.device in (0, 1)] for x in real(t)],
        )
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "global_arrays['g']: host 0's block spans the ranges [[(0, 2), (2, 4)], [(0, 3), "
                "(3, 6)]] (one list per dimension), but this process can read only 12 of its 24 "
                "elements: the layout is not a grid per host (the host's devices do not hold the "
                "whole cross product of their slices; other hosts' devices hold the rest). Read "
                "the whole value with replicate_to_local_data, or use a mesh whose device order "
                "follows host boundaries (e.g. create_device_mesh with a HybridMeshShape)."
            ),
        ):
            ts.global_to_host_array({"g": g})


# -- nothing moves on bad input --


@pytest.mark.parametrize(
    ("tree", "partition", "error"),
    [
        ({"a": np.zeros(8), "b": np.zeros(6)}, ts.P("data"), ts.errors.IndivisibleError),
        ({"a": np.zeros(8), "b": np.array(["s"] * 8)}, ts.P("data"), TypeError),
        (
            {"a": np.zeros(8), "b": np.zeros(8)},
            {"a": ts.P("data"), "c": None},
            ts.errors.TreeStructureError,
        ),
        ({"a": np.zeros(8), "b": np.zeros(4)}, None, None),  # FULL: batch sizes disagree
        (
            {"a": np.zeros(8), "b": np.zeros(8)},
            {"a": ts.P(), "b": ts.P("data", "x")},
            ts.ShardingError,
        ),
    ],
)
def test_nothing_is_transferred_when_any_leaf_is_bad(mesh42, monkeypatch, tree, partition, error):
    backend = lookup(ts.current_mesh())
    calls = []
    monkeypatch.setattr(backend.place, "make_global", lambda *a: calls.append(a))
    kwargs = {} if error is None else {"partition": partition}
    with pytest.raises(error or ts.ShardingError):
        ts.host_to_global_array(tree, **kwargs)
    assert calls == []


# -- deprecations --


def test_host_to_global_device_array_warns_once(mesh42, fresh_deprecations):
    with pytest.warns(
        DeprecationWarning,
        match=re.escape("host_to_global_device_array is deprecated; use host_to_global_array."),
    ) as record:
        g = ts.host_to_global_device_array({"x": np.arange(8)})
    assert [w.filename for w in record] == [__file__]
    assert ts.global_to_host_array(g)["x"].tolist() == list(range(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.host_to_global_device_array({"x": np.arange(8)})  # second call: silent


def test_passing_a_data_partition_type_warns_once(mesh42, fresh_deprecations):
    message = (
        "Passing a DataPartitionType to host_to_global_array is deprecated; pass a "
        "PartitionSpec (e.g. torchshard.input_partition_spec()) instead."
    )
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as record:
        g = ts.host_to_global_array({"x": np.arange(8)}, partition=ts.DataPartitionType.FULL)
    assert [w.filename for w in record] == [__file__]
    _check_shards(g["x"], np.arange(8), ts.current_mesh(), ts.P(("data", "model")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.host_to_global_array({"x": np.arange(8)}, partition=ts.DataPartitionType.REPLICATED)
        ts.host_to_global_specs({"x": np.arange(8)}, partition=ts.DataPartitionType.FULL)
        ts.host_to_global_array({"x": np.arange(8)})  # the default never warns


def test_deprecation_points_at_the_caller_through_every_entry(mesh42, fresh_deprecations):
    with pytest.warns(DeprecationWarning) as record:
        ts.host_to_global_specs({"x": np.zeros(8)}, partition=ts.DataPartitionType.FULL)
    assert [w.filename for w in record] == [__file__]
    from torchshard._core import deprecation as _deprecation

    _deprecation.reset()
    with virtual_hosts(2), pytest.warns(DeprecationWarning) as record:
        host_to_global_array_per_host(
            [np.zeros(4), np.zeros(4)], partition=ts.DataPartitionType.FULL
        )
    assert [w.filename for w in record] == [__file__]


# -- threads --


def test_four_threads_each_with_its_own_mesh_and_data():
    meshes = [
        ts.Mesh(np.arange(8), ("data",)),
        ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model")),
        ts.Mesh(np.arange(8)[::-1].reshape(2, 4), ("data", "model")),
        ts.Mesh(np.array([3, 1, 0, 2, 7, 5, 6, 4]).reshape(2, 2, 2), ("a", "data", "b")),
    ]
    specs = [ts.P("data"), ts.P("data", "model"), ts.P("model", "data"), ts.P(("a", "b"), "data")]
    barrier = threading.Barrier(4, timeout=60)
    errors, done = [], []

    def work(i):
        try:
            mesh, spec = meshes[i], specs[i]
            with mesh:
                barrier.wait()
                for step in range(15):
                    x = np.arange(16 * 8).reshape(16, 8) * (i + 1) + step
                    g = ts.host_to_global_array(
                        {"x": x, "i": np.full((16,), i)}, partition={"x": spec, "i": ts.P(spec[0])}
                    )
                    assert ts.current_mesh() is mesh
                    _check_shards(g["x"], x, mesh, spec)
                    back = ts.global_to_host_array(g)
                    np.testing.assert_array_equal(back["x"].numpy(), x)
                    np.testing.assert_array_equal(back["i"].numpy(), np.full((16,), i))
            done.append(i)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i,), name=f"h2g-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert sorted(done) == [0, 1, 2, 3]


def test_dataclass_spec_prefix(mesh42):
    x = np.arange(16).reshape(8, 2)
    g = ts.host_to_global_array(
        Batch(ids=x, mask={"m": x}), partition=Batch(ids=ts.P("data"), mask=None)
    )
    _check_shards(g.ids, x, ts.current_mesh(), ts.P("data"))
    _check_shards(g.mask["m"], x, ts.current_mesh(), ts.P())


# -- the plan cache --


def test_repeated_calls_reuse_plans_but_never_data_or_skipped_checks(mesh42):
    """A call's plans are kept by (mesh, topology, partition, structure, leaf types, shapes,
    dtypes): a hit still reads the new data, a bad call in between is still refused (and not
    cached), and a numpy leaf of the same shape is not taken for a tensor."""
    from torchshard._core.tree import structure
    from torchshard._place import cache as _engine

    spec = ts.P(("data", "model"))
    first = torch.arange(32).reshape(8, 4)
    g = ts.host_to_global_array({"x": first}, partition=spec)
    key = next(k for k in _engine._CALLS if k[4] == (structure({"x": 0}),) and k[3] == spec)
    plans = _engine._CALLS[key].plans
    assert all(not any(isinstance(v, torch.Tensor) for v in vars(p).values()) for p in plans)
    with pytest.raises(ts.ShardingError, match=r"host_arrays\['x'\]"):
        ts.host_to_global_array({"x": torch.zeros(7, 4)}, partition=spec)
    second = first + 100
    g = ts.host_to_global_array({"x": second}, partition=spec)
    assert _engine._CALLS[key].plans is plans  # a hit
    _check_shards(g["x"], second.numpy(), ts.current_mesh(), spec)
    g = ts.host_to_global_array({"x": second.numpy().astype(np.int32)}, partition=spec)
    assert g["x"].dtype == torch.int32
    _check_shards(g["x"], second.numpy(), ts.current_mesh(), spec)
    needs_grad = second.float().requires_grad_()  # not cached: converted (detached) each call
    for _ in range(2):
        g = ts.host_to_global_array({"x": needs_grad}, partition=spec)
        _check_shards(g["x"], second.float().numpy(), ts.current_mesh(), spec)
