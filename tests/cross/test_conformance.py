"""The conformance vectors (tests/cross/conformance, copied from ../shared/conformance): index
maps reported by torch_xla (and JAX for even shapes), and multi-host layouts cross-checked with
JAX. See tests/cross/conformance/README.md for the fields and how they were computed."""

import numpy as np
import pytest
from helpers import (
    CONFORMANCE,
    SHARED_CONFORMANCE,
    conformance_mesh,
    conformance_spec,
    index_map_ranges,
    load_conformance,
    take_segments,
    xla_shards,
)

import torchshard as ts
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)

INDEX_MAPS = load_conformance("index_maps")
HOST_LAYOUTS = load_conformance("host_layouts")


def _ids(cases):
    return [c["id"] for c in cases]


def _ranges(indices):
    return {int(d): tuple(tuple(r) for r in rs) for d, rs in indices.items()}


def test_formats():
    assert INDEX_MAPS["format"] == "torchshard-conformance/index_maps/v1"
    assert HOST_LAYOUTS["format"] == "torchshard-conformance/host_layouts/v1"
    assert INDEX_MAPS["num_devices"] == HOST_LAYOUTS["num_devices"] == 8
    assert len(INDEX_MAPS["cases"]) == 100 and len(HOST_LAYOUTS["cases"]) == 90


@pytest.mark.parametrize("name", ["README.md", "index_maps.json", "host_layouts.json"])
def test_copy_matches_shared_vectors(name):
    """The copy in tests/cross/conformance is the shared one (when ../shared/conformance exists)."""
    if not SHARED_CONFORMANCE.is_dir():
        pytest.skip(f"{SHARED_CONFORMANCE} is not present on this checkout")
    assert (CONFORMANCE / name).read_bytes() == (SHARED_CONFORMANCE / name).read_bytes()


@pytest.mark.parametrize("case", INDEX_MAPS["cases"], ids=_ids(INDEX_MAPS["cases"]))
def test_index_map(case):
    sharding = ts.NamedSharding(conformance_mesh(case), conformance_spec(case))
    shape = tuple(case["global_shape"])
    assert index_map_ranges(sharding.devices_indices_map(shape), shape) == _ranges(case["indices"])
    if case["even"]:
        counts = sharding.shard_counts(len(shape))
        assert sharding.shard_shape(shape) == tuple(
            n // k for n, k in zip(shape, counts, strict=True)
        )
    else:
        with pytest.raises(ts.errors.IndivisibleError):
            sharding.shard_shape(shape)


def _device_process(case):
    per = 8 // case["num_hosts"]
    return tuple(d // per for d in range(8))


@pytest.mark.parametrize("case", HOST_LAYOUTS["cases"], ids=_ids(HOST_LAYOUTS["cases"]))
def test_host_layout_maths(case):
    """Feeds, global shape from local, per-host local shapes: pure index maths."""
    mesh, spec = conformance_mesh(case), conformance_spec(case)
    sharding = ts.NamedSharding(mesh, spec)
    owners = _device_process(case)
    ndim = len(case["local_shape"])
    assert (
        list(sharding.global_shape_from_local(case["local_shape"], device_process=owners))
        == (case["global_shape"])
    )
    hosts = case["hosts"]
    for h in range(case["num_hosts"]):
        for dim in range(ndim):
            if not case["uniform"][dim]:
                with pytest.raises(ts.errors.NonUniformShardingError):
                    sharding.process_index_and_count(
                        dim, ndim=ndim, process_index=h, device_process=owners
                    )
                continue
            feed = hosts[h]["feed_index"][dim] if hosts else case["feed_index"][dim][h]
            assert sharding.process_index_and_count(
                dim, ndim=ndim, process_index=h, device_process=owners
            ) == (feed, case["feed_count"][dim])
    if hosts is not None:
        shape = tuple(case["global_shape"])
        assert index_map_ranges(sharding.devices_indices_map(shape), shape) == _ranges(
            case["indices"]
        )
        for h, host in enumerate(hosts):
            assert host["devices"] == [d for d in range(8) if owners[d] == h]
            assert (
                list(sharding.process_local_shape(shape, h, device_process=owners))
                == (host["local_shape"])
            )


VALID = [c for c in HOST_LAYOUTS["cases"] if c["valid_input"]]
INVALID = [c for c in HOST_LAYOUTS["cases"] if not c["valid_input"]]


@pytest.mark.xla
@pytest.mark.parametrize("case", VALID, ids=_ids(VALID))
def test_valid_layout_round_trips(case):
    """Each host gives the block its segments name; every device's shard is the recorded slice;
    each host reads its block back."""
    mesh, spec = conformance_mesh(case), conformance_spec(case)
    shape = tuple(case["global_shape"])
    G = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    blocks = [take_segments(G, host["segments"]) for host in case["hosts"]]
    assert all(list(b.shape) == case["local_shape"] for b in blocks)
    with virtual_hosts(case["num_hosts"]), mesh:
        g = host_to_global_array_per_host([{"x": b} for b in blocks], partition=spec)
        assert tuple(g["x"].shape) == shape
        want = _ranges(case["indices"])
        for d, (ranges, data) in xla_shards(g["x"]).items():
            assert ranges == want[d], d
            np.testing.assert_array_equal(data.numpy(), G[tuple(slice(a, b) for a, b in ranges)])
        back = global_to_host_array_per_host(g)
    for h, block in enumerate(blocks):
        np.testing.assert_array_equal(back[h]["x"].numpy(), block)


@pytest.mark.xla
@pytest.mark.parametrize("case", INVALID, ids=_ids(INVALID))
def test_invalid_layout_is_refused(case):
    mesh, spec = conformance_mesh(case), conformance_spec(case)
    error = {
        "non-uniform": ts.errors.NonUniformShardingError,
        "indivisible": ts.errors.IndivisibleError,
    }[case["reject_reason"]]
    local = np.zeros(case["local_shape"], np.float32)
    with virtual_hosts(case["num_hosts"]), mesh, pytest.raises(error):
        host_to_global_array_per_host([{"x": local}] * case["num_hosts"], partition=spec)
    with virtual_hosts(case["num_hosts"]), mesh, pytest.raises(error):
        ts.host_to_global_specs({"x": local}, partition=spec)


def test_every_case_is_exercised():
    assert len(VALID) + len(INVALID) == len(HOST_LAYOUTS["cases"])
    assert {c["reject_reason"] for c in INVALID} == {"non-uniform", "indivisible"}
    assert any(not c["grid"] for c in VALID)  # non-grid layouts round-trip too
