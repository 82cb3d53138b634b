"""host_to_global_array, host_to_global_specs and host_to_global_device_array
(torchshard._place.host_to_global): tree types, dtypes, shardings, threads, deprecations, each
checked by reading the global tensors back. The read-back itself is tested in test_readback.py,
the plan cache in test_cache.py, the per-device views in test_views.py."""

import collections
import dataclasses
import re
import threading
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
from helpers import DTYPES, to_numpy, xla_shards

import torchshard as ts
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


# -- paths: only for errors --


def test_paths_are_computed_only_for_errors(mesh42, monkeypatch):
    """A leaf's path names it in an error, and nothing else builds one: placing a tree of 64
    leaves (numpy arrays and tensors, nested; the first call, which plans, and a cached one),
    its specs, every host's tree under virtual_hosts, and reading them back build no path
    (before: every call with a numpy leaf built them all); a bad leaf builds them once."""
    from torchshard._core import tree

    built = []
    real = tree.paths
    monkeypatch.setattr(
        tree, "paths", lambda spec, name, *parts: built.append(name) or real(spec, name, *parts)
    )

    def batch(h=0):
        return {
            f"x{i:02d}": [np.full((8, 2), h + i, np.float32) if i % 2 else torch.full((8,), i)]
            for i in range(64)
        }

    for _ in range(2):  # planned, then cached
        g = ts.host_to_global_array(batch())
    specs = ts.host_to_global_specs(batch())
    back = ts.global_to_host_array(g)
    assert specs["x63"][0].shape == (8, 2) and back["x63"][0][7, 1].item() == 63
    with virtual_hosts(2):
        for _ in range(2):
            g = host_to_global_array_per_host([batch(0), batch(100)])
        back = global_to_host_array_per_host(g)
    assert back[1]["x63"][0][0, 0].item() == 163
    assert built == []
    bad = batch()
    bad["x63"] = ["not an array"]
    with pytest.raises(TypeError, match=re.escape("host_arrays['x63'][0]: expected a numpy")):
        ts.host_to_global_array(bad)
    assert built == ["host_arrays"]


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


# -- a partition dict is matched to the data by key, whatever flavour each dict is --


@pytest.mark.parametrize(
    ("data_type", "partition_type"),
    [
        (collections.OrderedDict, dict),
        (dict, collections.OrderedDict),
        (lambda items: collections.defaultdict(list, items), collections.OrderedDict),
        (collections.OrderedDict, lambda items: collections.defaultdict(list, items)),
    ],
    ids=["OrderedDict-data", "OrderedDict-partition", "defaultdict-data", "defaultdict-partition"],
)
def test_a_partition_dict_is_matched_to_the_data_by_key(mesh8, data_type, partition_type):
    """OrderedDict(b=..., a=...) data with {"a": P(), "b": P("data")} gave ``a`` the spec of
    ``b`` and ``b`` the spec of ``a`` (optree sorts a dict's keys, keeps an OrderedDict's
    order, and the specs were matched by position)."""
    b = np.arange(16, dtype=np.float32).reshape(8, 2)
    a = np.arange(24, dtype=np.int32).reshape(4, 6)
    data = data_type([("b", b), ("a", a)])
    partition = partition_type([("b", ts.P("data")), ("a", ts.P())])  # dicts sort, OrderedDicts not
    g = ts.host_to_global_array(data, partition=partition)
    assert type(g) is type(data) and list(g) == ["b", "a"]
    _check_shards(g["a"], a, mesh8, ts.P())
    _check_shards(g["b"], b, mesh8, ts.P("data"))
    specs = ts.host_to_global_specs(data, partition=partition)
    assert specs["a"].sharding.spec == ts.P() and specs["b"].sharding.spec == ts.P("data")
    # and with a given global shape per key: the valid call was refused, naming the other leaf
    shapes = partition_type([("b", (8, 2)), ("a", (4, 6))])
    g = ts.host_to_global_array(data, partition=partition, global_shape=shapes)
    assert tuple(g["a"].shape) == (4, 6) and tuple(g["b"].shape) == (8, 2)
    _check_shards(g["a"], a, mesh8, ts.P())
    specs = ts.host_to_global_specs(data, partition=partition, global_shape=shapes)
    assert specs["a"].shape == (4, 6) and specs["b"].shape == (8, 2)
