"""axlearn's host <-> global tests (host_array_test.py, utils_test.py), ported to torchshard.

axlearn runs them on real multi-process TPU slices; here the processes are emulated with
``virtual_hosts`` (device d belongs to host d // (8 // H)), and every expectation is computed
from numpy or from torch_xla's own placement, never from torchshard's index maths.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
import torch_xla.distributed.spmd as xs
from helpers import host_segments, num_partitions, take_segments, torch_xla_placement, xla_shards

import torchshard as ts
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)

MESH_SHAPES = [(-1, 1), (2, -1), (-1, 2), (1, -1)]  # (8, 1), (2, 4), (4, 2), (1, 8)
PROCESS_SHAPES = [[1], [8], [16], [1, 1], [2, 1], [16, 1], [2, 4], [8, 8]]
PARTITIONS = [
    ts.DataPartitionType.FULL,
    ts.DataPartitionType.REPLICATED,
    ts.P("data"),
    ts.P("data", "model"),
]


def _check_shards(g, expected, mesh, spec):
    """Every device holds the numpy slice of ``expected`` that torchshard's index map names,
    and torch_xla reports those same indices."""
    shards = xla_shards(g)
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(expected.shape)
    assert sorted(shards) == list(range(8))
    for d, (ranges, data) in shards.items():
        want = index_map[d]
        assert ranges == tuple((s.start, s.stop) for s in want), d
        np.testing.assert_array_equal(data.numpy(), expected[want])


@pytest.mark.parametrize("partition", PARTITIONS, ids=str)
@pytest.mark.parametrize("process_shape", PROCESS_SHAPES, ids=str)
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_fixed_process_shape(mesh_shape, process_shape, partition):
    """Round trip host -> global -> host with a fixed per-process shape (one process)."""
    mesh = ts.create_device_mesh(mesh_shape, ("data", "model"))
    with mesh:
        spec = ts.data_partition_type_to_spec(partition)
        if len(process_shape) < len(spec):
            pytest.skip(f"{spec!r} is longer than the rank of process shape {process_shape}")
        global_shape = list(process_shape)  # one process: its block is the whole array
        parts = num_partitions(global_shape, mesh, spec)
        if any(n % k for n, k in zip(global_shape, parts, strict=True)):
            pytest.skip(f"global shape {global_shape} does not divide into {parts} shards")
        x = np.random.default_rng(len(process_shape)).random(process_shape, dtype=np.float32)
        g = ts.host_to_global_array({"x": x}, partition=spec)
        assert tuple(g["x"].shape) == tuple(global_shape)
        _check_shards(g["x"], x, mesh, spec)
        g["y"] = 2 * g["x"]  # a step output: read back whatever sharding XLA gave it
        back = ts.global_to_host_array(g)
    assert tuple(back["x"].shape) == tuple(process_shape)
    np.testing.assert_array_equal(back["y"].numpy(), 2 * back["x"].numpy())
    np.testing.assert_array_equal(back["x"].numpy(), x)


@pytest.mark.parametrize("hosts", [1, 2, 4, 8])
def test_one_per_device(hosts):
    """axlearn test_one_per_device: each host produces its rows of a [devices, 1] batch."""
    per = 8 // hosts
    with virtual_hosts(hosts), ts.Mesh(np.arange(8).reshape(4, 2), ("x", "y")):
        local = [np.arange(h * per, (h + 1) * per)[:, None] for h in range(hosts)]
        g = host_to_global_array_per_host(local)  # default partition: FULL
        assert tuple(g.shape) == (8, 1)
        assert float(torch.mean(g.float()).cpu()) == 3.5
        np.testing.assert_array_equal(ts.replicate_to_local_data(g).numpy(), np.arange(8)[:, None])
        _check_shards(g, np.arange(8)[:, None], ts.current_mesh(), ts.P(("x", "y")))


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_one_per_process(hosts):
    """axlearn test_one_per_process: dim 0 split over "x" only; each host has a slice."""
    global_array = np.random.default_rng(123).random((4, 2), dtype=np.float32)
    rows = 4 // hosts
    with virtual_hosts(hosts), ts.Mesh(np.arange(8).reshape(4, 2), ("x", "y")):
        local = [global_array[h * rows : (h + 1) * rows] for h in range(hosts)]
        batch = host_to_global_array_per_host(local, partition=ts.P("x"))
        _check_shards(batch, global_array, ts.current_mesh(), ts.P("x"))
        np.testing.assert_array_equal(ts.replicate_to_local_data(batch).numpy(), global_array)
        back = global_to_host_array_per_host(batch)
    for h in range(hosts):
        np.testing.assert_array_equal(back[h].numpy(), local[h])


@pytest.mark.parametrize("hosts", [1, 2])
def test_one_per_process_two_arrays(hosts):
    """axlearn test_one_per_process_two_arrays: two leaves with different specs.

    Each host's block of each leaf is read off torch_xla's own placement of the global value.
    """
    rng = np.random.default_rng(123)
    expected = {"a": rng.random((4, 2)), "b": {"nested_value": rng.random((4, 2))}}
    partition = {"a": ts.P("x"), "b": ts.P("y")}
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("x", "y"))
    owner = [d // (8 // hosts) for d in range(8)]
    blocks = {}
    for key, value, spec in (
        ("a", expected["a"], partition["a"]),
        ("b", expected["b"]["nested_value"], partition["b"]),
    ):
        placed = {d: r for d, (r, _) in torch_xla_placement(value, mesh, spec).items()}
        segs = host_segments(placed, owner, 2)
        blocks[key] = [take_segments(value, segs[h]) for h in range(hosts)]
    local = [{"a": blocks["a"][h], "b": {"nested_value": blocks["b"][h]}} for h in range(hosts)]
    with virtual_hosts(hosts), mesh:
        batch = host_to_global_array_per_host(local, partition=partition)
        _check_shards(batch["a"], expected["a"], mesh, partition["a"])
        _check_shards(batch["b"]["nested_value"], expected["b"]["nested_value"], mesh, ts.P("y"))
        full = ts.replicate_to_local_data(batch)
        back = global_to_host_array_per_host(batch)
    np.testing.assert_array_equal(full["a"].numpy(), expected["a"])
    np.testing.assert_array_equal(full["b"]["nested_value"].numpy(), expected["b"]["nested_value"])
    for h in range(hosts):
        np.testing.assert_array_equal(back[h]["a"].numpy(), local[h]["a"])
        np.testing.assert_array_equal(
            back[h]["b"]["nested_value"].numpy(), local[h]["b"]["nested_value"]
        )


@pytest.mark.parametrize("divisor", [1, 2, 4])
def test_every_other_process(divisor):
    """axlearn test_every_other_process: 4 hosts; dim 0 is smaller than the number of hosts,
    so hosts that share a feed pass the same data; the feed index says which."""
    hosts = 4
    global_shape = (hosts // divisor, 1)
    mesh = ts.Mesh(np.arange(8).reshape(global_shape[0], -1), ("x", "y"))
    sharding = ts.NamedSharding(mesh, ts.P("x"))
    owner = tuple(d // 2 for d in range(8))
    feeds = [
        sharding.process_index_and_count(0, ndim=2, process_index=h, device_process=owner)
        for h in range(hosts)
    ]
    count = feeds[0][1]
    assert global_shape[0] % count == 0
    local_shape = (global_shape[0] // count, 1)
    local_data = [np.random.default_rng(i).random(local_shape) for i in range(count)]
    with virtual_hosts(hosts), mesh:
        global_x = host_to_global_array_per_host(
            [local_data[idx] for idx, _ in feeds], partition=ts.P("x")
        )
        global_idx = host_to_global_array_per_host(
            [np.array([idx]) for idx, _ in feeds], partition=ts.P("x")
        )
        assert tuple(global_x.shape) == global_shape
        x = ts.replicate_to_local_data(global_x).numpy()
        idx = ts.replicate_to_local_data(global_idx).numpy()
    # Feeds are numbered by the position of their first slice: here, in order.
    np.testing.assert_array_equal(idx, np.arange(count))
    np.testing.assert_array_equal(x[idx], np.concatenate(local_data, axis=0))


def _ordered_devices(mesh_shape, process_shape, hosts):
    """axlearn's _ordered_devices: a mesh whose quadrants (per ``process_shape``) belong to
    hosts 0, 1 / 2, 3 / ... (host index r * 2 + c), with virtual hosts' device groups."""
    per_host = [list(range(h * 8 // hosts, (h + 1) * 8 // hosts)) for h in range(hosts)]
    block = tuple(m // p for m, p in zip(mesh_shape, process_shape, strict=True))
    devices = np.zeros(mesh_shape, np.int64)
    for i, j in np.ndindex(*mesh_shape):
        devices[i, j] = per_host[(i // block[0]) * 2 + j // block[1]].pop()
    return devices


@pytest.mark.parametrize("process_shape", [(2, 1), (4, 4), (1, 8)], ids=str)
@pytest.mark.parametrize("mesh_shape", [(4, 2), (2, 4)], ids=str)
def test_host_to_global_multiple_dims(mesh_shape, process_shape):
    """axlearn test_host_to_global_multiple_dims: 4 hosts tile a 2-D array as a 2 x 2 grid of
    blocks, P("x", "y"); host i gives block (i // 2, i % 2)."""
    hosts = 4
    rng = np.random.default_rng(0)
    tiles = [[rng.random(process_shape) for _ in range(2)] for _ in range(hosts // 2)]
    global_array = np.concatenate([np.concatenate(row, axis=1) for row in tiles], axis=0)
    mesh = ts.Mesh(_ordered_devices(mesh_shape, (hosts // 2, 2), hosts), ("x", "y"))
    parts = num_partitions(global_array.shape, mesh, ("x", "y"))
    if any(n % k for n, k in zip(global_array.shape, parts, strict=True)):
        pytest.skip(f"global shape {global_array.shape} does not divide into {parts} shards")
    with virtual_hosts(hosts), mesh:
        batch = host_to_global_array_per_host(
            [tiles[h // 2][h % 2] for h in range(hosts)], partition=ts.P("x", "y")
        )
        assert tuple(batch.shape) == global_array.shape
        _check_shards(batch, global_array, mesh, ts.P("x", "y"))
        np.testing.assert_array_equal(ts.replicate_to_local_data(batch).numpy(), global_array)


@pytest.mark.parametrize(
    "process_shapes",
    [{"x": (2, 1)}, {"x": (4, 4)}, {"x": (1, 8)}, {"x": (8, 4), "y": (4, 8)}],
    ids=str,
)
@pytest.mark.parametrize("mesh_shape", [(4, 2), (2, 4)], ids=str)
def test_global_to_host_multiple_dims(mesh_shape, process_shapes):
    """axlearn test_global_to_host_multiple_dims: torch_xla places the global arrays (its own
    mark_sharding, in place of axlearn's jit), each host reads its 2-D tile back, and the
    tiles assemble back into the same global arrays."""
    hosts = 4
    rng = np.random.default_rng(1)
    tiles = {
        k: [[rng.random(shape) for _ in range(2)] for _ in range(hosts // 2)]
        for k, shape in process_shapes.items()
    }
    global_arrays = {
        k: np.concatenate([np.concatenate(row, axis=1) for row in rows], axis=0)
        for k, rows in tiles.items()
    }
    mesh = ts.Mesh(_ordered_devices(mesh_shape, (hosts // 2, 2), hosts), ("x", "y"))
    for value in global_arrays.values():
        parts = num_partitions(value.shape, mesh, ("x", "y"))
        if any(n % k for n, k in zip(value.shape, parts, strict=True)):
            pytest.skip(f"global shape {value.shape} does not divide into {parts} shards")
    with virtual_hosts(hosts), mesh:
        placed = {}
        for k, value in global_arrays.items():
            t = torch.as_tensor(value).to(torch_xla.device())
            xs.mark_sharding(t, mesh.xla_mesh, ("x", "y"))
            placed[k] = t
        local = global_to_host_array_per_host(placed)
        for h in range(hosts):
            for k, shape in process_shapes.items():
                assert tuple(local[h][k].shape) == shape
                np.testing.assert_array_equal(local[h][k].numpy(), tiles[k][h // 2][h % 2])
        restored = host_to_global_array_per_host(local, partition=ts.P("x", "y"))
        full = ts.replicate_to_local_data(restored)
    for k, value in global_arrays.items():
        np.testing.assert_array_equal(full[k].numpy(), value)


def test_host_to_global_specs_num_feeds():
    """axlearn HostToGlobalSpecsTest (AOT-only there): the global batch is the host batch times
    the number of feeds; 4 hosts on a (4, 2) mesh."""
    specs = {"x": ts.TensorSpec((4, 8), torch.int32), "y": ts.TensorSpec((2, 8), torch.int32)}
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    with virtual_hosts(4), mesh:
        for spec, feeds in ((ts.P(("data", "model")), 4), (ts.P("data"), 4), (ts.P("model"), 1)):
            out = ts.host_to_global_specs(specs, partition=spec)
            for k, s in specs.items():
                assert out[k] == ts.TensorSpec(
                    (s.shape[0] * feeds, *s.shape[1:]), s.dtype, ts.NamedSharding(mesh, spec)
                )
