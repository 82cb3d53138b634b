"""In-step sharding and dispatch on DTensors, on real processes (2 and 4 gloo workers).

The workers run ``_dtensor_dispatch_cases.py``; this process asserts on what every rank returns:
against numpy/torch indexing of the global value, against a single-process training run, and
against the torch_xla backend under ``virtual_hosts(n)`` fed the same per-host inputs (XLA mesh:
the rank grid with its last axis widened to ``8 / n`` devices, so each virtual host holds the
block its rank holds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any

import _dtensor_dispatch_cases as dcases
import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard.testing import host_to_global_array_per_host, virtual_hosts

G22 = [[0, 1], [2, 3]]
G22T = [[0, 2], [1, 3]]
DM = ("data", "model")
KEY = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY
CASES = "_dtensor_dispatch_cases:"


def _xla_mesh(grid, names) -> ts.Mesh:
    arr = np.asarray(grid)
    k = 8 // arr.size
    return ts.Mesh((arr[..., None] * k + np.arange(k)).reshape((*arr.shape[:-1], -1)), names)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that equality is bit for bit (-0.0 and NaN included)."""
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def _in_position_order(results, grid) -> torch.Tensor:
    """The ranks' local blocks of a tensor split along dim 0 over the whole grid, in mesh
    position order (row-major over the grid)."""
    return torch.cat([results[r]["local"] for r in np.asarray(grid).reshape(-1)])


# -- with_sharding_constraint / maybe_shard -----------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_constraints_redistribute_dtensors(pools, world):
    g = dcases.global_value((2 * world, 2 * world), "float32")
    n = 2 * world // world
    for rank, r in enumerate(pools(world).run(CASES + "constraints")):
        assert (r["rows"]["placements"], r["rows"]["shape"]) == (["S(0)"], tuple(g.shape))
        assert torch.equal(r["rows"]["local"], g[rank * n : (rank + 1) * n])
        assert torch.equal(r["rows"]["full"], g)
        assert r["tree_a"]["placements"] == ["S(1)"]
        assert torch.equal(r["tree_a"]["local"], g[:, rank * n : (rank + 1) * n])
        assert r["tree_b_untouched"]
        assert r["same_if_unchanged"]
        # maybe_shard: P() replicates; UNCONSTRAINED keeps the split it has.
        assert r["maybe_empty_spec"]["placements"] == ["R"]
        assert torch.equal(r["maybe_empty_spec"]["local"], g)
        assert r["maybe_all_unconstrained_same"]
        assert r["maybe_keep_same"]
        assert r["maybe_keep_moves"]["placements"] == ["S(1)"]
        assert torch.equal(r["maybe_keep_moves"]["full"], g)
        assert r["maybe_plain_same"]
        assert r["maybe_too_long_same"]


@pytest.mark.parametrize("world", [2, 4])
def test_strict_errors_and_best_effort_log_on_every_rank(pools, world):
    for r in pools(world).run(CASES + "constraints"):
        assert r["strict_plain"] == (
            "TypeError: x['x'][0]: with_sharding_constraint annotates tensors of the dtensor "
            "backend (inside a step), but got Tensor on cpu. Move host data with "
            "host_to_global_array first."
        )
        assert r["strict_axis"] == (
            "ShardingError: x['x']: partition spec P('nope',) names mesh axis 'nope', which "
            "is not an axis of the mesh; expected one of ('data',)."
        )
        assert r["strict_unconstrained"] == (
            "ShardingError: x: partition spec P(UNCONSTRAINED,): entry 0 is UNCONSTRAINED, "
            "which only maybe_shard accepts; placing data needs a concrete spec."
        )
        plain = (
            "maybe_shard: left Tensor on cpu as it is: P('data',) applies to tensors of the "
            "dtensor backend."
        )
        too_long = (
            f"maybe_shard: left a tensor of shape {(2 * world, 2 * world)} as it is: partition "
            "spec P('data', None, None) has 3 entries but the array has rank 2; a spec may not "
            "be longer than the rank of the array it shards."
        )
        assert r["log_1d"] == [plain, too_long]


_ORDER = (
    "dim 0 is split over the mesh axes ('model', 'data') (major to minor), but DTensor splits a "
    "dimension over several mesh axes in mesh order (('data', 'model') on mesh {'data': 2, "
    "'model': 2}); its only other order, the private _StridedShard, is lost by elementwise ops "
    "and redistribute in torch 2.9. Write the tuple in mesh order, ('data', 'model'), or build "
    "the mesh with its axes in the order ('model', 'data')."
)


def test_constraints_on_a_2d_mesh(pools):
    """A tuple of axes DTensor cannot express, or a DTensor of another DeviceMesh: strict
    raises (naming the leaf), maybe_shard leaves the tensor and logs. ``UNCONSTRAINED`` dims
    keep the mesh axes that split them unless the spec takes those axes for another dim."""
    g = dcases.global_value((8, 8), "float32")
    for rank, r in enumerate(pools(4).run(CASES + "constraints")):
        i, j = divmod(rank, 2)
        assert r["both"]["placements"] == ["S(0)", "S(0)"]
        assert torch.equal(r["both"]["local"], g[2 * rank : 2 * rank + 2])
        assert r["strict_order"] == f"ShardingError: x['x']: {_ORDER}"
        assert r["maybe_order_same"]
        other = (
            "the DTensor lives on a DeviceMesh of ranks [0, 1, 2, 3] (axes ('data',)), not on "
            "the current mesh Mesh({'data': 2, 'model': 2}) (ranks [[0, 1], [2, 3]]); constrain "
            "it inside `with Mesh.from_device_mesh(x.device_mesh):`, or make it on the current "
            "mesh."
        )
        assert r["strict_other_mesh"] == f"ShardingError: x['x']: {other}"
        assert r["maybe_other_mesh_same"]
        assert r["log_2d"] == [
            f"maybe_shard: left a tensor of shape (8, 8) as it is: {_ORDER}",
            f"maybe_shard: left a tensor of shape (8, 8) as it is: {other}",
        ]
        # [R, S(1)] + ("data", UNCONSTRAINED): dim 1 keeps "model".
        assert r["keep_dim1"]["placements"] == ["S(0)", "S(1)"]
        assert torch.equal(r["keep_dim1"]["local"], g[4 * i : 4 * i + 4, 4 * j : 4 * j + 4])
        assert r["keep_nothing_to_move_same"]
        # [R, S(1)] + (UNCONSTRAINED, "data"): "data" now splits dim 1, "model" is freed.
        assert r["keep_axis_taken"]["placements"] == ["S(1)", "R"]
        assert torch.equal(r["keep_axis_taken"]["local"], g[:, 4 * i : 4 * i + 4])
        # [S(1), S(0)] + (UNCONSTRAINED, None): dim 0 keeps "model", dim 1 is replicated.
        assert r["keep_dim0"]["placements"] == ["R", "S(0)"]
        assert torch.equal(r["keep_dim0"]["local"], g[4 * j : 4 * j + 4])
        for k in ("both", "keep_dim1", "keep_axis_taken", "keep_dim0"):
            assert torch.equal(r[k]["full"], g), k


# -- dispatch_input_batch --------------------------------------------------------------------

DISPATCH = [
    (2, [0, 1], ("data",), "data"),
    (4, [0, 1, 2, 3], ("data",), "data"),
    (4, G22, DM, "data"),
    (4, G22, DM, ("data", "model")),
    (4, G22T, DM, ("data", "model")),
]


def _dispatch_id(case) -> str:
    world, grid, _, axes = case
    return f"{world}p-{np.asarray(grid).tolist()}-{axes}".replace(" ", "")


_DISPATCHED: dict[tuple, list] = {}


def _dispatch(pools, case, key, inside):
    k = (_dispatch_id(case), key, inside)
    if k not in _DISPATCHED:
        world, grid, names, axes = case
        _DISPATCHED[k] = pools(world).run(
            CASES + "dispatch_batch",
            grid=grid,
            axis_names=names,
            batch_axes=axes,
            key=key,
            inside=inside,
        )
    return _DISPATCHED[k]


def _batch_placements(names, axes) -> list[str]:
    axes = (axes,) if isinstance(axes, str) else axes
    return ["S(0)" if a in axes else "R" for a in names]


@pytest.mark.parametrize("inside", [True, False], ids=["in-mesh", "no-mesh"])
@pytest.mark.parametrize("key", ["onehot", "index"])
@pytest.mark.parametrize("case", DISPATCH, ids=_dispatch_id)
def test_dispatch_input_batch_on_dtensors(pools, case, key, inside):
    """The dict holding the key (one-hot [P, L] split like the data, or gather indices [L]
    replicated) keeps exactly the logical rows, bit for bit (float32 -0.0 and NaN, int16,
    bool); its siblings outside the dict keep their physical rows; the input keeps its key.
    Outside ``with mesh:`` the DTensors still dispatch (each carries its DeviceMesh)."""
    _, _, names, axes = case
    for r in _dispatch(pools, case, key, inside):
        assert r["keys"] == ["f", "m", "y"]
        assert r["input_keeps_key"]
        rows = r["expected_rows"]
        for name in ("f", "y", "m"):
            assert torch.equal(_bits(r[name]["full"]), _bits(r["data"][name][rows])), name
            assert r[name]["shape"] == tuple(r["data"][name][rows].shape)
            assert r[name]["placements"] == _batch_placements(names, axes)
        for name in ("x", "s"):
            assert torch.equal(r[name]["full"], r["data"][name])
            assert r[name]["placements"] == _batch_placements(names, axes)


@pytest.mark.xla
@pytest.mark.parametrize("key", ["onehot", "index"])
@pytest.mark.parametrize("case", DISPATCH, ids=_dispatch_id)
def test_dispatch_input_batch_same_as_xla_virtual_hosts(pools, case, key):
    """Equal values, bit for bit: the sign of zero too (torch_xla's gather moves floats as
    integers of the same width; the masked gather summed +0.0 over the devices before)."""
    world, grid, names, axes = case
    results = _dispatch(pools, case, key, True)
    with virtual_hosts(world), _xla_mesh(grid, names):
        g = host_to_global_array_per_host(
            [r["input"] for r in results], partition=dcases.dispatch_partition(axes, key)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            out = ts.replicate_to_local_data(ts.dispatch_input_batch(g, batch_axis_names=axes))
    for r in results:
        for name in ("f", "y", "m"):
            torch.testing.assert_close(
                out["nested"][name], r[name]["full"], rtol=0, atol=0, equal_nan=True
            )
        assert torch.equal(out["x"], r["x"]["full"])
        assert torch.equal(out["s"], r["s"]["full"])
    rows = results[0]["expected_rows"]
    assert torch.equal(out["nested"]["f"][0], torch.zeros(3))  # -0.0 == 0.0
    # torch_xla's take_rows moves floats as same-width integers: the sign of zero is kept
    # (it was lost before, +0.0 from the masked gather), as on DTensor.
    assert torch.signbit(out["nested"]["f"][0]).all()
    assert torch.signbit(results[0]["f"]["full"][0]).all()
    assert torch.signbit(results[0]["data"]["f"][rows[0]]).all()


# -- InputDispatcher ---------------------------------------------------------------------------

# Issue 3's table, (global logical, global physical, physical feeds, logical feed indices),
# with one physical feed per process: rows with 2 or 4 feeds run as they are; 16 feeds need
# 16 processes, so (2, None, 16, None) becomes (2, None, 4, None) (2 examples, 4 feeds: two
# padding feeds) and (2, 16, 16, (7, 11)) becomes (2, 8, 4, (3, 1)) (two of four feeds read,
# in reversed order); (8, 16, 2, None) and (8, None, 2, None) run on 2 processes,
# (8, None, None, None) (feeds from process_count()) on 2 and 4; (4, 16, 4, (2,)) adds one
# reading feed of four.
TABLE = [
    (2, (8, None, 2, None)),
    (2, (8, 16, 2, None)),
    (2, (8, 16, 2, (0,))),
    (2, (2, 8, 2, (0,))),
    (2, (8, None, None, None)),
    (4, (2, None, 4, None)),
    (4, (8, 16, 4, (1, 3))),
    (4, (2, 8, 4, (3, 1))),
    (4, (8, None, None, None)),
    (4, (4, 16, 4, (2,))),
]
GRIDS = {2: [([0, 1], ("data",))], 4: [([0, 1, 2, 3], ("data",)), (G22, DM), (G22T, DM)]}
DISPATCHER = [(w, grid, names, row) for w, row in TABLE for grid, names in GRIDS[w]]


def _dispatcher_id(case) -> str:
    world, grid, _, row = case
    return f"{world}p-{np.asarray(grid).tolist()}-{row}".replace(" ", "")


_TABLE: dict[str, list] = {}


def _table(pools, case):
    k = _dispatcher_id(case)
    if k not in _TABLE:
        world, grid, names, (logical, physical, feeds, indices) = case
        _TABLE[k] = pools(world).run(
            CASES + "input_dispatcher",
            grid=grid,
            axis_names=names,
            logical=logical,
            physical=physical,
            feeds=feeds,
            logical_feed_indices=indices,
        )
    return _TABLE[k]


@pytest.mark.parametrize("case", DISPATCHER, ids=_dispatcher_id)
def test_input_dispatcher_table_on_real_processes(pools, case):
    """Each rank is one physical feed, constructs the dispatcher outside any mesh (defaults from
    the DTensor topology), reads the shard ``feed_read_config`` names, pads on the host and
    dispatches in the step: every rank sees the whole logical batch, in logical order (or, for
    a pass-through dispatcher, in the mesh's block order), split over the mesh, and the
    features travel with their example."""
    world, grid, names, (logical, physical, _, _) = case
    results = _table(pools, case)
    first = results[0]["out"]["example_index"]["full"]
    identity = results[0]["config"]["is_identity"]
    for rank, r in enumerate(results):
        config = r["config"]
        assert not r["torch_xla_loaded"]
        assert (config["num_physical_feeds"], config["physical_feed_index"]) == (world, rank)
        if physical is not None:
            assert config["global_physical_batch_size"] == physical
        fp = config["feed_physical_batch_size"]
        assert r["physical_shapes"]["example_index"] == (fp * world,)
        assert {k: s for k, (s, _) in r["shapes"].items()} == {
            k: v.shape for k, v in r["physical"].items()
        }
        out = r["out"]
        index = out["example_index"]["full"]
        assert torch.equal(index, first)  # identical on every rank
        assert sorted(index.tolist()) == list(range(logical))
        if not identity:
            assert index.tolist() == list(range(logical))  # the logical order
        expected = dcases.feed_batch(0, logical)
        order = index.numpy()
        assert np.array_equal(out["x"]["full"].numpy(), expected["x"][order])
        assert np.array_equal(out["flag"]["full"].numpy(), expected["flag"][order])
        assert out["example_index"]["placements"] == ["S(0)"] * len(names)
    blocks = [r["out"]["example_index"] for r in results]
    assert torch.equal(_in_position_order(blocks, grid), first)


@pytest.mark.xla
@pytest.mark.parametrize("case", DISPATCHER, ids=_dispatcher_id)
def test_input_dispatcher_same_as_xla_virtual_hosts(pools, case):
    """The per-rank physical batches, given to torch_xla's virtual hosts, dispatch to the same
    logical batch."""
    world, grid, names, (logical, physical, feeds, indices) = case
    results = _table(pools, case)
    physical = results[0]["config"]["global_physical_batch_size"]
    if physical % 8:
        pytest.skip(
            f"the default physical batch follows the device count: {physical} rows on {world} "
            "DTensor devices cannot be split over torch_xla's 8"
        )
    with virtual_hosts(world), _xla_mesh(grid, names):
        d = ts.InputDispatcher(
            logical,
            global_physical_batch_size=physical,
            num_physical_feeds=feeds,
            logical_feed_indices=indices,
        )
        g = host_to_global_array_per_host(
            [r["physical"] for r in results], partition=d.partition_spec
        )
        out = ts.replicate_to_local_data(d.physical_to_logical_batch(g, check=True))
    for r in results:
        for name in ("example_index", "x", "flag"):
            assert torch.equal(out[name], r["out"][name]["full"]), name


def test_input_dispatcher_defaults_outside_a_mesh(pools):
    """process_index()/process_count() and InputDispatcher's defaults outside any mesh come
    from torch.distributed in a DTensor process; torch_xla is never imported."""
    for world in (2, 4):
        for rank, r in enumerate(pools(world).run(CASES + "defaults_outside_mesh")):
            assert r == {
                "process_index": rank,
                "process_count": world,
                "infer": (world,),
                "dispatcher": (world, rank, 8),
                "torch_xla_loaded": False,
            }


def test_spmd_input_dispatcher_on_a_dtensor_mesh(pools):
    """On a (2, 2) mesh: P("data") makes two feeds (ranks sharing a "data" coordinate read the
    same shard), P(("data", "model")) four; the assembled batch is the global one."""
    for rank, r in enumerate(pools(4).run(CASES + "spmd_dispatcher")):
        assert r["data"]["read"] == {"num_shards": 2, "shard_index": rank // 2}
        assert r["data"]["fl"] == 4
        assert r["data"]["example_index"]["placements"] == ["S(0)", "R"]
        assert r["both"]["read"] == {"num_shards": 4, "shard_index": rank}
        assert r["both"]["example_index"]["placements"] == ["S(0)", "S(0)"]
        for k in ("data", "both"):
            assert r[k]["example_index"]["full"].tolist() == list(range(8))
        assert r["num_partitions"] == (
            "ValueError: partition_spec=P('data',) attempts to divide the batch over "
            "num_partitions=2, which is incompatible with global_logical_batch_size=3."
        )


@pytest.mark.parametrize("world", [2, 4])
def test_take_rows_on_every_layout_of_the_rows(pools, world):
    """The gather keeps the input's placements (Partial inputs are summed first, giving
    Replicate), takes the right rows for an uneven logical batch (7 rows) and from an uneven
    input where the last rank holds no row, and sends gradients
    back to the rows it took (summed where a row is taken twice: row 7 on 2 processes)."""
    results = pools(world).run(CASES + "take_rows_layouts")
    assert [r["short"]["held"] for r in results][-1] == 0  # a rank without rows
    for r in results:
        expected = r["expected"]
        placements = {
            "rows_data": ["S(0)", "R"],
            "rows_both": ["S(0)", "S(0)"],
            "rows_data_cols_model": ["S(0)", "S(1)"],
            "cols_model": ["R", "S(1)"],
            "replicated": ["R", "R"],
            "partial": ["R", "R"],
        }
        for name, p in placements.items():
            assert r[name]["placements"] == p, name
            if name == "partial":  # g / world summed over the ranks: equal up to rounding
                torch.testing.assert_close(r[name]["full"], expected)
            else:
                assert torch.equal(r[name]["full"], expected), name
        assert r["short"]["placements"] == ["S(0)", "S(0)"]
        assert torch.equal(r["short"]["full"], r["short"]["expected"])
        g = dcases.global_value((4 * world, 4), "float64")
        index = torch.tensor([5, 0, 4 * world - 1, 3, 2 * world, 1, 7])
        grad = torch.zeros_like(g).index_add(0, index, 2 * g[index])  # d sum(x[i]^2) / dx
        torch.testing.assert_close(r["grad"], grad)


# -- training ------------------------------------------------------------------------------------

# (world, global logical, global physical, logical feed indices)
TRAINING = [(2, 8, 12, None), (2, 4, 8, (1,)), (4, 8, 16, None), (4, 4, 16, (3, 1))]


@pytest.mark.parametrize(
    ("world", "logical", "physical", "indices"),
    TRAINING,
    ids=[f"{w}p-L{lg}-P{p}-{i}" for w, lg, p, i in TRAINING],
)
def test_loader_example_trains_with_the_same_loss_on_every_rank(
    pools, world, logical, physical, indices
):
    """Each rank's DataLoader reads the shard ``host_sampler(ds, dispatcher)`` names;
    ``GlobalBatchLoader(dispatcher=...)`` pads it and assembles the DTensors on its background
    thread; the step dispatches the logical batch and trains replicated parameters. Every rank
    sees the same losses and weights, equal to a single-process run on the same global batches
    (whose loaders use ``DistributedSampler`` directly: an independent oracle for the shard).
    """
    steps = 4
    results = pools(world).run(
        CASES + "train_with_loader",
        logical=logical,
        physical=physical,
        logical_feed_indices=indices,
        steps=steps,
    )
    feeds = len(indices) if indices else world
    reference = dcases.reference_loader_training(feeds, logical // feeds, steps)
    first = results[0]
    assert len(first["losses"]) == steps
    for r in results:
        assert r["losses"] == first["losses"]
        assert torch.equal(r["weight"], first["weight"])
        for seen, expected in zip(r["examples"], reference["examples"], strict=True):
            assert torch.equal(seen, expected)
    np.testing.assert_allclose(first["losses"], reference["losses"], rtol=1e-5)
    torch.testing.assert_close(first["weight"], reference["weight"], rtol=1e-5, atol=1e-6)


# -- the default backend, in fresh interpreters ----------------------------------------------

_FRESH = """
import sys
sys.modules["torch_xla"] = None  # as on a machine without torch_xla
import torchshard as ts
"""

_TORCH = torch.__version__.split("+")[0]
_INSTALL_XLA = (
    "needs torch_xla, which is not installed; install the extra with `pip install "
    "'torchshard-input[xla]'` (from a checkout: `pip install -e '.[xla]'`): torch-xla 2.9, which "
    "pins torch 2.9"
    + ("" if _TORCH.startswith("2.9.") else f" (this is torch {_TORCH}, which it would replace)")
    + ". Without torch_xla, torchshard runs on torch.distributed DTensor, the default then: call "
    "torch.distributed.init_process_group(...) and build the mesh with create_device_mesh (or "
    "Mesh.from_device_mesh)."
)


def _fresh(code: str, lines: int = 1) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    out = subprocess.run(
        [sys.executable, "-c", _FRESH + code],
        env=dict(env, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-lines:]  # gloo prints its connections first
    return last[0] if lines == 1 else last


def test_without_a_process_group_or_torch_xla_the_default_is_dtensor_and_says_what_to_do():
    """Without torch_xla every mesh is a DTensor one unless the user names xla: nothing asks
    for the xla extra unless the user asked for xla."""
    code = """
import numpy as np
from torchshard._backend.registry import default_name as default_backend_name
print(default_backend_name(), ts.Mesh(np.arange(8), "data").backend)
for call in (ts.process_index, lambda: ts.create_device_mesh((2,), ("data",)),
             lambda: ts.Mesh(np.arange(8), "data").__enter__(),
             lambda: ts.setup_cpu_emulation(8),
             lambda: ts.Mesh(np.arange(8), "data", backend="xla").__enter__()):
    try:
        call()
    except ImportError as e:
        print(f"{type(e).__name__}: {e}")
    except ValueError as e:
        print(f"{type(e).__name__}: {e}".splitlines()[0])
"""
    default, *no_group, emulation, xla = _fresh(code, lines=6)
    assert default == "dtensor dtensor"
    assert len(no_group) == 3
    for line in no_group:  # process_index, create_device_mesh, a Mesh entered
        assert line.startswith(
            "NoProcessGroupError: a mesh of the dtensor backend needs torch.distributed, but its "
            "default process group is not initialised."
        ), line
        assert "xla]" not in line
    assert (
        emulation
        == f"MissingDependencyError: setup_cpu_emulation (emulated XLA devices) {_INSTALL_XLA}"
    )
    assert xla == f"MissingDependencyError: the xla backend (torch_xla SPMD) {_INSTALL_XLA}"


def test_with_a_process_group_and_no_torch_xla_the_default_is_dtensor():
    code = """
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
from torchshard._backend.registry import default_name as default_backend_name
d = ts.InputDispatcher(4)
print(default_backend_name(), ts.process_index(), ts.process_count(), d.num_physical_feeds)
dist.destroy_process_group()
"""
    assert _fresh(code) == "dtensor 0 1 1"


@pytest.mark.xla
def test_in_a_torch_xla_process_the_default_stays_xla():
    from torchshard._backend.registry import default_name as default_backend_name

    assert "torch_xla" in sys.modules
    assert default_backend_name() == "xla"
    assert (ts.process_index(), ts.process_count()) == (0, 1)


def test_take_rows_and_full_local_on_plain_tensors():
    """Outside DTensor the dispatch primitives are plain torch: the key itself, index_select."""
    from torchshard._backend.registry import lookup

    x, index = torch.arange(12).reshape(6, 2), torch.tensor([4, 0])
    backend = lookup(x)
    assert backend.name == "xla"
    assert backend.step.full_local(index) is index
    assert torch.equal(backend.step.take_rows(x, index), x[[4, 0]])


# -- dispatch moves bits, plans once -----------------------------------------------------------


@pytest.mark.parametrize(("world", "logical"), [(4, 8), (4, 4), (4, 1), (2, 1)])
def test_dispatch_moves_bits_on_dtensor(pools, world, logical):
    """-0.0, NaN payloads (quiet and signalling, either sign) and subnormals of every float
    dtype arrive as they left, on every rank, for 8, 4 and 1 logical rows (1 row over 2 or 4
    ranks: an uneven Shard(0), which DTensor keeps). The rows are summed over the ranks as
    integers of their width; summed as floats (filled with -0.0) gloo quieted signalling NaNs,
    rewrote half floats' NaN payloads and lost complex parts' -0.0."""
    from bit_patterns import FLOATS, bits, odd_values

    results = pools(world).run(CASES + "dispatch_bits", logical=logical)
    for r in results:
        wrong = []
        for dt in FLOATS:
            want = odd_values(dt, 3 * logical).reshape(logical, 3)
            if r["dtypes"][str(dt)] != str(dt) or not torch.equal(r["bits"][str(dt)], bits(want)):
                wrong.append(str(dt))
        assert not wrong
        assert set(map(tuple, r["placements"].values())) == {("S(0)",)}


def test_dtensor_dispatch_plans_once(pools):
    """The DTensor analogue of compiling once: over repeated calls with one mesh, shapes and
    dtypes, torch's redistribute planner and sharding propagator and torchshard's placements
    miss their caches on the first call only (on every rank)."""
    for r in pools(4).run(CASES + "dispatch_bits", logical=8, calls=4):
        assert r["misses"][1:] == [r["misses"][0]] * 3, r["misses"]
        assert r["misses"][0]["redistribute"] > 0  # the count observes the planner
