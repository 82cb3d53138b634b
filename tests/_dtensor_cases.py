"""Cases that run on every rank of a real multi-process run (see ``_multiproc.py``).

Pure torch: this module is imported by the gloo workers (fresh interpreters, no torch_xla) and,
for its input generators and layout oracle, by the test process. Each case is called on every
rank at once and returns plain, picklable values (CPU tensors, strings, numbers); the test
process asserts on them.
"""

from __future__ import annotations

import sys
from typing import Any

import helpers
import numpy as np
import torch

DTYPES = {str(dt).removeprefix("torch."): dt for dt in helpers.DTYPES}


# -- inputs and the layout oracle (also used by the test process) ---------------------------


def placement_names(placements: Any) -> list[str]:
    """Version-independent names of DTensor placements, from what each one is (its type and
    ``is_shard``/``is_replicate``/``is_partial``), never from its text (``str(Partial())`` is
    'P' on torch 2.9 and 'P(sum)' on 2.15): ``"S(d)"``, ``"R"``, ``"P"``, and ``"_S(d,k)"``
    for a ``_StridedShard`` (split factor ``k``)."""
    from torchshard._backend.dtensor._torch_private import is_strided_shard

    out = []
    for p in placements:
        if is_strided_shard(p):  # checked first: up to torch 2.13 it is also a Shard
            out.append(f"_S({p.dim},{p.split_factor})")
        elif p.is_shard():
            out.append(f"S({p.dim})")
        elif p.is_replicate():
            out.append("R")
        elif p.is_partial():
            out.append("P")
        else:
            raise AssertionError(f"unknown placement {p!r}")
    return out


def global_value(shape: tuple[int, ...], dtype: str, seed: int = 0) -> torch.Tensor:
    """A deterministic global array of ``shape`` and ``dtype`` (every bit pattern matters)."""
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    if dt == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dt.is_floating_point:
        return torch.randn(shape, generator=gen).to(dt)
    info = torch.iinfo(dt)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dt)


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one spec entry (``None`` -> ``()``, ``"a"`` -> ``("a",)``)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def block_slices(
    grid: np.ndarray, axis_names: tuple[str, ...], spec: Any, shape: tuple[int, ...], rank: int
) -> tuple[slice, ...]:
    """The slice of the global array that ``rank`` holds: an oracle written from scratch.

    ``spec=None`` means the default (FULL) partition: dim 0 over every axis. The rank's mesh
    coordinates come from its position in ``grid``; a dim split over axes ``(a, b)`` is cut
    into ``|a| * |b|`` equal chunks, chunk ``i_a * |b| + i_b``.
    """
    entries = [tuple(axis_names)] if spec is None else [entry_axes(e) for e in spec]
    coord = dict(zip(axis_names, (int(c[0]) for c in np.nonzero(grid == rank)), strict=True))
    size = dict(zip(axis_names, grid.shape, strict=True))
    out = []
    for d, n in enumerate(shape):
        axes = entries[d] if d < len(entries) else ()
        j, k = 0, 1
        for a in axes:
            j, k = j * size[a] + coord[a], k * size[a]
        out.append(slice(j * (n // k), (j + 1) * (n // k)))
    return tuple(out)


def host_blocks(
    grid: np.ndarray, axis_names: tuple[str, ...], spec: Any, g: torch.Tensor
) -> list[torch.Tensor]:
    """Every rank's block of ``g`` (index = rank), contiguous copies."""
    shape = tuple(g.shape)
    return [g[block_slices(grid, axis_names, spec, shape, r)].clone() for r in range(grid.size)]


# -- cases ----------------------------------------------------------------------------------


def _ts() -> Any:
    import torchshard

    return torchshard


def _mesh(grid: Any, axis_names: tuple[str, ...]) -> Any:
    """A dtensor mesh over ``grid`` (nested lists of ranks) via ``create_device_mesh``."""
    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    return ts.create_device_mesh(arr.shape, axis_names, devices=arr.reshape(-1), backend="dtensor")


def environment() -> dict[str, Any]:
    """What each worker sees: its rank, the topology through torchshard, torch_xla absent."""
    import torch.distributed as dist

    ts = _ts()
    mesh = _mesh(np.arange(dist.get_world_size()), ("data",))
    with mesh:
        index, count = ts.process_index(), ts.process_count()
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "process_index": index,
        "process_count": count,
        "torch_xla_loaded": "torch_xla" in sys.modules,
        "native": type(mesh.native).__name__,
        "device_ids": mesh.device_ids,
    }


def roundtrip(
    grid: Any, axis_names: tuple[str, ...], spec: Any, shape: tuple[int, ...], dtype: str
) -> dict[str, Any]:
    """Each rank passes its block of one global value; everything a rank can observe."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchshard._backend.registry import lookup

    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    rank = dist.get_rank()
    g = global_value(tuple(shape), dtype)
    block = host_blocks(arr, axis_names, spec, g)[rank]
    given = block.clone()
    mesh = _mesh(arr, axis_names)
    with mesh:
        partition = {} if spec is None else {"partition": ts.P(*spec)}
        out = ts.host_to_global_array({"x": given, "y": [given]}, **partition)
        if given.numel():  # the global tensor owns its memory
            given.copy_(torch.zeros_like(given) if dtype != "bool" else ~given)
        x = out["x"]
        (shard,) = lookup(mesh).read.local_shards([x])[0]
        specs = ts.host_to_global_specs({"x": block}, **partition)["x"]
        back = ts.global_to_host_array(out)
        full = ts.replicate_to_local_data(out)
    return {
        "is_dtensor": isinstance(x, DTensor),
        "shape": tuple(x.shape),
        "stride": tuple(x.stride()),
        "dtype": str(x.dtype),
        "placements": placement_names(x.placements),
        "spec_shape": tuple(specs.shape),
        "local": x.to_local().clone(),
        "shard_ranges": shard.ranges,
        "shard_device": shard.device,
        "block": block,
        "back": back["x"],
        "back_y": back["y"][0],
        "full": full["x"],
        "full_y": full["y"][0],
    }


def _catch(fn: Any) -> str:
    """The error of ``fn()``, or of the first use of what it returned (where a deferred
    agreement check raises: torch >= 2.13), without the deferred check's note (which
    tests/backend/dtensor/test_deferred.py asserts)."""
    try:
        helpers.use_every_tensor(fn())
    except Exception as e:  # noqa: BLE001 -- the message is the result
        return helpers.without_deferral_note(f"{type(e).__name__}: {e}")
    return "no error"


def disagreement(kind: str) -> dict[str, Any]:
    """Rank 1 passes a different shape, dtype or structure; then everyone passes the same."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    mesh = _mesh(np.arange(dist.get_world_size()), ("data",))
    x = torch.zeros(4, 3)
    batch: dict[str, Any] = {"x": x, "y": torch.zeros(4, dtype=torch.int64)}
    if rank == 1:
        if kind == "shape":
            batch["y"] = torch.zeros(3, dtype=torch.int64)
        elif kind == "dtype":
            batch["y"] = torch.zeros(4, dtype=torch.int32)
        elif kind == "structure":
            batch["z"] = x
        elif kind == "partition":
            pass
    partition = ts.P(None, "data") if (kind == "partition" and rank == 1) else ts.P("data")
    with mesh:
        error = _catch(lambda: ts.host_to_global_array(batch, partition=partition))
        # The processes are still in step: the next call works everywhere.
        after = ts.host_to_global_array({"x": x}, partition=ts.P("data"))["x"]
        after_full = ts.replicate_to_local_data(after)
    return {"error": error, "after_shape": tuple(after.shape), "after_full": after_full}


def disagreement_unchecked() -> dict[str, Any]:
    """With the check off, equal inputs still work (no collective is issued for it)."""
    import torch.distributed as dist

    ts = _ts()
    mesh = _mesh(np.arange(dist.get_world_size()), ("data",))
    old = ts.set_agreement_check(False)
    try:
        with mesh:
            g = ts.host_to_global_array({"x": torch.ones(2, 2)}, partition=ts.P("data"))
            shape = tuple(g["x"].shape)
    finally:
        ts.set_agreement_check(old)
    return {"old": old, "shape": shape}


def bad_layouts() -> dict[str, str]:
    """Errors that every rank raises alike (validation is deterministic and local)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    ts = _ts()
    world = dist.get_world_size()
    mesh = _mesh(np.arange(world).reshape(2, world // 2), ("data", "model"))
    x = torch.zeros(4, 3)
    out = {}
    with mesh:
        out["reversed_tuple"] = _catch(
            lambda: ts.host_to_global_array({"x": x}, partition=ts.P(("model", "data")))
        )
        out["reversed_tuple_specs"] = _catch(
            lambda: ts.host_to_global_specs({"x": x}, partition=ts.P(("model", "data")))
        )
        out["too_long"] = _catch(
            lambda: ts.host_to_global_array({"x": x}, partition=ts.P("data", None, "model"))
        )
        out["unknown_axis"] = _catch(
            lambda: ts.host_to_global_array({"x": x}, partition=ts.P("nope"))
        )
    out["descending"] = _catch(lambda: _mesh(np.arange(world)[::-1], ("data",)))
    dm = DeviceMesh("cpu", torch.tensor([[3, 1], [2, 0]]), mesh_dim_names=("data", "model"))
    out["descending_device_mesh"] = _catch(lambda: ts.Mesh.from_device_mesh(dm))
    nameless = init_device_mesh("cpu", (world,))
    out["nameless"] = _catch(lambda: ts.Mesh.from_device_mesh(nameless))
    out["not_a_device_mesh"] = _catch(lambda: ts.Mesh.from_device_mesh(np.arange(world)))
    sub = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))["b"]
    out["submesh"] = _catch(lambda: ts.Mesh.from_device_mesh(sub).__enter__())
    return out


def equal_device_meshes() -> list[bool]:
    """Two equal but distinct DeviceMeshes, one after the other, with the same call: each
    result lives on its own DeviceMesh (the plan cache keys the native mesh by identity)."""
    from torch.distributed.device_mesh import init_device_mesh

    ts = _ts()
    out = []
    for _ in range(2):
        dm = init_device_mesh("cpu", (2,), mesh_dim_names=("data",))
        with ts.Mesh.from_device_mesh(dm):
            g = ts.host_to_global_array(torch.ones(2, 3), partition=ts.P("data"))
        out.append(g.device_mesh is dm)
    return out


def from_device_mesh() -> dict[str, Any]:
    """``Mesh.from_device_mesh`` over a user's DeviceMesh: ids, names, and a round trip."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ts = _ts()
    world = dist.get_world_size()
    dm = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("data", "model"))
    mesh = ts.Mesh.from_device_mesh(dm)
    x = torch.arange(6.0).reshape(2, 3) + 10 * dist.get_rank()
    with mesh:
        g = ts.host_to_global_array(x, partition=ts.P(("data", "model")))
        back = ts.global_to_host_array(g)
    return {
        "devices": mesh.devices.tolist(),
        "axis_names": mesh.axis_names,
        "backend": mesh.backend,
        "native_is_dm": mesh.native is dm,
        "same_device_mesh": g.device_mesh is dm,
        "shape": tuple(g.shape),
        "back_equal": bool(torch.equal(back, x)),
    }


def annotate() -> dict[str, Any]:
    """``Backend.annotate`` redistributes (a new DTensor); what with_sharding_constraint uses."""
    import torch.distributed as dist

    from torchshard._backend.registry import lookup
    from torchshard._core.sharding import dim_axes

    ts = _ts()
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = _mesh(np.arange(world), ("data",))
    backend = lookup(mesh)
    g = global_value((2 * world, 2 * world), "float32")
    out: dict[str, Any] = {}
    with mesh:
        rep = ts.host_to_global_array(g, partition=ts.P())
        sharded = backend.step.annotate(rep, mesh, dim_axes(mesh, ts.P("data"), 2))
        out["to_shard"] = (placement_names(sharded.placements), sharded.to_local().clone())
        out["same_object_if_unchanged"] = (
            backend.step.annotate(sharded, mesh, dim_axes(mesh, ts.P("data"), 2)) is sharded
        )
        back = backend.step.annotate(sharded, mesh, dim_axes(mesh, ts.P(), 2))
        out["to_replicate"] = (placement_names(back.placements), back.to_local().clone())
        cols = backend.step.annotate(sharded, mesh, dim_axes(mesh, ts.P(None, "data"), 2))
        out["to_dim1"] = (placement_names(cols.placements), ts.replicate_to_local_data(cols))
        i16 = ts.host_to_global_array(g[2 * rank : 2 * rank + 2].to(torch.int16))
        moved = backend.step.annotate(i16, mesh, dim_axes(mesh, ts.P(), 2))
        out["int16"] = (
            placement_names(moved.placements),
            moved.to_local().clone(),
            str(moved.dtype),
        )
        out["plain_tensor"] = _catch(
            lambda: backend.step.annotate(torch.zeros(2, 3), mesh, dim_axes(mesh, ts.P("data"), 2))
        )
    return out


def partial_readback() -> dict[str, Any]:
    """Step outputs with Partial placements read back reduced (a collective)."""
    import torch.distributed as dist

    ts = _ts()
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = _mesh(np.arange(world), ("data",))
    g = global_value((2 * world, 3), "float64")
    with mesh:
        x = ts.host_to_global_array(g[2 * rank : 2 * rank + 2].clone())
        total = x.sum(0)  # sum over the sharded dim: Partial(sum)
        return {
            "placements": placement_names(total.placements),
            "back": ts.global_to_host_array(total),
            "full": ts.replicate_to_local_data(total),
            "expected": g.sum(0),
        }


def uneven_readback() -> dict[str, Any]:
    """One row split over every rank (rank 0 holds it, the others nothing), read back with
    ``replicate_to_local_data`` on every rank: rank 0's block is the whole value, yet it gathers
    with the others (it used to return its block, and the others waited for it)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ts = _ts()
    world = dist.get_world_size()
    mesh = _mesh(np.arange(world), ("data",))
    g = global_value((1, 3), "float32")
    with mesh:
        x = DTensor.from_local(g, mesh.native, [Replicate()]).redistribute(mesh.native, [Shard(0)])
        return {
            "held": x.to_local().shape[0],
            "full": ts.replicate_to_local_data({"x": x})["x"],
            "expected": g,
        }


def conj_views() -> dict[str, Any]:
    """``x.conj()`` of a complex DTensor (a lazy conjugate view, on every rank's block): read
    back, gathered, resharded, and passed again to ``host_to_global_array`` with the value
    check on (its checksum viewed the view's bytes as uint8: a RuntimeError from torch)."""
    import torch.distributed as dist

    ts = _ts()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = _mesh(np.arange(world), ("data",))
    g = torch.complex(
        global_value((2 * world, 3), "float32"), global_value((2 * world, 3), "float32", 1)
    )
    old = ts.set_value_check(True)
    try:
        with mesh:
            x = ts.host_to_global_array(
                {"x": g[2 * rank : 2 * rank + 2].clone()}, partition=ts.P("data")
            )
            c = x["x"].conj()
            again = ts.host_to_global_array({"x": c}, partition=ts.P("data"))
            return {
                "is_conj": (c.is_conj(), c.to_local().is_conj()),
                "back": ts.global_to_host_array(c),
                "full": ts.replicate_to_local_data(c),
                "resharded": ts.replicate_to_local_data(ts.with_sharding_constraint(c, ts.P())),
                "again": ts.global_to_host_array(again)["x"],
                "expected": g.conj().resolve_conj(),
            }
    finally:
        ts.set_value_check(old)


def dispatch_primitives(index_spec: str, key: str) -> dict[str, Any]:
    """The in-step dispatch of the dispatch issue, as its primitives on DTensors.

    A physical batch (sharded on dim 0) and a dispatch key (an int64 index vector ``[L]`` or a
    one-hot bool matrix ``[P, L]``) come from ``host_to_global_array``; the step selects the
    logical rows (``index_select``; for a one-hot key the ``einsum("p...,pl->l...")``), then
    constrains the result to ``P("data")`` with ``Backend.annotate``.
    """
    import torch.distributed as dist

    from torchshard._backend.registry import lookup
    from torchshard._core.sharding import dim_axes

    ts = _ts()
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = _mesh(np.arange(world), ("data",))
    backend = lookup(mesh)
    phys, logical = 4 * world, 2 * world
    g = global_value((phys, 3), "float32")
    perm = torch.randperm(phys, generator=torch.Generator().manual_seed(7))[:logical]
    rows = slice(rank * phys // world, (rank + 1) * phys // world)
    with mesh:
        batch = {"x": g[rows].clone()}
        if key == "index":
            if index_spec == "replicated":
                idx = ts.host_to_global_array(perm, partition=ts.P())
            else:
                lrows = slice(rank * logical // world, (rank + 1) * logical // world)
                idx = ts.host_to_global_array(perm[lrows].clone(), partition=ts.P("data"))
            x = ts.host_to_global_array(batch, partition=ts.P("data"))["x"]
            picked = torch.index_select(x, 0, idx)
        else:
            onehot = torch.zeros(phys, logical, dtype=torch.bool)
            onehot[perm, torch.arange(logical)] = True
            both = ts.host_to_global_array(
                {"x": g[rows].clone(), "key": onehot[rows].clone()}, partition=ts.P("data")
            )
            picked = torch.einsum("pf,pl->lf", both["x"], both["key"].to(torch.float32))
        placed = backend.step.annotate(picked, mesh, dim_axes(mesh, ts.P("data"), 2))
        return {
            "picked_placements": placement_names(picked.placements),
            "placements": placement_names(placed.placements),
            "shape": tuple(placed.shape),
            "local": placed.to_local().clone(),
            "full": ts.replicate_to_local_data(placed),
            "expected": g[perm],
            "expected_local": g[perm][rank * 2 : rank * 2 + 2],
        }


def train_mlp(steps: int = 3, batch: int = 16) -> dict[str, Any]:
    """Data-parallel training on DTensors: replicated parameters, a batch sharded by
    ``host_to_global_array``; the loss is the same on every rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_module

    ts = _ts()
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = _mesh(np.arange(world), ("data",))
    torch.manual_seed(0)
    model = distribute_module(make_mlp(), mesh.native)  # parameters replicated
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with mesh:
        for step in range(steps):
            x, y = training_batch(step, batch)
            rows = slice(rank * batch // world, (rank + 1) * batch // world)
            g = ts.host_to_global_array({"x": x[rows], "y": y[rows]})
            loss = ((model(g["x"]) - g["y"]) ** 2).mean()  # DTensor has no mse_loss rule
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(ts.replicate_to_local_data(loss)))
        weight = ts.replicate_to_local_data(model[0].weight.detach())
    return {"losses": losses, "weight": weight}


def make_mlp() -> torch.nn.Module:
    """The MLP of ``train_mlp`` (seeded by the caller)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def training_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a training step (every rank can compute it; each passes its rows)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(batch, 4, generator=gen)
    return x, x.sum(1, keepdim=True).tanh()


def reference_training(steps: int = 3, batch: int = 16) -> dict[str, Any]:
    """``train_mlp`` in one process on plain tensors (the oracle)."""
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x, y = training_batch(step, batch)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
    return {"losses": losses, "weight": model[0].weight.detach().clone()}


def loader_thread(calls: int = 20) -> dict[str, Any]:
    """A background thread assembles batches (with the agreement check's collective) while
    the main thread runs a step's collectives: they use different process groups, so neither
    waits for the other's collectives nor receives their data. The thread's calls are on a
    stream of their own (``call_stream``): two threads making calls at the same time on one
    stream would pair with the other processes' in either order."""
    import threading

    import torch.distributed as dist

    ts = _ts()
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = _mesh(np.arange(world), ("data",))
    shapes: list[tuple[int, ...]] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            with mesh, ts.call_stream("loader"):
                for i in range(calls):
                    x = torch.full((2, 3), float(rank + i))
                    shapes.append(tuple(ts.host_to_global_array(x).shape))
        except BaseException as e:  # noqa: BLE001 -- a thread boundary: hand it to the test
            errors.append(e)

    with mesh:
        step = ts.host_to_global_array(torch.full((2, 3), float(rank)))
        thread = threading.Thread(target=load, name="loader", daemon=True)
        thread.start()
        sums = [float(ts.replicate_to_local_data(step).sum()) for _ in range(calls)]
        thread.join(timeout=120)
    return {
        "alive": thread.is_alive(),
        "errors": [repr(e) for e in errors],
        "shapes": shapes,
        "sums": sums,
    }


def loader_outcomes(kind: str, prefetch: int) -> dict[str, Any]:
    """A ``GlobalBatchLoader`` whose sources differ between the ranks.

    ``kind``: ``"uneven_pace"`` (rank 1's source is slow, so the ranks' background threads are
    at different batches when the consumers stop), ``"short"`` (rank 1's source ends one batch
    early), ``"failure"`` (rank 1's source raises at batch 1), ``"shape"`` (rank 1's batch 1
    has another shape), ``"shape0"`` (every batch of rank 1 has another shape). Afterwards
    three ``host_to_global_array`` calls (each with the agreement check's collective) show
    that the processes are still in step."""
    import threading
    import time

    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh(np.arange(world), ("data",))
    n = 2 if (kind == "short" and rank == 1) else 3 if kind == "short" else 8

    def source() -> Any:
        for i in range(n):
            if kind == "uneven_pace" and rank == 1:
                time.sleep(0.2)
            if kind == "failure" and rank == 1 and i == 1:
                raise ValueError(f"bad batch {i} on rank {rank}")
            odd = (kind == "shape" and i == 1) or kind == "shape0"
            cols = 3 if (odd and rank == 1) else 4
            yield {"x": torch.full((2, cols), float(10 * rank + i))}

    got: list[float] = []
    error = "no error"
    with mesh:
        loader = ts.GlobalBatchLoader(source(), prefetch=prefetch)
        try:
            for i, g in enumerate(loader):
                got.append(ts.replicate_to_local_data(g["x"])[:, 0].tolist())
                if kind == "uneven_pace" and i == 2:
                    break
        except Exception as e:  # noqa: BLE001 -- the message is the result
            error = f"{type(e).__name__}: {e}" + "".join(
                f" {note}" for note in getattr(e, "__notes__", [])
            )
        loader.close()
        # An epoch dropped by `break` does not join its thread (it may be blocked in a slow
        # source): within the timeout the thread stops and closes its epoch's channel.
        deadline = time.monotonic() + 10.0
        while True:
            stuck = sorted(
                t.name for t in threading.enumerate() if t.name.startswith("torchshard-loader")
            )
            if not stuck or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        after = [
            tuple(ts.host_to_global_array(torch.full((1, 2), float(k))).shape) for k in range(3)
        ]
    return {"got": got, "error": error, "after": after, "stuck": stuck}


def parity() -> dict[str, Any]:
    """axlearn/JAX parity on a (2, world / 2) mesh: ``global_shape=`` (a rank passes the whole
    width, or the whole array, and slices its shard), an already-global leaf returned as it is
    (or refused when laid out otherwise), read-back outside a mesh, complex values."""
    import torch.distributed as dist

    ts = _ts()
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = np.arange(world).reshape(2, world // 2)
    mesh = _mesh(grid, ("data", "model"))
    g = global_value((4, 2 * world), "float32")
    spec = ts.P("data", "model")
    row = rank // (world // 2)
    with mesh:
        rows = g[2 * row : 2 * row + 2]  # its part of dim 0, the whole of dim 1
        wide = ts.host_to_global_array(rows.clone(), partition=spec, global_shape=(4, 2 * world))
        whole = ts.host_to_global_array(g.clone(), partition=spec, global_shape=tuple(g.shape))
        same = ts.host_to_global_array({"a": wide}, partition=spec)["a"] is wide
        other = _catch(lambda: ts.host_to_global_array(wide, partition=ts.P("model")))
        bad = _catch(
            lambda: ts.host_to_global_array(rows[:1].clone(), partition=spec, global_shape=(4, 8))
        )
        mixed = (4, 2 * world) if rank == 0 else None  # rank 0 gives it, the others infer
        disagree = _catch(
            lambda: ts.host_to_global_array(rows.clone(), partition=spec, global_shape=mixed)
        )
        c = torch.complex(g, -g)
        cg = ts.host_to_global_array(c[2 * row : 2 * row + 2].clone(), partition=ts.P("data"))
    return {
        "wide_local": wide.to_local().clone(),
        "whole_local": whole.to_local().clone(),
        "expected_local": g[block_slices(grid, ("data", "model"), spec, tuple(g.shape), rank)],
        "same": same,
        "other": other,
        "bad": bad,
        "disagree": disagree,
        "outside_back": ts.global_to_host_array(wide),  # no mesh entered here
        "outside_full": ts.replicate_to_local_data(whole),
        "g": g,
        "complex_back": ts.global_to_host_array(cg),
        "complex_full": ts.replicate_to_local_data(cg),
        "c": c,
        "row": row,
    }


def mesh_axes_disagree() -> dict[str, Any]:
    """Rank 1 names its mesh's axes in the other order (the same grid of ranks): the same spec
    would place differently there. Before, the agreement check passed and the ranks got
    DTensors with different placements; now every rank raises the same error."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh

    names = ("model", "data") if rank == 1 else ("data", "model")
    mesh = ts.Mesh.from_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=names))
    with mesh:
        error = _catch(
            lambda: ts.host_to_global_array({"x": torch.zeros(4, 2)}, partition=ts.P("data"))
        )
    same = _mesh(np.arange(4).reshape(2, 2), ("data", "model"))
    with same:
        g = ts.host_to_global_array({"x": torch.ones(4, 2)}, partition=ts.P("data"))["x"]
        placements = placement_names(g.placements)
    return {"error": error, "after": placements}


def reinit_process_group() -> dict[str, Any]:
    """torchshard runs, then the program destroys the default process group and initialises
    a new one: torchshard's session, meshes and checks move to the new group. The new group's
    store is a new one on a new port, which rank 0 binds (port 0: the kernel's pick) and
    broadcasts over the old group: on the same port torch itself reuses the old TCPStore
    server, which outlives destroy_process_group in plain torch too, and its stale keys time
    gloo's connect out in about one run of four, with or without torchshard."""
    import datetime
    import os

    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh(np.arange(world), ("data",))
    with mesh:
        first = ts.host_to_global_array(
            {"x": torch.full((2,), float(rank))}, partition=ts.P("data")
        )
        before = ts.replicate_to_local_data(first)["x"].tolist()
    backend = dist.get_backend()
    timeout = datetime.timedelta(seconds=float(os.environ["TORCHSHARD_TEST_COLLECTIVE_TIMEOUT"]))
    port = [None]
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port[0], world, False, timeout)
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:  # the mesh made before: its DeviceMesh's groups are the destroyed group's
        with mesh:
            ts.host_to_global_array({"x": torch.zeros(2)}, partition=ts.P("data"))
        stale = "no error"
    except ts.errors.NoProcessGroupError as e:
        stale = str(e)
    mesh = _mesh(np.arange(world), ("data",))
    with mesh:
        second = ts.host_to_global_array(
            {"x": torch.full((2,), float(rank) + 10)}, partition=ts.P("data")
        )
        after = ts.replicate_to_local_data(second)["x"].tolist()
    return {"before": before, "after": after, "stale": stale}
