"""The DTensor backend on real processes: 2 and 4 gloo workers on 127.0.0.1, started here.

The workers are fresh interpreters (``_multiproc.py``) running the cases of
``_dtensor_cases.py``; this process asserts on what every rank returns, against an oracle
written from scratch (``_dtensor_cases.block_slices``), against torchshard's own index maths
(``NamedSharding.devices_indices_map``) and against the torch_xla backend under
``virtual_hosts`` fed the same per-host blocks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import _dtensor_cases as cases
import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard.testing import host_to_global_array_per_host, virtual_hosts

G22 = [[0, 1], [2, 3]]
DM = ("data", "model")

# (world, grid of ranks, axis names, spec entries (None: default FULL partition), shape, dtype)
ACCEPTANCE = [
    (2, [0, 1], ("data",), ["data"], (8, 3), "float32"),
    (2, [0, 1], ("data",), None, (8, 3), "float32"),
    (2, [0, 1], ("data",), [], (4, 3), "float32"),
    (2, [0, 1], ("data",), [None, "data"], (4, 8), "float32"),
    (2, [0, 1], ("data",), [], (), "float32"),
    (4, [0, 1, 2, 3], ("data",), ["data"], (8, 3), "float32"),
    (4, [0, 1, 2, 3], ("data",), None, (8, 3), "int64"),
    (4, G22, DM, ["data"], (4, 3), "float32"),
    (4, G22, DM, ["data", "model"], (4, 8), "float32"),
    (4, G22, DM, [("data", "model")], (8, 3), "float32"),
    (4, G22, DM, None, (8, 3), "float32"),
    (4, G22, DM, [None, ("data", "model")], (2, 8), "float32"),
    (4, G22, DM, ["model"], (4, 3), "float32"),
    (4, G22, DM, ["model", "data"], (4, 8), "float32"),
    (4, G22, DM, [], (3, 2), "float32"),
    (4, G22, DM, [], (), "int32"),
    (4, [[0, 2], [1, 3]], DM, ["data", "model"], (4, 8), "float32"),
    (4, [[0, 2], [1, 3]], DM, [("data", "model")], (8, 3), "float32"),
    (4, [[0, 2], [1, 3]], DM, None, (8, 3), "float32"),
]
ACCEPTANCE += [(2, [0, 1], ("data",), ["data"], (8, 3), dt) for dt in cases.DTYPES]
ACCEPTANCE += [(4, G22, DM, ["data", "model"], (4, 8), dt) for dt in ("bfloat16", "bool", "int16")]


def _case_id(case: tuple) -> str:
    world, grid, _names, spec, shape, dtype = case
    spec_s = "FULL" if spec is None else "P(" + ",".join(map(str, spec)) + ")"
    return f"{world}p-{np.asarray(grid).tolist()}-{spec_s}-{list(shape)}-{dtype}".replace(" ", "")


_ROUNDTRIPS: dict[str, list] = {}


def _roundtrip(pools, case: tuple) -> list:
    key = _case_id(case)
    if key not in _ROUNDTRIPS:
        world, grid, names, spec, shape, dtype = case
        _ROUNDTRIPS[key] = pools(world).run(
            "roundtrip", grid=grid, axis_names=names, spec=spec, shape=shape, dtype=dtype
        )
    return _ROUNDTRIPS[key]


def _spec(names: tuple[str, ...], spec: list | None) -> ts.PartitionSpec:
    return ts.P(names) if spec is None else ts.P(*spec)


def _expected_placements(names: tuple[str, ...], spec: list | None) -> list[str]:
    entries = [names] if spec is None else spec
    dim_of = {a: d for d, e in enumerate(entries) for a in cases.entry_axes(e)}
    return [f"S({dim_of[a]})" if a in dim_of else "R" for a in names]


@pytest.mark.parametrize("case", ACCEPTANCE, ids=_case_id)
def test_every_rank_sees_the_global_shape_and_its_shard(pools, case):
    world, grid, names, spec, shape, dtype = case
    results = _roundtrip(pools, case)
    g = cases.global_value(shape, dtype)
    arr = np.asarray(grid)
    index_map = ts.NamedSharding(ts.Mesh(arr, names), _spec(names, spec)).devices_indices_map(shape)
    assert len(results) == world
    for rank, r in enumerate(results):
        slices = cases.block_slices(arr, names, spec, shape, rank)
        assert r["is_dtensor"]
        assert r["shape"] == shape
        assert r["spec_shape"] == shape
        assert r["stride"] == torch.empty(shape).stride()
        assert r["dtype"] == str(cases.DTYPES[dtype])
        assert r["placements"] == _expected_placements(names, spec)
        assert r["shard_device"] == rank
        assert r["shard_ranges"] == tuple((s.start, s.stop) for s in slices)
        assert r["shard_ranges"] == tuple((s.start, s.stop) for s in index_map[rank])
        assert torch.equal(r["local"], g[slices])


@pytest.mark.parametrize("case", ACCEPTANCE, ids=_case_id)
def test_round_trip_is_bit_exact(pools, case):
    _, _, _, _, shape, dtype = case
    g = cases.global_value(shape, dtype)
    for r in _roundtrip(pools, case):
        assert torch.equal(r["back"], r["block"])
        assert torch.equal(r["back_y"], r["block"])
        assert r["back"].dtype == r["block"].dtype
        assert torch.equal(r["full"], g)
        assert torch.equal(r["full_y"], g)


@pytest.mark.xla
@pytest.mark.parametrize("case", ACCEPTANCE, ids=_case_id)
def test_same_global_values_as_xla_virtual_hosts(pools, case):
    """The XLA backend, with ``world`` virtual hosts each owning ``8 / world`` devices laid out
    along the last mesh axis (so each host holds the block its rank holds), gives the same
    global value for the same per-host blocks."""
    world, grid, names, spec, shape, dtype = case
    arr = np.asarray(grid)
    k = 8 // world
    xla_grid = (arr[..., None] * k + np.arange(k)).reshape((*arr.shape[:-1], -1))
    g = cases.global_value(shape, dtype)
    per_host = [{"x": b} for b in cases.host_blocks(arr, names, spec, g)]
    partition = {} if spec is None else {"partition": ts.P(*spec)}
    with virtual_hosts(world), ts.Mesh(xla_grid, names):
        gx = host_to_global_array_per_host(per_host, **partition)
        xla_full = ts.replicate_to_local_data(gx)["x"]
    for r in _roundtrip(pools, case):
        assert tuple(gx["x"].shape) == r["shape"]
        assert torch.equal(xla_full, r["full"])


@pytest.mark.parametrize("world", [2, 4])
def test_workers_are_pure_torch_and_see_their_rank(pools, world):
    for rank, r in enumerate(pools(world).run("environment")):
        assert r == {
            "rank": rank,
            "world": world,
            "process_index": rank,
            "process_count": world,
            "torch_xla_loaded": False,
            "native": "DeviceMesh",
            "device_ids": tuple(range(world)),
        }


_SHAPE_MSG = (
    "ProcessDisagreementError: host_arrays['y']: every process must pass the same shape and "
    "dtype for a leaf (the global shape is inferred from them); expected {exp} (as on process "
    "0), got {got} on process(es) [1]. Make every process's input yield the same shapes and "
    "dtypes (pad or drop a short last batch, or use torchshard.InputDispatcher)."
)
_STRUCT_MSG = (
    "ProcessDisagreementError: host_to_global_array: every process must pass the same tree "
    "structure and partition; expected structure PyTreeSpec({{'x': *, 'y': *}}), partition "
    "{exp} (as on process 0), got structure PyTreeSpec({got}), partition {part} on process(es) [1]."
)


def test_a_rank_whose_block_is_the_whole_value_still_gathers_with_the_others(pools):
    """replicate_to_local_data of one row over 4 ranks: rank 0 holds it all, yet it takes the
    others' path (a gather), or they would wait for it until the timeout."""
    results = pools(4).run("uneven_readback")
    assert [r["held"] for r in results] == [1, 0, 0, 0]
    for r in results:
        assert torch.equal(r["full"], r["expected"])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("shape", _SHAPE_MSG.format(exp="(4,) int64", got="(3,) int64")),
        ("dtype", _SHAPE_MSG.format(exp="(4,) int64", got="(4,) int32")),
        (
            "structure",
            _STRUCT_MSG.format(exp="P('data',)", got="{'x': *, 'y': *, 'z': *}", part="P('data',)"),
        ),
        (
            "partition",
            _STRUCT_MSG.format(exp="P('data',)", got="{'x': *, 'y': *}", part="P(None, 'data')"),
        ),
    ],
)
def test_ranks_that_disagree_all_get_the_same_clear_error(pools, world, kind, message):
    results = pools(world).run("disagreement", kind=kind)
    for r in results:
        assert r["error"] == message
        # No rank was left behind in a collective: the next call works on every rank.
        assert r["after_shape"] == (4 * world, 3)
        assert torch.equal(r["after_full"], torch.zeros(4 * world, 3))


def test_agreement_check_can_be_turned_off(pools):
    for r in pools(2).run("disagreement_unchecked"):
        assert r == {"old": True, "shape": (4, 2)}


def test_bad_layouts_raise_the_same_error_on_every_rank(pools):
    results = pools(4).run("bad_layouts")
    expected = {
        "reversed_tuple": (
            "ShardingError: host_arrays['x']: dim 0 is split over the mesh axes ('model', "
            "'data') (major to minor), but DTensor splits a dimension over several mesh axes "
            "in mesh order (('data', 'model') on mesh {'data': 2, 'model': 2}); its only other "
            "order, the private _StridedShard, is lost by elementwise ops and redistribute in "
            "torch 2.9. Write the tuple in mesh order, ('data', 'model'), or build the mesh "
            "with its axes in the order ('model', 'data')."
        ),
        "too_long": (
            "ShardingError: host_arrays['x']: partition spec P('data', None, 'model') has 3 "
            "entries but the array has rank 2; a spec may not be longer than the rank of the "
            "array it shards."
        ),
        "descending": (
            "ShardingError: Mesh({'data': 4}, devices=[3, 2, 1, 0]): along mesh axis 'data' the "
            "ranks [3, 2, 1, 0] do not ascend. torch 2.9's DeviceMesh runs an axis's "
            "collectives in ascending rank order while DTensor places shards by mesh position, "
            "so full_tensor and redistribute would misplace blocks. Order the ranks ascending "
            "along every axis (a transposed grid such as [[0, 2], [1, 3]] is fine)."
        ),
        "descending_device_mesh": (
            "ShardingError: Mesh({'data': 2, 'model': 2}, devices=[3, 1, 2, 0]): along mesh "
            "axis 'data' the ranks [3, 2] do not ascend. torch 2.9's DeviceMesh runs an axis's "
            "collectives in ascending rank order while DTensor places shards by mesh position, "
            "so full_tensor and redistribute would misplace blocks. Order the ranks ascending "
            "along every axis (a transposed grid such as [[0, 2], [1, 3]] is fine)."
        ),
        "unknown_axis": (
            "ShardingError: host_arrays['x']: partition spec P('nope',) names mesh axis 'nope', "
            "which is not an axis of the mesh; expected one of ('data', 'model')."
        ),
        "nameless": (
            "ShardingError: Mesh.from_device_mesh: the DeviceMesh has no mesh_dim_names; "
            "torchshard specs name mesh axes, so build it with init_device_mesh(device_type, "
            "shape, mesh_dim_names=(...))."
        ),
        "not_a_device_mesh": (
            "TypeError: Mesh.from_device_mesh: expected a "
            "torch.distributed.device_mesh.DeviceMesh, but got ndarray."
        ),
    }
    for rank, r in enumerate(results):
        for key, message in expected.items():
            assert r[key] == message, key
        assert r["reversed_tuple_specs"] == r["reversed_tuple"].replace("host_arrays", "host_specs")
        sub = "Mesh({'b': 2})" if rank < 2 else "Mesh({'b': 2}, devices=[2, 3])"
        ids = [0, 1] if rank < 2 else [2, 3]
        assert r["submesh"] == (
            f"ShardingError: mesh {sub} covers devices {ids}, but the runtime has 4 devices "
            "(ids 0..3); a mesh must cover every device exactly once."
        )


def test_equal_device_meshes_each_get_their_own_tensors(pools):
    assert pools(2).run("equal_device_meshes") == [[True, True]] * 2


def test_mesh_from_device_mesh(pools):
    for rank, r in enumerate(pools(4).run("from_device_mesh")):
        assert r == {
            "devices": [[0, 1], [2, 3]],
            "axis_names": ("data", "model"),
            "backend": "dtensor",
            "native_is_dm": True,
            "same_device_mesh": True,
            "shape": (8, 3),
            "back_equal": True,
        }, rank


@pytest.mark.parametrize("world", [2, 4])
def test_annotate_redistributes(pools, world):
    g = cases.global_value((2 * world, 2 * world), "float32")
    for rank, r in enumerate(pools(world).run("annotate")):
        placements, local = r["to_shard"]
        assert placements == ["S(0)"]
        assert torch.equal(local, g[2 * rank : 2 * rank + 2])
        assert r["same_object_if_unchanged"]
        placements, local = r["to_replicate"]
        assert placements == ["R"]
        assert torch.equal(local, g)
        placements, full = r["to_dim1"]
        assert placements == ["S(1)"]
        assert torch.equal(full, g)
        placements, local, dtype = r["int16"]
        assert (placements, dtype) == (["R"], "torch.int16")
        assert torch.equal(local, g.to(torch.int16))
        assert r["plain_tensor"] == (
            "TypeError: the dtensor backend constrains DTensors, but got Tensor; make global "
            "tensors with host_to_global_array (or DTensor.from_local) on "
            "Mesh({'data': " + str(world) + "})."
        )


def test_partial_outputs_read_back_reduced(pools):
    for r in pools(2).run("partial_readback"):
        assert r["placements"] == ["P"]
        assert torch.allclose(r["back"], r["expected"])
        assert torch.equal(r["back"], r["full"])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("key", "index_spec", "picked"),
    [("index", "replicated", ["R"]), ("index", "sharded", ["S(0)"]), ("onehot", "", ["P"])],
)
def test_dispatch_primitives_on_dtensors(pools, world, key, index_spec, picked):
    """index_select of a physical batch to a logical one (or the one-hot einsum), then a
    constraint to P("data"): exactly the logical rows, sharded on dim 0."""
    for r in pools(world).run("dispatch_primitives", index_spec=index_spec, key=key):
        assert r["picked_placements"] == picked
        assert r["placements"] == ["S(0)"]
        assert r["shape"] == (2 * world, 3)
        assert torch.equal(r["full"], r["expected"])
        assert torch.equal(r["local"], r["expected_local"])


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_training_gives_the_same_loss_on_every_rank(pools, world):
    results = pools(world).run("train_mlp", steps=3, batch=16)
    reference = cases.reference_training(steps=3, batch=16)
    first = results[0]
    for r in results[1:]:
        assert r["losses"] == first["losses"]
        assert torch.equal(r["weight"], first["weight"])
    np.testing.assert_allclose(first["losses"], reference["losses"], rtol=1e-5)
    torch.testing.assert_close(first["weight"], reference["weight"], rtol=1e-5, atol=1e-6)
    assert first["losses"][-1] < first["losses"][0]


@pytest.mark.parametrize("world", [2, 4])
def test_a_loader_thread_can_assemble_while_the_step_communicates(pools, world):
    expected_sum = float(sum(6 * r for r in range(world)))
    for r in pools(world).run("loader_thread", calls=20):
        assert r["errors"] == []
        assert not r["alive"]
        assert r["shapes"] == [(2 * world, 3)] * 20
        assert r["sums"] == [expected_sum] * 20


# -- in this process: no process group -----------------------------------------------------

_NO_PG = (
    "a mesh of the dtensor backend needs torch.distributed, but its default process group is "
    "not initialised. Call torch.distributed.init_process_group('gloo') (or 'nccl') on every "
    "process first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
)
_NO_PG_XLA = ', or use a mesh of the xla backend (backend="xla").'
_NO_PG_PLAIN = "; one process per device, e.g. torchrun --nproc-per-node 2 train.py."


def test_no_process_group_is_a_clear_error():
    """It names xla as the other way only where torch_xla is installed."""
    import torch.distributed as dist

    from torchshard._backend.xla.env import xla_installed

    assert not dist.is_initialized()
    message = _NO_PG + (_NO_PG_XLA if xla_installed() else _NO_PG_PLAIN)
    mesh = ts.Mesh(np.arange(2), ("data",), backend="dtensor")
    with pytest.raises(ts.errors.NoProcessGroupError, match=re.escape(message)):
        mesh.__enter__()
    assert ts.current_mesh() is None
    with pytest.raises(ts.errors.NoProcessGroupError, match=re.escape(message)):
        ts.create_device_mesh((2,), ("data",), backend="dtensor")
    assert isinstance(ts.errors.NoProcessGroupError(""), ValueError)


def test_set_agreement_check_returns_the_old_setting():
    assert ts.set_agreement_check(False) is True
    assert ts.set_agreement_check(True) is False


def test_agreement_env_var_is_read_at_import():
    code = "from torchshard._core.agreement import agreement_check_enabled as f; print(f())"
    env = dict(os.environ, TORCHSHARD_AGREEMENT_CHECK="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip() == "False", out.stderr


def test_xla_backend_accepts_what_dtensor_refuses(mesh42):
    """The boundary's new hooks are no-ops on torch_xla: any tuple order places fine."""
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    g = ts.host_to_global_array({"x": x}, partition=ts.P(("model", "data")))
    assert torch.equal(ts.global_to_host_array(g)["x"], torch.from_numpy(x))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_ranks_at_different_paces_stop_without_a_stuck_collective(pools, prefetch):
    """The ranks' background threads are at different batches when the consumers stop (rank
    1's source is slow): the agreement check runs on the consumers' threads, so no thread is
    left in a collective that the other rank never joins, and later collectives still pair."""
    results = pools(2).run("loader_outcomes", kind="uneven_pace", prefetch=prefetch)
    for r in results:
        assert r["error"] == "no error"
        assert r["got"] == [[float(i)] * 2 + [float(10 + i)] * 2 for i in range(3)]
        assert r["after"] == [(2, 2)] * 3
        assert r["stuck"] == []  # close() joined the loader's thread: none is left in a collective


_OUTCOME_MSG = (
    "ProcessDisagreementError: GlobalBatchLoader: batch {n}: every process must make the batch "
    "or end its source at the same batch, but {seen}. Give every process a source that yields "
    "the same number of batches (e.g. torchshard.host_sampler with drop_last=True)."
)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_ranks_whose_sources_end_at_different_batches_all_raise(pools, prefetch):
    results = pools(2).run("loader_outcomes", kind="short", prefetch=prefetch)
    seen = "process 0: a batch; process 1: the end of the source"
    for r in results:
        assert r["got"] == [[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0]]
        assert r["error"] == _OUTCOME_MSG.format(n=2, seen=seen)
        assert r["after"] == [(2, 2)] * 3


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_failure_on_one_rank_raises_on_every_rank(pools, prefetch):
    """Rank 1's source raises at batch 1: rank 1 gets its own error (with a note on the others),
    rank 0 a ProcessDisagreementError naming rank 1's failure; nobody waits forever."""
    r0, r1 = pools(2).run("loader_outcomes", kind="failure", prefetch=prefetch)
    seen = "process 0: a batch; process 1: a failure: ValueError: bad batch 1 on rank 1"
    assert r0["error"] == _OUTCOME_MSG.format(n=1, seen=seen)
    assert r1["error"].startswith("ValueError: bad batch 1 on rank 1 ")
    assert (
        "(the other processes' outcomes differ: "
        + _OUTCOME_MSG.format(n=1, seen=seen).removeprefix("ProcessDisagreementError: ")
        in r1["error"]
    )
    for r in (r0, r1):
        assert r["got"] == [[0.0, 0.0, 10.0, 10.0]]
        assert r["after"] == [(2, 2)] * 3


def test_loader_batch_of_another_shape_on_one_rank_raises_on_every_rank(pools):
    """Rank 1's batch 1 has 3 columns: it fails rank 1's own check against batch 0, and rank 0
    learns of it at the same batch."""
    r0, r1 = pools(2).run("loader_outcomes", kind="shape", prefetch=2)
    assert r0["error"].startswith(
        "ProcessDisagreementError: GlobalBatchLoader: batch 1: every process must make the "
        "batch or end its source at the same batch, but process 0: a batch; process 1: a "
        "failure: ShardingError: "
    )
    assert r1["error"].startswith("ShardingError: ")
    assert "batch 1" in r1["error"] and "(2, 3)" in r1["error"]
    for r in (r0, r1):
        assert r["got"] == [[0.0, 0.0, 10.0, 10.0]]
        assert r["after"] == [(2, 2)] * 3


def test_loader_batches_of_different_shapes_raise_the_leaf_path_on_every_rank(pools):
    results = pools(2).run("loader_outcomes", kind="shape0", prefetch=2)
    for r in results:
        assert r["error"] == (
            "ProcessDisagreementError: GlobalBatchLoader: batch 0: batch['x']: every process "
            "must pass the same shape and "
            "dtype for a leaf (the global shape is inferred from them); expected (2, 4) float32 "
            "(as on process 0), got (2, 3) float32 on process(es) [1]. Make every process's "
            "input yield the same shapes and dtypes (pad or drop a short last batch, or use "
            "torchshard.InputDispatcher)."
        )
        assert r["got"] == []
        assert r["after"] == [(2, 2)] * 3


def test_ranks_whose_meshes_name_the_axes_in_another_order_disagree(pools):
    """Before: the agreement check ignored the mesh, and the ranks got DTensors with
    different placements (the read-back then failed)."""
    expected = (
        "ProcessDisagreementError: host_to_global_array: every process must place on the same mesh "
        "(axis names in the same order, the same sizes and devices); expected mesh "
        "{'data': 2, 'model': 2} of devices [[0, 1], [2, 3]] (as on process 0), got mesh "
        "{'model': 2, 'data': 2} of devices [[0, 1], [2, 3]] on process(es) [1]. Build the "
        "mesh alike on every process (e.g. init_device_mesh(..., mesh_dim_names=...) with the "
        "same names in the same order)."
    )
    for r in pools(4).run("mesh_axes_disagree"):
        assert r == {"error": expected, "after": ["S(0)", "R"]}


def test_the_process_group_can_be_initialised_again_after_torchshard_ran():
    """destroy_process_group + init_process_group after torchshard's calls: torchshard's
    calls on the new group give the new values. A pool of its own: its default group is
    replaced. (A new store on a new port: see the case's docstring.)"""
    from _multiproc import WorkerPool

    pool = WorkerPool(2, collective_timeout=20.0, timeout=120.0)
    try:
        results = pool.run("reinit_process_group")
    finally:
        pool.close()
    for r in results:
        assert r["before"] == [0.0, 0.0, 1.0, 1.0] and r["after"] == [10.0, 10.0, 11.0, 11.0]
        # A mesh made before the re-initialisation is refused (torch 2.9 said "Could not
        # resolve the process group registered under the name 3"; 2.14 used whichever new
        # group had the old name).
        assert r["stale"].startswith("Mesh({'data': 2}) was made before torch.distributed's")
        assert "Make the mesh again after init_process_group" in r["stale"]
