"""JAX's own answers, from real multi-process CPU runs: the oracle of tests/cross/test_jax.py.

``python tests/_jax_processes.py`` (with an interpreter that has ``jax``; no torch, no
torchshard) starts 2 and then 4 JAX processes on this machine, joined by
``jax.distributed.initialize`` on 127.0.0.1 with gloo CPU collectives, 8 CPU devices in all
(``XLA_FLAGS=--xla_force_host_platform_device_count=8/n`` each), runs the cases below in every
process and prints one JSON document: per run, per case, per process, what JAX answered (an
array's global shape and each addressable shard's device, index ranges and whether its data is
the expected slice of the global array; or the exception JAX raised). ``--out FILE`` writes it
to a file; tests/cross/jax/multiprocess.json is such a recording.

Device numbers are torchshard's: device ``d`` is the ``d``-th of ``jax.devices()`` ordered by
(process index, id), so process ``p`` owns devices ``p*k .. p*k+k-1`` (``k = 8/n``), as under
``torchshard.testing.virtual_hosts(n)``. A mesh's ``device_ids`` are those numbers, row-major.

Every wait is bounded: a process whose case does not finish in ``CASE_SECONDS`` records
``"hang"`` for it and exits; the launcher kills a run after ``RUN_SECONDS``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

DEVICES = 8
CASE_SECONDS = 20.0  # a computation that has not finished by then is recorded as a hang
RUN_SECONDS = 300.0


# -- the cases (run in every process of a run) -------------------------------------------------
# Each takes the process index and returns a JSON-able record; an exception is recorded as
# {"raised": type, "message": first line}.


def _grid(device_ids: list[int], shape: list[int]) -> Any:
    import jax
    import numpy as np

    ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return np.array([ordered[i] for i in device_ids], dtype=object).reshape(shape)


def _number(device: Any) -> int:
    import jax

    ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return ordered.index(device)


def _sharding(mesh_shape: list[int], axis_names: list[str], device_ids: list[int], spec: list[Any]):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(_grid(device_ids, mesh_shape), tuple(axis_names))
    entries = [tuple(e) if isinstance(e, list) else e for e in spec]
    return NamedSharding(mesh, PartitionSpec(*entries))


def _global(shape: list[int]) -> Any:
    import numpy as np

    return np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)


def _own_part(sharding: Any, shape: list[int]) -> Any:
    """This process's own part of the global array, as JAX maps it (per dimension the distinct
    slices its devices hold, in ascending order, concatenated)."""
    import numpy as np

    g = _global(shape)
    index = sharding.addressable_devices_indices_map(tuple(shape))
    block = g
    for dim in range(len(shape)):
        starts = sorted({(s[dim].start or 0, s[dim].stop or shape[dim]) for s in index.values()})
        block = np.concatenate([np.take(block, range(a, b), axis=dim) for a, b in starts], axis=dim)
    return block


def _shards(array: Any, shape: list[int]) -> dict[str, Any]:
    """The array's global shape, and per addressable device its ranges and whether its data is
    the global array's slice there."""
    import numpy as np

    g = _global(shape) if list(array.shape) == list(shape) else None
    out = {}
    for shard in array.addressable_shards:
        ranges = [
            [s.start or 0, array.shape[i] if s.stop is None else s.stop]
            for i, s in enumerate(shard.index)
        ]
        data = np.asarray(shard.data)
        exact = None
        if g is not None:
            want = g[tuple(slice(a, b) for a, b in ranges)]
            exact = bool(data.shape == want.shape and np.array_equal(data, want))
        out[str(_number(shard.device))] = {"ranges": ranges, "exact": exact}
    return {"global_shape": list(array.shape), "shards": out}


def _place(layout: dict[str, Any], process: int, form: str) -> dict[str, Any]:
    """``make_array_from_process_local_data`` with this process's block: its own part
    (``"own"``), the whole array (``"whole"``), or a block of ``layout["wrong"]`` rows on
    process 0 (``"wrong"``); with the global shape given unless ``layout["infer"]``."""
    import jax
    import numpy as np

    shape = layout["global_shape"]
    sharding = _sharding(
        layout["mesh_shape"], layout["axis_names"], layout["device_ids"], layout["spec"]
    )
    forms = layout.get("forms")
    mine = forms[process] if forms else form
    if mine == "whole":
        local = _global(shape)
    elif mine == "wrong" and process == 0:
        local = np.zeros((layout["wrong"], *shape[1:]), np.int32)
    else:
        local = _own_part(sharding, shape)
    given = None if layout.get("infer") else tuple(shape)
    record: dict[str, Any] = {"local_shape": list(local.shape)}
    try:
        array = jax.make_array_from_process_local_data(sharding, local, given)
    except Exception as e:  # noqa: BLE001 -- JAX's answer is the record
        record.update(raised=type(e).__name__, message=str(e).splitlines()[0])
        return record
    record.update(_shards(array, shape))
    return record


def _feeds(layout: dict[str, Any], process: int) -> dict[str, Any]:
    """JAX's feed of this process along each dimension (``get_process_index_and_count``) and
    the distinct slices its devices hold at the universal shape ``(devices,) * ndim``."""
    from jax._src.sharding_impls import get_process_index_and_count

    sharding = _sharding(
        layout["mesh_shape"], layout["axis_names"], layout["device_ids"], layout["spec"]
    )
    ndim = layout["ndim"]
    index = sharding.addressable_devices_indices_map((DEVICES,) * ndim)
    out: dict[str, Any] = {"dims": []}
    for dim in range(ndim):
        held = sorted({(s[dim].start or 0, s[dim].stop or DEVICES) for s in index.values()})
        try:
            feed = list(get_process_index_and_count(sharding, dim, ndim))
        except Exception as e:  # noqa: BLE001
            feed = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        out["dims"].append({"feed": feed, "held": [list(h) for h in held]})
    return out


def _bounded(fn: Any) -> Any:
    """``fn()``, or ``"hang"`` when it has not returned after ``CASE_SECONDS``."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except Exception as e:  # noqa: BLE001
            box.append(("raised", f"{type(e).__name__}: {str(e).splitlines()[0]}"))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(CASE_SECONDS)
    return box[0] if box else ("hang", f"no result after {CASE_SECONDS:.0f} s")


def _disagreeing(layout: dict[str, Any], process: int) -> dict[str, Any]:
    """Processes that pass blocks of different shapes (or dtypes) without a global shape:
    the array each builds, then the first computation on it (a jitted sum)."""
    import jax
    import numpy as np

    sharding = _sharding(
        layout["mesh_shape"], layout["axis_names"], layout["device_ids"], layout["spec"]
    )
    rows = layout["rows"][process]
    dtype = layout.get("dtypes", ["int32"] * 8)[process]
    local = np.arange(rows * 2).reshape(rows, 2).astype(dtype)
    record: dict[str, Any] = {"local_shape": [rows, 2], "dtype": dtype}
    try:
        array = jax.make_array_from_process_local_data(sharding, local)
    except Exception as e:  # noqa: BLE001
        record.update(raised=type(e).__name__, message=str(e).splitlines()[0])
        return record
    record["global_shape"] = list(array.shape)
    outcome, value = _bounded(lambda: float(jax.jit(lambda x: x.sum())(array)))
    record["sum"] = {"outcome": outcome, "value": value}
    return record


def _specs(process: int) -> dict[str, Any]:
    from jax.sharding import PartitionSpec as P

    return {
        "P(('x',)) == P('x')": P(("x",)) == P("x"),
        "hash(P(('x',))) == hash(P('x'))": hash(P(("x",))) == hash(P("x")),
        "P(['x']) == P('x')": P(["x"]) == P("x"),
        "P((), 'x') == P(None, 'x')": P((), "x") == P(None, "x"),
        "P(('x', 'y')) == P('x', 'y')": P(("x", "y")) == P("x", "y"),
        "P('x') == ('x',)": P("x") == ("x",),
        "repr(P(('x',)))": repr(P(("x",))),
    }


# The layouts. 4 processes x 2 devices: a (4, 2) mesh ("data", "model") whose rows are held by
# processes 0; 1 and 2; 1 and 2; 3 (device ids 0 1 | 2 4 | 3 5 | 6 7): along dim 0, processes
# 0..3 own 1, 2, 2, 1 of its 4 blocks.
UNEQUAL = {
    "mesh_shape": [4, 2],
    "axis_names": ["data", "model"],
    "device_ids": [0, 1, 2, 4, 3, 5, 6, 7],
}
# 2 processes x 4 devices: the plain (8,) mesh.
LINE = {"mesh_shape": [8], "axis_names": ["x"], "device_ids": list(range(8))}
# 2 processes x 4 devices, a (2, 4) mesh ("dp", "tp") whose rows are split between the
# processes (device ids 0 1 4 5 | 2 3 6 7): each process holds half of each row.
SPLIT_ROWS = {
    "mesh_shape": [2, 4],
    "axis_names": ["dp", "tp"],
    "device_ids": [0, 1, 4, 5, 2, 3, 6, 7],
}


def _cases(n: int) -> dict[str, Any]:
    if n == 4:
        rows = {**UNEQUAL, "spec": ["data"], "global_shape": [8, 3]}
        grid = {**UNEQUAL, "spec": ["data", "model"], "global_shape": [8, 4]}
        return {
            "unequal_rows_own": lambda p: _place(rows, p, "own"),
            "unequal_rows_inferred": lambda p: _place({**rows, "infer": True}, p, "own"),
            "unequal_rows_whole": lambda p: _place(rows, p, "whole"),
            "unequal_rows_wrong": lambda p: _place({**rows, "wrong": 4}, p, "wrong"),
            "unequal_grid_own": lambda p: _place(grid, p, "own"),
            "feeds_unequal": lambda p: _feeds({**UNEQUAL, "spec": ["data"], "ndim": 2}, p),
            "feeds_line": lambda p: _feeds({**LINE, "spec": ["x"], "ndim": 1}, p),
            "feeds_reversed": lambda p: _feeds(
                {**LINE, "device_ids": list(range(7, -1, -1)), "spec": ["x"], "ndim": 1}, p
            ),
        }
    mixed = {**LINE, "spec": ["x"], "global_shape": [8, 4], "forms": ["own", "whole"]}
    return {
        "mixed_forms": lambda p: _place(mixed, p, ""),
        "mixed_forms_grid": lambda p: _place(
            {**SPLIT_ROWS, "spec": ["dp", "tp"], "global_shape": [4, 8], "forms": ["whole", "own"]},
            p,
            "",
        ),
        "different_shapes_inferred": lambda p: _disagreeing(
            {**LINE, "spec": ["x"], "rows": [4, 8]}, p
        ),
        "different_dtypes_inferred": lambda p: _disagreeing(
            {**LINE, "spec": ["x"], "rows": [4, 4], "dtypes": ["float32", "int32"]}, p
        ),
        "feeds_line": lambda p: _feeds({**LINE, "spec": ["x"], "ndim": 1}, p),
        "feeds_split_rows": lambda p: _feeds({**SPLIT_ROWS, "spec": ["dp", "tp"], "ndim": 2}, p),
        "specs": _specs,
    }


def worker(n: int, process: int, port: int) -> None:
    """One process of a run: joins the others, runs every case, prints its records (JSON)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=process,
        initialization_timeout=120,
    )
    assert jax.process_count() == n and jax.device_count() == DEVICES
    records: dict[str, Any] = {"jax": jax.__version__}
    for name, case in _cases(n).items():
        outcome, value = _bounded(lambda case=case: case(process))
        records[name] = value if outcome == "ok" else {outcome: value}
        if outcome == "hang":  # a collective may be stuck: the rest of the run is unreliable
            break
    sys.stdout.write(json.dumps(records) + "\n")
    sys.stdout.flush()
    os._exit(0)  # a stuck collective must not hold the process (nor jax's shutdown barrier)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(n: int) -> list[dict[str, Any]]:
    """Runs the cases of ``n`` processes; one record per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "TPU_"))}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES // n}"
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(n), str(p), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(n)
    ]
    deadline = time.monotonic() + RUN_SECONDS
    out = []
    try:
        for p, proc in enumerate(procs):
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"JAX process {p} of {n} ran past {RUN_SECONDS:.0f} s") from None
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(
                    f"JAX process {p} of {n} exited with {proc.returncode}:\n{stderr[-4000:]}"
                )
            out.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def main(argv: list[str]) -> None:
    if argv and argv[0] == "worker":
        worker(int(argv[1]), int(argv[2]), int(argv[3]))
        return
    result = {
        "format": "torchshard-jax-oracle/multiprocess/v1",
        "devices": DEVICES,
        "runs": {str(n): run(n) for n in (2, 4)},
    }
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    if len(argv) >= 2 and argv[0] == "--out":
        with open(argv[1], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
