"""NamedSharding index maths (torchshard._core.sharding): pure numpy, checked by hand-worked
layouts.

The exhaustive comparisons with torch_xla's own shard indices are in
tests/cross/test_conformance.py and tests/place/test_host_to_global_properties.py.
"""

import re

import numpy as np
import pytest
from helpers import index_map_ranges

import torchshard as ts

TWO_HOSTS = (0,) * 4 + (1,) * 4  # devices 0-3 on host 0, 4-7 on host 1
FOUR_HOSTS = (0, 0, 1, 1, 2, 2, 3, 3)


def _mesh(ids, shape, names):
    return ts.Mesh(np.asarray(ids).reshape(shape), names)


MESH42 = _mesh(range(8), (4, 2), ("data", "model"))


def test_devices_indices_map_docstring_example():
    s = ts.NamedSharding(MESH42, ts.P("data"))
    m = s.devices_indices_map((8, 3))
    assert m[3] == (slice(2, 4, None), slice(0, 3, None))
    assert index_map_ranges(m, (8, 3)) == {
        d: ((2 * (d // 2), 2 * (d // 2) + 2), (0, 3)) for d in range(8)
    }
    assert list(m) == list(range(8))  # keyed by device id, ascending


def test_tuple_axes_split_major_to_minor():
    s = ts.NamedSharding(MESH42, ts.P(("model", "data")))
    # shard number = i_model * 4 + i_data; device d sits at (i_data, i_model) = (d // 2, d % 2)
    got = index_map_ranges(s.devices_indices_map((16,)), (16,))
    assert got == {
        d: ((2 * ((d % 2) * 4 + d // 2), 2 * ((d % 2) * 4 + d // 2) + 2),) for d in range(8)
    }


def test_permuted_mesh():
    mesh = _mesh([3, 1, 0, 2, 7, 5, 6, 4], (8,), ("x",))
    got = index_map_ranges(ts.NamedSharding(mesh, ts.P("x")).devices_indices_map((8,)), (8,))
    assert got == {
        3: ((0, 1),),
        1: ((1, 2),),
        0: ((2, 3),),
        2: ((3, 4),),
        7: ((4, 5),),
        5: ((5, 6),),
        6: ((6, 7),),
        4: ((7, 8),),
    }


def test_spec_shorter_than_rank_and_replicated():
    s = ts.NamedSharding(MESH42, ts.P(None, "model"))
    got = index_map_ranges(s.devices_indices_map((3, 4, 5)), (3, 4, 5))
    assert got == {d: ((0, 3), (2 * (d % 2), 2 * (d % 2) + 2), (0, 5)) for d in range(8)}
    rep = ts.NamedSharding(MESH42, ts.P())
    assert rep.is_fully_replicated
    assert index_map_ranges(rep.devices_indices_map(()), ()) == {d: () for d in range(8)}
    assert not s.is_fully_replicated
    assert ts.NamedSharding(_mesh(range(8), (8, 1), ("a", "b")), ts.P("b")).is_fully_replicated


def test_uneven_split_uses_ceil_chunks_like_torch_xla():
    s = ts.NamedSharding(MESH42, ts.P("data"))
    got = index_map_ranges(s.devices_indices_map((10,)), (10,))
    # chunk = ceil(10 / 4) = 3: rows 0:3, 3:6, 6:9, 9:10
    assert got == {
        0: ((0, 3),),
        1: ((0, 3),),
        2: ((3, 6),),
        3: ((3, 6),),
        4: ((6, 9),),
        5: ((6, 9),),
        6: ((9, 10),),
        7: ((9, 10),),
    }
    s8 = ts.NamedSharding(_mesh(range(8), (8,), ("x",)), ts.P("x"))
    got = index_map_ranges(s8.devices_indices_map((5,)), (5,))
    assert got == {
        0: ((0, 1),),
        1: ((1, 2),),
        2: ((2, 3),),
        3: ((3, 4),),
        4: ((4, 5),),
        5: ((5, 5),),
        6: ((5, 5),),
        7: ((5, 5),),
    }


def test_shard_counts_and_shape():
    s = ts.NamedSharding(MESH42, ts.P("model", "data"))
    assert s.shard_counts(3) == (2, 4, 1)
    assert s.shard_shape((4, 8, 3)) == (2, 2, 3)
    with pytest.raises(
        ts.errors.IndivisibleError,
        match=re.escape(
            "dim 1 has size 6, not divisible by 4 (axes ('data',) of P('model', 'data') on mesh "
            "{'data': 4, 'model': 2}); global shape (4, 6). Pad the batch to a multiple, or use "
            "torchshard.InputDispatcher to pad and drop the padding in the step."
        ),
    ):
        s.shard_shape((4, 6))


def test_spec_checks():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "partition spec P('nope',) names mesh axis 'nope', which is not an axis of the mesh; "
            "expected one of ('data', 'model')."
        ),
    ):
        ts.NamedSharding(MESH42, ts.P("nope"))
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "partition spec P('data', 'model') has 2 entries but the array has rank 1; a spec "
            "may not be longer than the rank of the array it shards."
        ),
    ):
        ts.NamedSharding(MESH42, ts.P("data", "model")).devices_indices_map((8,))
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "partition spec P(UNCONSTRAINED,): entry 0 is UNCONSTRAINED, which only maybe_shard "
            "accepts; placing data needs a concrete spec."
        ),
    ):
        ts.NamedSharding(MESH42, ts.P(ts.P.UNCONSTRAINED))


def test_equality_ignores_trailing_unsplit_dims():
    a = ts.NamedSharding(MESH42, ts.P("data"))
    assert a == ts.NamedSharding(MESH42, ts.P("data", None))
    assert a == ts.NamedSharding(MESH42, ["data"])
    assert hash(a) == hash(ts.NamedSharding(MESH42, ts.P("data", None)))
    assert a != ts.NamedSharding(MESH42, ts.P(None, "data"))
    assert a != ts.NamedSharding(_mesh(range(8), (4, 2), ("data", "x")), ts.P("data"))
    assert ts.NamedSharding(MESH42, ts.P(("data",))) == a  # one-axis tuple == the axis
    assert a.mesh is MESH42 and a.spec == ts.P("data")
    assert repr(a) == "NamedSharding(mesh=Mesh({'data': 4, 'model': 2}), spec=P('data',))"


@pytest.mark.xla
def test_process_local_shape():
    s = ts.NamedSharding(MESH42, ts.P("data"))
    assert s.process_local_shape((8, 3), 0, device_process=TWO_HOSTS) == (4, 3)
    assert s.process_local_shape((8, 3), 1, device_process=TWO_HOSTS) == (4, 3)
    assert s.process_local_shape((8, 3), 3, device_process=FOUR_HOSTS) == (2, 3)
    # Uneven: rows 0:3, 3:6 on host 0 and 6:9, 9:10 on host 1.
    assert s.process_local_shape((10, 3), 0, device_process=TWO_HOSTS) == (6, 3)
    assert s.process_local_shape((10, 3), 1, device_process=TWO_HOSTS) == (4, 3)
    shape = s.process_local_shape((8, 3), 1, device_process=TWO_HOSTS)
    assert all(type(n) is int for n in shape)
    # Replicated over hosts along "model": each host holds the whole dim.
    s2 = ts.NamedSharding(MESH42, ts.P(None, "model"))
    assert s2.process_local_shape((8, 6), 1, device_process=TWO_HOSTS) == (8, 6)
    # One process (the runtime default) holds everything; 0-d works too.
    assert s.process_local_shape((8, 3)) == (8, 3)
    assert ts.NamedSharding(MESH42, ts.P()).process_local_shape(()) == ()


def test_process_that_owns_no_device():
    s = ts.NamedSharding(MESH42, ts.P("data"))
    message = (
        "process_index 2 owns no device of Mesh({'data': 4, 'model': 2}); expected one of the "
        "processes [0, 1]."
    )
    with pytest.raises(ts.ShardingError, match=re.escape(message)):
        s.process_local_shape((8, 3), 2, device_process=TWO_HOSTS)
    with pytest.raises(ts.ShardingError, match=re.escape(message)):
        ts.NamedSharding(MESH42, ts.P()).process_local_shape((), 2, device_process=TWO_HOSTS)
    with pytest.raises(ts.ShardingError, match=re.escape(message)):
        s.process_index_and_count(0, process_index=2, device_process=TWO_HOSTS)


def test_device_process_must_match_the_mesh():
    s = ts.NamedSharding(MESH42, ts.P("data"))
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "mesh Mesh({'data': 4, 'model': 2}) covers devices [0, 1, 2, 3, 4, 5, 6, 7], but the "
            "runtime has 4 devices (ids 0..3); a mesh must cover every device exactly once."
        ),
    ):
        s.global_shape_from_local((4,), device_process=(0, 0, 1, 1))


@pytest.mark.xla
def test_global_shape_from_local():
    s = ts.NamedSharding(MESH42, ts.P("data", "model"))
    assert s.global_shape_from_local((4, 3), device_process=TWO_HOSTS) == (8, 3)
    assert s.global_shape_from_local((2, 3), device_process=FOUR_HOSTS) == (8, 3)
    assert s.global_shape_from_local((8, 3)) == (8, 3)  # one process
    # A permuted mesh where host 0 owns mesh column 0 and host 1 column 1: both hold every
    # "data" block (count 1 along dim 0) and one "model" block each (count 2 along dim 1).
    mesh = _mesh([0, 4, 1, 5, 2, 6, 3, 7], (4, 2), ("data", "model"))
    s = ts.NamedSharding(mesh, ts.P("data", "model"))
    assert s.global_shape_from_local((8, 3), device_process=TWO_HOSTS) == (8, 6)


def test_global_shape_from_local_non_uniform_is_none():
    # 4 hosts (devices 0-1, 2-3, 4-5, 6-7) on a (2, 4) mesh whose "a" rows are devices
    # 0 1 2 4 / 3 5 6 7: along dim 0 the hosts hold the shard sets {0}, {0, 1}, {0, 1}, {1}.
    mesh = _mesh([0, 1, 2, 4, 3, 5, 6, 7], (2, 4), ("a", "b"))
    s = ts.NamedSharding(mesh, ts.P("a"))
    assert s.global_shape_from_local((4, 2), device_process=FOUR_HOSTS) == (None, 2)
    with pytest.raises(
        ts.errors.NonUniformShardingError,
        match=re.escape(
            "NamedSharding(mesh=Mesh({'a': 2, 'b': 4}, devices=[0, 1, 2, 4, 3, 5, 6, 7]), "
            "spec=P('a',)) is not process-uniform along dim 0: the processes hold the shard sets "
            "{0: (0,), 1: (0, 1), 2: (0, 1), 3: (1,)}, which do not split the shards into equal, "
            "disjoint groups."
        ),
    ):
        s.process_index_and_count(0, process_index=0, device_process=FOUR_HOSTS)


@pytest.mark.xla
def test_process_index_and_count():
    s = ts.NamedSharding(MESH42, ts.P("data"))
    assert s.process_index_and_count(0, process_index=0, device_process=TWO_HOSTS) == (0, 2)
    assert s.process_index_and_count(0, process_index=1, device_process=TWO_HOSTS) == (1, 2)
    assert s.process_index_and_count(1, process_index=1, device_process=TWO_HOSTS) == (0, 1)
    assert s.process_index_and_count(0) == (0, 1)  # one process
    # Feeds are numbered by the position of their first slice, not by process index.
    mesh = _mesh([4, 5, 6, 7, 0, 1, 2, 3], (8,), ("x",))
    s = ts.NamedSharding(mesh, ts.P("x"))
    assert s.process_index_and_count(0, process_index=1, device_process=TWO_HOSTS) == (0, 2)
    assert s.process_index_and_count(0, process_index=0, device_process=TWO_HOSTS) == (1, 2)
    # Hosts sharing a block share a feed: 4 hosts, rows split over "data" (4) of a (4, 2) mesh
    # whose rows are hosts 0, 0 / 1, 1 / ...: each host holds one row block.
    s = ts.NamedSharding(MESH42, ts.P("model"))
    assert [
        s.process_index_and_count(0, process_index=h, device_process=FOUR_HOSTS) for h in range(4)
    ] == [(0, 1)] * 4
    with pytest.raises(ValueError, match=re.escape("dim must be in [0, 2), but got 2.")):
        s.process_index_and_count(2, ndim=2)


def test_results_are_cached_values_not_shared_state():
    s = ts.NamedSharding(MESH42, ts.P("data"))
    a = s.devices_indices_map((8,))
    a[0] = None
    assert s.devices_indices_map((8,))[0] == (slice(0, 2, None),)
