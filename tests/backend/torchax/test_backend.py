"""The torchax backend on one JAX process of 8 CPU devices (torchshard._backend.torchax.backend),
with JAX itself as the oracle: ``jax.device_put`` of the same array to the same
``NamedSharding`` (shard for shard: index and bits), ``devices_indices_map``, the conformance
vectors' recorded index maps. The multi-process runs are in test_backend_multiprocess.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import conformance_spec, load_conformance
from torchax_env import jax8, needs_torchax

import torchshard as ts

pytestmark = needs_torchax

INDEX_MAPS = load_conformance("index_maps")["cases"]


@pytest.fixture(scope="module")
def jax():
    return jax8()


def _ids(jax):
    order = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return {d: i for i, d in enumerate(order)}


def _shards(jax, array):
    ids = _ids(jax)
    return {
        ids[s.device]: (
            [list(sl.indices(n)[:2]) for sl, n in zip(s.index, array.shape, strict=True)],
            np.asarray(s.data),
        )
        for s in array.addressable_shards
    }


def _same_as_device_put(jax, mesh, spec_entries, value, got):
    sharding = jax.sharding.NamedSharding(mesh.jax_mesh, jax.sharding.PartitionSpec(*spec_entries))
    oracle = jax.device_put(value, sharding)
    a, b = _shards(jax, got), _shards(jax, oracle)
    assert a.keys() == b.keys()
    for d in a:
        assert a[d][0] == b[d][0], d
        assert a[d][1].dtype == b[d][1].dtype and a[d][1].tobytes() == b[d][1].tobytes(), d
    return a


@pytest.mark.parametrize("case", INDEX_MAPS, ids=[c["id"] for c in INDEX_MAPS])
def test_conformance_index_maps(jax, case):
    """Even cases: every shard is the recorded range, JAX's own placement's, and G's slice.
    Uneven cases (JAX refuses them): IndivisibleError before any transfer."""
    mesh = ts.Mesh(
        np.asarray(case["device_ids"]).reshape(case["mesh_shape"]),
        tuple(case["axis_names"]),
        backend="torchax",
    )
    shape = tuple(case["global_shape"])
    G = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    spec = conformance_spec(case)
    if not case["even"]:
        with mesh, pytest.raises(ts.errors.IndivisibleError, match=r"host_arrays\['x'\]"):
            ts.host_to_global_array({"x": G}, partition=spec)
        return
    with mesh:
        g = ts.host_to_global_array({"x": G}, partition=spec)["x"]
        back = ts.global_to_host_array(g).numpy()
    entries = [tuple(e) if isinstance(e, list) else e for e in case["spec"]]
    shards = _same_as_device_put(jax, mesh, entries, G, g.jax())
    recorded = {int(d): [list(r) for r in rs] for d, rs in case["indices"].items()}
    for d, (ranges, data) in shards.items():
        assert ranges == recorded[d], d
        np.testing.assert_array_equal(data, G[tuple(slice(a, b) for a, b in ranges)])
    np.testing.assert_array_equal(back, G)


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.int8, torch.int32, torch.float16, torch.bfloat16]
)
def test_dtypes_move_bit_for_bit(jax, dtype):
    mesh = ts.create_device_mesh((4, 2), ("data", "model"), backend="torchax")
    x = (torch.arange(16 * 6).reshape(16, 6) % 120 - 7).to(dtype)
    with mesh:
        g = ts.host_to_global_array({"x": x}, partition=ts.P("data", "model"))["x"]
        back = ts.global_to_host_array(g)
        whole = ts.replicate_to_local_data(g)
    assert type(g).__name__ == "Tensor" and g.dtype == dtype and tuple(g.shape) == (16, 6)
    assert back.dtype == whole.dtype == dtype
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(whole.view(torch.uint8), x.view(torch.uint8))


def test_int64_fits_int32_or_is_refused_float64_refused(jax):
    mesh = ts.create_device_mesh((8,), ("data",), backend="torchax")
    with mesh:
        ok = ts.host_to_global_array({"ids": torch.arange(8)})["ids"]
        assert ok.dtype == torch.int32
        assert ts.replicate_to_local_data(ok).tolist() == list(range(8))
        with pytest.raises(ts.errors.ShardingError, match=r"host_arrays\['ids'\].*jax_enable_x64"):
            ts.host_to_global_array({"ids": torch.arange(8) + 2**40})
        with pytest.raises(TypeError, match=r"host_arrays\['f'\]: a float64 leaf.*jax_enable_x64"):
            ts.host_to_global_array({"f": np.zeros((8, 2))})


def test_host_to_global_specs_and_describe_layout_agree_with_jax(jax):
    mesh = ts.create_device_mesh((4, 2), ("data", "model"), backend="torchax")
    with mesh:
        specs = ts.host_to_global_specs({"x": np.zeros((8, 6), np.float32)})
        g = ts.host_to_global_array({"x": np.zeros((8, 6), np.float32)})
    assert tuple(specs["x"].shape) == tuple(g["x"].shape) == (8, 6)
    layout = ts.describe_layout(mesh, ts.P("data"), (8, 6))
    jax_map = jax.sharding.NamedSharding(
        mesh.jax_mesh, jax.sharding.PartitionSpec("data")
    ).devices_indices_map((8, 6))
    ids = _ids(jax)
    want = {
        ids[d]: tuple(s.indices(n)[:2] for s, n in zip(i, (8, 6), strict=True))
        for d, i in jax_map.items()
    }
    got = {b.device: tuple(tuple(r) for r in b.ranges) for b in layout.blocks}
    assert got == want
    assert {b.host for b in layout.blocks} == {0}


def test_with_sharding_constraint_eager_and_in_a_jitted_step(jax):
    import torchax

    mesh = ts.create_device_mesh((4, 2), ("data", "model"), backend="torchax")
    env = torchax.default_env()
    with mesh:
        x = ts.host_to_global_array(np.arange(8 * 4, dtype=np.float32).reshape(8, 4))
        y = ts.with_sharding_constraint(x, ts.P(None, "model"))
        assert y.jax().sharding.spec == jax.sharding.PartitionSpec(None, "model")
        assert ts.with_sharding_constraint(y, ts.P(None, "model")) is y  # already so: no copy

        def step(t):
            return ts.with_sharding_constraint(t * 2, ts.P("model"))

        interop = torchax.interop
        with env:
            z = jax.jit(lambda a: interop.jax_view(step(interop.torch_view(a))))(x.jax())
        assert z.sharding.spec == jax.sharding.PartitionSpec("model")
        np.testing.assert_array_equal(np.asarray(z), 2 * np.arange(32).reshape(8, 4))
        with pytest.raises(ts.errors.ShardingError, match="divide evenly"):
            ts.with_sharding_constraint(
                ts.host_to_global_array(np.zeros((4, 3), np.float32), partition=ts.P("data")),
                ts.P(None, ("data", "model")),
            )


def test_the_mesh_is_jaxs_current_mesh_inside_and_restored(jax):
    mesh = ts.create_device_mesh((4, 2), ("data", "model"), backend="torchax")
    before = jax.sharding.get_mesh()
    with mesh:
        assert jax.sharding.get_mesh() == mesh.jax_mesh
        inner = ts.create_device_mesh((8,), ("d",), backend="torchax")
        with inner:
            assert jax.sharding.get_mesh() == inner.jax_mesh
        assert jax.sharding.get_mesh() == mesh.jax_mesh
    assert jax.sharding.get_mesh() == before


def test_dispatch_moves_rows_bit_for_bit(jax):
    mesh = ts.create_device_mesh((4, 2), ("data", "model"), backend="torchax")
    with mesh:
        d = ts.InputDispatcher(global_logical_batch_size=6)  # padded to 8 physical rows
        rows = torch.tensor([[1.0, -0.0], [float("nan"), 3.5]] * 3, dtype=torch.float32)
        phys = d.logical_to_physical_batch({"x": rows})
        g = ts.host_to_global_array(phys, partition=d.partition_spec)
        out = d.physical_to_logical_batch(g)["x"]
        whole = ts.replicate_to_local_data(out)
    assert tuple(out.shape) == (6, 2) and type(out).__name__ == "Tensor"
    assert torch.equal(whole.view(torch.int32), rows.view(torch.int32))  # nan and -0.0 kept


def test_the_loader_prefetches_under_thread_guard(jax):
    from torch.utils.data import DataLoader

    mesh = ts.create_device_mesh((8,), ("data",), backend="torchax")
    data = [{"x": np.full(3, i, np.float32)} for i in range(20)]
    with mesh, jax.thread_guard(True):
        loader = ts.GlobalBatchLoader(DataLoader(data, batch_size=8), prefetch=2, last_batch="pad")
        got = [
            (
                ts.replicate_to_local_data(b["x"])[:, 0].tolist(),
                ts.replicate_to_local_data(m).tolist(),
            )
            for b, m in loader
        ]
    assert [g for g, _ in got] == [
        [float(i) for i in range(8)],
        [float(i) for i in range(8, 16)],
        [16.0, 17.0, 18.0, 19.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert got[-1][1] == [True] * 4 + [False] * 4


def test_a_torchax_model_consumes_the_batch_and_keeps_its_sharding(jax):
    import torchax

    mesh = ts.create_device_mesh((8,), ("data",), backend="torchax")
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    w, b = linear.weight.detach().numpy().copy(), linear.bias.detach().numpy().copy()
    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 7
    with mesh:
        g = ts.host_to_global_array(x, partition=ts.P("data"))
        with torchax.default_env():
            linear.to("jax")
            y = torchax.compile(linear)(g)
    assert y.jax().sharding.spec == jax.sharding.PartitionSpec("data")
    np.testing.assert_allclose(np.asarray(y.jax()), x @ w.T + b, atol=1e-5)


def test_logical_rows_the_mesh_does_not_divide_come_back_replicated(jax):
    """6 logical rows over 8 devices: JAX cannot lay them out eagerly, so dispatch asks for
    P() (splits_unevenly is False) and the rows move as bits."""
    mesh = ts.create_device_mesh((8,), ("data",), backend="torchax")
    with mesh:
        d = ts.InputDispatcher(global_logical_batch_size=6)
        rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
        g = ts.host_to_global_array(
            d.logical_to_physical_batch({"x": rows}), partition=d.partition_spec
        )
        out = d.physical_to_logical_batch(g)["x"]
    assert out.jax().sharding.is_fully_replicated
    assert torch.equal(ts.replicate_to_local_data(out), rows)
