"""torchax backend cases on real JAX processes (run by ``_jax_multiproc``'s workers as
``"_torchax_cases:<name>"``): 2 or 4 processes, 8 CPU devices in all, gloo collectives.

JAX itself is the oracle: each process also builds the same blocks with
``jax.make_array_from_process_local_data`` and compares every addressable shard (index and
data) with torchshard's; whole values are compared through ``multihost_utils.process_allgather``
of both; index maps through JAX's ``NamedSharding.devices_indices_map`` on the mesh's own
``jax_mesh``. The per-process data are pure functions of (process, world) here, so the test
process builds the expected global values with numpy. Each case returns plain values.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def _ts() -> Any:
    import torchshard

    return torchshard


def _jax() -> Any:
    import jax

    return jax


def _world() -> tuple[int, int]:
    jax = _jax()
    return jax.process_index(), jax.process_count()


def _ranges(index: Any, shape: Any) -> list[list[int]]:
    return [list(sl.indices(n)[:2]) for sl, n in zip(index, shape, strict=True)]


def _jax_ids() -> dict[Any, int]:
    """JAX device -> torchshard's id, computed here (not by torchshard): by process, then id."""
    jax = _jax()
    order = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return {d: i for i, d in enumerate(order)}


def _shards(array: Any) -> dict[int, tuple[list[list[int]], np.ndarray]]:
    """Every addressable shard of ``array``: torchshard device id -> (ranges, data)."""
    ids = _jax_ids()
    return {
        ids[s.device]: (_ranges(s.index, array.shape), np.asarray(s.data))
        for s in array.addressable_shards
    }


def _same_shards(mine: Any, oracle: Any) -> list[str]:
    """Where two arrays' addressable shards differ (index or bits), as text; [] when alike."""
    a, b = _shards(mine), _shards(oracle)
    out = []
    if a.keys() != b.keys():
        out.append(f"devices {sorted(a)} != {sorted(b)}")
    for d in sorted(set(a) & set(b)):
        (ra, da), (rb, db) = a[d], b[d]
        if ra != rb:
            out.append(f"device {d}: ranges {ra} != {rb}")
        elif da.dtype != db.dtype or da.tobytes() != db.tobytes():
            out.append(f"device {d}: data differ")
    return out


def _allgather(array: Any) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@contextlib.contextmanager
def _timeout(seconds: float) -> Iterator[None]:
    """torchshard's exchange timeout set to ``seconds`` for the block (the session's bound)."""
    from torchshard._backend.torchax import collective

    s = collective.session()
    old = s.timeout
    s.timeout = seconds
    try:
        yield
    finally:
        s.timeout = old


# -- the run ---------------------------------------------------------------------------------


def topology() -> dict[str, Any]:
    """What torchshard reports of the run, beside JAX's own answers."""
    ts, jax = _ts(), _jax()
    plain = ts.create_device_mesh((-1, 2), ("data", "model"), backend="torchax")
    hybrid = ts.create_device_mesh(
        ts.HybridMeshShape((4 // jax.process_count(), 2), (jax.process_count(), 1)),
        ("data", "model"),
        backend="torchax",
    )
    ids = _jax_ids()
    with plain:
        inside = jax.sharding.get_mesh()
        index, count = ts.process_index(), ts.process_count()
    after = jax.sharding.get_mesh()
    return {
        "process": (index, count),
        "jax_process": (jax.process_index(), jax.process_count()),
        "local_jax_ids": [d.id for d in jax.local_devices()],
        "plain": plain.devices.tolist(),
        "plain_jax": [[ids[d] for d in row] for row in plain.jax_mesh.devices.tolist()],
        "hybrid": hybrid.devices.tolist(),
        "hybrid_owners": [[d.process_index for d in row] for row in hybrid.jax_mesh.devices],
        "axis_types": [str(t) for t in plain.jax_mesh.axis_types],
        "inside_is_mesh": inside == plain.jax_mesh,
        "after_empty": bool(getattr(after, "empty", after is None)),
        "from_jax": ts.Mesh.from_jax(plain.jax_mesh) == plain,
    }


# -- the conformance vectors -------------------------------------------------------------------


def conformance(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each valid host-layout case of this world for real: this process passes its block; its
    shards are checked against the recorded indices, JAX's devices_indices_map, JAX's own
    make_array_from_process_local_data (shard for shard) and the whole value; each invalid
    case's error type."""
    from helpers import take_segments

    ts, jax = _ts(), _jax()
    rank, _ = _world()
    P = jax.sharding.PartitionSpec
    out: dict[str, Any] = {}
    for case in cases:
        mesh = ts.Mesh(
            np.asarray(case["device_ids"]).reshape(case["mesh_shape"]),
            tuple(case["axis_names"]),
            backend="torchax",
        )
        entries = [tuple(e) if isinstance(e, list) else e for e in case["spec"]]
        spec = ts.P(*entries)
        if not case["valid_input"]:
            local = np.zeros(case["local_shape"], np.float32)
            with mesh:
                out[case["id"]] = _error(
                    lambda local=local, spec=spec: ts.host_to_global_array(
                        {"x": local}, partition=spec
                    )
                )
            continue
        shape = tuple(case["global_shape"])
        G = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
        block = take_segments(G, case["hosts"][rank]["segments"])
        with mesh:
            g = ts.host_to_global_array({"x": block}, partition=spec)["x"]
            whole = ts.replicate_to_local_data(g)
        try:  # a non-grid block holds parts other processes' devices hold: refused here
            back = ts.global_to_host_array(g).numpy()
        except ts.errors.ShardingError as e:
            back = None if "not a grid per host" in str(e) else e
        array = g.jax()
        sharding = jax.sharding.NamedSharding(mesh.jax_mesh, P(*entries))
        oracle = jax.make_array_from_process_local_data(sharding, block, shape)
        ids = _jax_ids()
        problems = _same_shards(array, oracle)
        recorded = {int(d): [list(r) for r in rs] for d, rs in case["indices"].items()}
        jax_map = {
            ids[d]: _ranges(i, shape) for d, i in sharding.devices_indices_map(shape).items()
        }
        for d, (ranges, data) in _shards(array).items():
            if ranges != recorded[d] or ranges != jax_map[d]:
                problems.append(f"device {d}: {ranges} vs recorded {recorded[d]}, JAX {jax_map[d]}")
            if not np.array_equal(data, G[tuple(slice(a, b) for a, b in ranges)]):
                problems.append(f"device {d}: data is not G{ranges}")
        if case["grid"] and not (isinstance(back, np.ndarray) and np.array_equal(back, block)):
            problems.append(f"global_to_host_array is not the block: {back}")
        if not case["grid"] and back is not None:
            problems.append(f"a non-grid block was read back: {back}")
        if not np.array_equal(whole.numpy(), G) or not np.array_equal(_allgather(array), G):
            problems.append("the whole value is not G")
        out[case["id"]] = problems or "ok"
    return out


# -- host -> global, checks, dispatch, a model ---------------------------------------------------


def placement(dtype: str) -> dict[str, Any]:
    """A batch of this process's rows (``dtype``), beside JAX's own placement of it."""
    ts, jax = _ts(), _jax()
    rank, world = _world()
    P = jax.sharding.PartitionSpec
    rows = 16 // world
    block = (np.arange(rows * 3).reshape(rows, 3) + 100 * rank).astype(dtype)
    mesh = ts.create_device_mesh((-1, 2), ("data", "model"), backend="torchax")
    with mesh:
        g = ts.host_to_global_array({"x": torch.from_numpy(block)}, partition=ts.P("data"))["x"]
    sharding = jax.sharding.NamedSharding(mesh.jax_mesh, P("data"))
    oracle = jax.make_array_from_process_local_data(sharding, block.astype(g.jax().dtype))
    return {
        "type": type(g).__name__,
        "dtype": str(g.dtype),
        "shape": tuple(g.shape),
        "problems": _same_shards(g.jax(), oracle),
        "whole": _allgather(g.jax()).tolist(),
    }


def agreement() -> dict[str, str]:
    """Processes that pass different shapes, and that are in different calls."""
    ts = _ts()
    rank, _ = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")
    out = {}
    with mesh:
        rows = 4 if rank == 0 else 2
        out["shapes"] = _error(
            lambda: ts.host_to_global_array({"x": np.zeros((rows, 3), np.float32)})
        )
        made = ts.host_to_global_array(np.zeros((4, 3), np.float32))
        if rank == 0:  # the others read back instead: another call
            out["calls"] = _error(lambda: ts.host_to_global_array(np.zeros((4, 3), np.float32)))
        else:
            out["calls"] = _error(lambda: ts.replicate_to_local_data(made))
        # after the errors the processes are in step again: a call works everywhere
        ok = ts.host_to_global_array(np.full((4, 3), rank, np.float32))
        out["after"] = str(ts.replicate_to_local_data(ok)[::4, 0].tolist())
    return out


def skipped_call(timeout: float) -> dict[str, Any]:
    """The last process skips a host_to_global_array: the others fail within ``timeout``
    naming it; then every process meets again."""
    ts = _ts()
    rank, world = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")
    with mesh, _timeout(timeout):
        start = time.monotonic()
        if rank == world - 1:
            text = "skipped"
        else:
            text = _error(lambda: ts.host_to_global_array(np.zeros((4, 3), np.float32)))
        took = time.monotonic() - start
    return {"text": text, "took": took}


def value_check() -> dict[str, str]:
    """A replicated leaf whose processes pass different values, with the value check on."""
    ts = _ts()
    rank, _ = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")
    old = ts.set_value_check(True)
    try:
        with mesh:
            same = _error(
                lambda: ts.host_to_global_array({"w": np.ones(3, np.float32)}, partition=ts.P())
            )
            differ = _error(
                lambda: ts.host_to_global_array(
                    {"w": np.full(3, 1.0 + (rank == 1), np.float32)}, partition=ts.P()
                )
            )
    finally:
        ts.set_value_check(old)
    return {"same": same, "differ": differ}


def wide_values() -> dict[str, str]:
    """64-bit values while jax_enable_x64 is off: int64 that fits is placed as int32; a value
    that does not fit, and float64, are refused on every process (each with its leaf)."""
    ts = _ts()
    rank, _ = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")
    with mesh:
        ok = ts.host_to_global_array({"ids": np.arange(4, dtype=np.int64) + 4 * rank})["ids"]
        big = np.arange(4, dtype=np.int64) + (2**40 if rank == 1 else 0)
        return {
            "ok": f"{ok.dtype} {ts.replicate_to_local_data(ok).tolist()}",
            "big": _error(lambda: ts.host_to_global_array({"ids": big})),
            "float64": _error(lambda: ts.host_to_global_array({"f": np.zeros((4, 2))})),
        }


def dispatch() -> dict[str, Any]:
    """InputDispatcher on every process's feed: host -> physical -> global -> logical, eagerly;
    then SpmdInputDispatcher."""
    ts = _ts()
    rank, world = _world()
    mesh = ts.create_device_mesh((-1, 2), ("data", "model"), backend="torchax")
    logical = 6 * world
    with mesh:
        d = ts.InputDispatcher(global_logical_batch_size=logical)
        per = logical // world
        host = {"x": np.arange(per * 2, dtype=np.float32).reshape(per, 2) + 1000 * rank}
        phys = d.logical_to_physical_batch(host)
        g = ts.host_to_global_array(phys, partition=d.partition_spec)
        out = d.physical_to_logical_batch(g)
        spmd = ts.SpmdInputDispatcher(8 * world, partition_spec=ts.P("data"))
        feed = np.arange(spmd.feed_logical_batch_size, dtype=np.int32) + 100 * rank
        gs = ts.host_to_global_array({"i": feed}, partition=spmd.partition_spec)
        return {
            "x": ts.replicate_to_local_data(out["x"]).tolist(),
            "shape": tuple(out["x"].shape),
            "spmd": ts.replicate_to_local_data(spmd.physical_to_logical_batch(gs)["i"]).tolist(),
        }


def model() -> dict[str, Any]:
    """A torchax model (nn.Linear, jitted with torchax's interop) consumes a global batch and
    keeps its sharding; its output equals numpy's on every process."""
    import torchax

    ts, jax = _ts(), _jax()
    rank, world = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    w, b = linear.weight.detach().numpy(), linear.bias.detach().numpy()
    rows = 8 // world
    block = (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 10 * rank) / 7
    env = torchax.default_env()
    with mesh:
        x = ts.host_to_global_array(block, partition=ts.P("data"))
        with env:
            linear.to("jax")
            step = torchax.compile(linear)
            y = step(x)
            y = ts.with_sharding_constraint(y, ts.P("data", None))
    got = _allgather(y.jax())
    G = np.concatenate(
        [
            (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 10 * r) / 7
            for r in range(world)
        ]
    )
    return {
        "type": type(y).__name__,
        "spec": str(y.jax().sharding.spec),
        "close": bool(np.allclose(got, G @ w.T + b, atol=1e-5)),
        "jax_type": type(jax.numpy.zeros(1)).__name__,
    }


# -- the loader --------------------------------------------------------------------------------


class Rows(Dataset):
    """Process ``rank``'s examples: ``n`` rows, example ``i`` is ``{"id": id, "x": [id, -id]}``
    with ``id = 1000 * rank + i`` (ids fit in int32)."""

    def __init__(self, rank: int, n: int, bad_at: int | None = None) -> None:
        self.rank, self.n, self.bad_at = rank, n, bad_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        v = 1000 * self.rank + i
        width = 3 if self.bad_at is not None and i >= self.bad_at else 2
        return {"id": np.int64(v), "x": np.array([v, -v, v][:width], np.float32)}


def expected_rows(rank: int, n: int) -> list[int]:
    return [1000 * rank + i for i in range(n)]


def loader(
    lengths: list[int], batch: int, policy: str, *, prefetch: int = 2, guard: bool = True
) -> dict[str, Any]:
    """One epoch of a GlobalBatchLoader fed by this process's DataLoader (``lengths[rank]``
    rows), under ``jax.thread_guard``: per step the whole ids (and mask), and whether each
    global batch equals JAX's own placement of this process's block, shard for shard."""
    ts, jax = _ts(), _jax()
    rank, _ = _world()
    P = jax.sharding.PartitionSpec
    mesh = ts.create_device_mesh((-1, 2), ("data", "model"), backend="torchax")
    source = DataLoader(Rows(rank, lengths[rank]), batch_size=batch)
    steps, problems = [], []
    mine = iter(DataLoader(Rows(rank, lengths[rank]), batch_size=batch))  # the oracle's blocks
    guard_ctx = jax.thread_guard(True) if guard else contextlib.nullcontext()
    with mesh, guard_ctx:
        it = ts.GlobalBatchLoader(source, prefetch=prefetch, last_batch=policy)
        for step in it:
            b, mask = step if policy == "pad" else (step, None)
            whole = ts.replicate_to_local_data(b)
            row = {"id": whole["id"].tolist(), "type": type(b["x"]).__name__}
            if mask is not None:
                row["mask"] = ts.replicate_to_local_data(mask).tolist()
            steps.append(row)
            block = next(mine, None)
            # every process's block full (the same answer everywhere: the JAX computations
            # below are collectives, which every process must run alike)
            if all(row.get("mask", [True])):
                for name in ("id", "x"):
                    local = block[name].numpy().astype(b[name].jax().dtype)
                    sharding = jax.sharding.NamedSharding(mesh.jax_mesh, P(("data", "model")))
                    oracle = jax.make_array_from_process_local_data(sharding, local)
                    problems += [
                        f"step {len(steps)} {name}: {p}"
                        for p in _same_shards(b[name].jax(), oracle)
                    ]
                    if not np.array_equal(_allgather(b[name].jax()), _allgather(oracle)):
                        problems.append(f"step {len(steps)} {name}: process_allgather differs")
    return {
        "steps": steps,
        "problems": problems,
        "dropped": it.stats.dropped_examples,
        "wait": it.stats.input_wait_fraction >= 0,
    }


def resume(n: int, batch: int, take: int) -> dict[str, Any]:
    """Takes ``take`` batches, saves the loader's state, and a new loader on a new source
    resumes from it: the ids of the taken batches, then of the rest."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ts = _ts()
    rank, _ = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")

    def make() -> Any:
        source = StatefulDataLoader(Rows(rank, n), batch_size=batch)
        return ts.GlobalBatchLoader(source, prefetch=2, last_batch="drop")

    with mesh:
        first = make()
        it = iter(first)
        taken = [ts.replicate_to_local_data(next(it)["id"]).tolist() for _ in range(take)]
        state = first.state_dict()
        first.close()
        second = make()
        second.load_state_dict(state)
        rest = [ts.replicate_to_local_data(b["id"]).tolist() for b in second]
    return {"taken": taken, "rest": rest}


def bad_batch(bad_at: int) -> dict[str, Any]:
    """Process 1's DataLoader gives rows of another width from row ``bad_at`` on: every process
    raises at that batch; the batches before it arrive."""
    ts = _ts()
    rank, world = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")
    source = DataLoader(Rows(rank, 16, bad_at if rank == 1 else None), batch_size=8 // world)
    got = []
    with mesh:
        try:
            for b in ts.GlobalBatchLoader(source, prefetch=2):
                got.append(ts.replicate_to_local_data(b["id"]).tolist())
        except Exception as e:  # noqa: BLE001 -- the message is the result
            return {"got": got, "error": f"{type(e).__name__}: {e}"}
    return {"got": got, "error": "no error"}


def loader_outcomes(kind: str, prefetch: int) -> dict[str, Any]:
    """The DTensor backend's case of the same name (``_dtensor_cases.loader_outcomes``) on JAX
    processes: a ``GlobalBatchLoader`` whose sources differ between the processes (``"short"``:
    process 1's ends one batch early; ``"failure"``: it raises at batch 1; ``"shape0"``: its
    batches have another shape); 4 rows per process, one per device. Afterwards three
    ``host_to_global_array`` calls show that the processes are still in step, and no loader
    thread is left."""
    import threading

    ts = _ts()
    rank, _ = _world()
    mesh = ts.create_device_mesh((-1,), ("data",), backend="torchax")
    n = 2 if (kind == "short" and rank == 1) else 3 if kind == "short" else 8

    def source() -> Any:
        for i in range(n):
            if kind == "failure" and rank == 1 and i == 1:
                raise ValueError(f"bad batch {i} on rank {rank}")
            cols = 3 if (kind == "shape0" and rank == 1) else 4
            yield {"x": torch.full((4, cols), float(10 * rank + i))}

    got: list[Any] = []
    error = "no error"
    with mesh:
        loader = ts.GlobalBatchLoader(source(), prefetch=prefetch)
        try:
            for g in loader:
                got.append(ts.replicate_to_local_data(g["x"])[::2, 0].tolist())
        except Exception as e:  # noqa: BLE001 -- the message is the result
            error = f"{type(e).__name__}: {e}" + "".join(
                f" {note}" for note in getattr(e, "__notes__", [])
            )
        loader.close()
        deadline = time.monotonic() + 10.0
        while True:
            stuck = sorted(
                t.name for t in threading.enumerate() if t.name.startswith("torchshard-loader")
            )
            if not stuck or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        after = [
            tuple(ts.host_to_global_array(torch.full((4, 2), float(k))).shape) for k in range(3)
        ]
    return {"got": got, "error": error, "after": after, "stuck": stuck}
