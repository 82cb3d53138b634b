"""In-step cases on real processes: constraints, dispatch and training on DTensors.

Run by the gloo workers of ``_multiproc.py`` (``pool.run("_dtensor_dispatch_cases:name")``);
pure torch, never torch_xla. Each function runs on every rank at once and returns plain,
picklable values; ``tests/backend/dtensor/test_backend_dispatch.py`` asserts on them. The input
builders (``feed_batch``, ``loader_dataset``, ``reference_loader_training``) are also used by the
test process, for the torch_xla and single-process oracles.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _dtensor_cases import _catch, _mesh, global_value, host_blocks, placement_names

KEY = "__physical_to_logical_batch_dispatch"


def _ts() -> Any:
    import torchshard

    return torchshard


class _Records(logging.Handler):
    """Collects the messages of logger ``torchshard`` (debug level) while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Records:
        from torchshard._step import constraint as _constraint

        _constraint._LOGGED.clear()  # "logs once" is per process; a case may run twice
        log = logging.getLogger("torchshard")
        self._level = log.level
        log.setLevel(logging.DEBUG)
        log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("torchshard")
        log.removeHandler(self)
        log.setLevel(self._level)


def _seen(x: Any) -> dict[str, Any]:
    """What a rank can observe of a DTensor: placements, its block, the full value."""
    return {
        "placements": placement_names(x.placements),
        "shape": tuple(x.shape),
        "local": x.to_local().detach().clone(),
        "full": _ts().replicate_to_local_data(x.detach()),
    }


# -- with_sharding_constraint / maybe_shard ----------------------------------------------------


def constraints() -> dict[str, Any]:
    """The constraint functions on DTensors of a 1-D mesh over every rank (and, on 4 ranks, of
    a (2, 2) mesh): redistribution, strict errors, best-effort skips and their log lines."""
    import torch.distributed as dist

    from torchshard._core.spec import UNCONSTRAINED

    ts = _ts()
    world = dist.get_world_size()
    g = global_value((2 * world, 2 * world), "float32")
    out: dict[str, Any] = {}
    with _Records() as records, _mesh(np.arange(world), ("data",)):
        rep = ts.host_to_global_array(g, partition=ts.P())
        rows = ts.with_sharding_constraint(rep, ts.P("data"))
        out["rows"] = _seen(rows)
        tree = ts.with_sharding_constraint(
            {"a": rep, "b": [rep]}, {"a": ts.P(None, "data"), "b": None}
        )
        out["tree_a"] = _seen(tree["a"])
        out["tree_b_untouched"] = tree["b"][0] is rep
        out["same_if_unchanged"] = ts.with_sharding_constraint(rows, ts.P("data")) is rows
        out["strict_plain"] = _catch(
            lambda: ts.with_sharding_constraint({"x": [torch.zeros(2)]}, ts.P("data"))
        )
        out["strict_axis"] = _catch(lambda: ts.with_sharding_constraint({"x": rep}, ts.P("nope")))
        out["strict_unconstrained"] = _catch(
            lambda: ts.with_sharding_constraint(rep, ts.P(UNCONSTRAINED))
        )
        plain = torch.zeros(2, 3)
        out["maybe_plain_same"] = ts.maybe_shard({"p": plain}, ("data",))["p"] is plain
        out["maybe_empty_spec"] = _seen(ts.maybe_shard(rows, ts.P()))
        out["maybe_all_unconstrained_same"] = (
            ts.maybe_shard(rows, (UNCONSTRAINED, UNCONSTRAINED)) is rows
        )
        out["maybe_keep_same"] = ts.maybe_shard(rows, (UNCONSTRAINED, None)) is rows
        out["maybe_keep_moves"] = _seen(ts.maybe_shard(rows, (UNCONSTRAINED, "data")))
        out["maybe_too_long_same"] = ts.maybe_shard(rows, ("data", None, None)) is rows
        out["log_1d"] = list(records.messages)
    if world == 4:
        records.messages.clear()
        with records, _mesh(np.arange(4).reshape(2, 2), ("data", "model")):
            rep = ts.host_to_global_array(g, partition=ts.P())
            out["both"] = _seen(ts.with_sharding_constraint(rep, ts.P(("data", "model"))))
            out["strict_order"] = _catch(
                lambda: ts.with_sharding_constraint({"x": rep}, ts.P(("model", "data")))
            )
            out["maybe_order_same"] = ts.maybe_shard(rep, ts.P(("model", "data"))) is rep
            cols = ts.with_sharding_constraint(rep, ts.P(None, "model"))  # [R, S(1)]
            out["keep_dim1"] = _seen(ts.maybe_shard(cols, ("data", UNCONSTRAINED)))
            out["keep_nothing_to_move_same"] = (
                ts.maybe_shard(cols, (UNCONSTRAINED, "model")) is cols
            )
            out["keep_axis_taken"] = _seen(ts.maybe_shard(cols, (UNCONSTRAINED, "data")))
            swapped = ts.with_sharding_constraint(rep, ts.P("model", "data"))  # [S(1), S(0)]
            out["keep_dim0"] = _seen(ts.maybe_shard(swapped, (UNCONSTRAINED, None)))
        with records, _mesh(np.arange(4), ("data",)):
            on_1d = ts.host_to_global_array(g, partition=ts.P())
        with records, _mesh(np.arange(4).reshape(2, 2), ("data", "model")):
            out["strict_other_mesh"] = _catch(
                lambda: ts.with_sharding_constraint({"x": on_1d}, ts.P("data"))
            )
            out["maybe_other_mesh_same"] = ts.maybe_shard(on_1d, ts.P("data")) is on_1d
            out["log_2d"] = list(records.messages)
    return out


# -- dispatch_input_batch ----------------------------------------------------------------------


def physical_batch(physical: int, logical: int, seed: int = 0) -> dict[str, Any]:
    """A global physical batch, a logical selection of its rows, and both key forms."""
    perm = torch.randperm(physical, generator=torch.Generator().manual_seed(seed + 1))[:logical]
    onehot = torch.zeros(physical, logical, dtype=torch.bool)
    onehot[perm, torch.arange(logical)] = True
    f = global_value((physical, 3), "float32", seed + 5)
    f[perm[0]], f[perm[1]] = -0.0, float("nan")  # must arrive bit for bit
    return {
        "x": global_value((physical, 3), "float32", seed),
        "f": f,
        "y": global_value((physical,), "int16", seed + 2),
        "m": global_value((physical, 2), "bool", seed + 3),
        "s": global_value((physical, 2), "float64", seed + 4),
        "perm": perm,
        "onehot": onehot,
    }


def dispatch_partition(batch_axes: Any, key: str) -> dict[str, Any]:
    """The partition of ``dispatch_batch``'s input: the one-hot key is split like the data,
    gather indices are replicated."""
    ts = _ts()
    batch = ts.P(batch_axes)
    return {
        "x": batch,
        "nested": {"f": batch, "y": batch, "m": batch, KEY: batch if key == "onehot" else ts.P()},
        "s": batch,
    }


def dispatch_batch(
    grid: Any, axis_names: tuple[str, ...], batch_axes: Any, key: str, inside: bool = True
) -> dict[str, Any]:
    """``dispatch_input_batch`` on DTensors: each rank passes its block of
    ``{"x", "nested": {"f", "y", "m", KEY}, "s"}`` (the key nested under one dict; ``x`` and
    ``s`` are outside it and keep their physical rows); the key is the one-hot ``[P, L]``
    matrix (split like the data) or gather indices ``[L]`` (replicated). ``inside=False``
    dispatches outside ``with mesh:``."""
    import torch.distributed as dist

    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    rank = dist.get_rank()
    world = dist.get_world_size()
    data = physical_batch(4 * world, 2 * world)
    spec_entries = [batch_axes]
    key_value = data["onehot"] if key == "onehot" else data["perm"]
    key_entries = spec_entries if key == "onehot" else []

    def block(v: torch.Tensor, entries: list[Any]) -> torch.Tensor:
        return host_blocks(arr, axis_names, entries, v)[rank]

    mine = {
        "x": block(data["x"], spec_entries),
        "nested": {
            "f": block(data["f"], spec_entries),
            "y": block(data["y"], spec_entries),
            "m": block(data["m"], spec_entries),
            KEY: block(key_value, key_entries),
        },
        "s": block(data["s"], spec_entries),
    }
    mesh = _mesh(arr, axis_names)
    with mesh:
        g = ts.host_to_global_array(mine, partition=dispatch_partition(batch_axes, key))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if inside:
            with mesh:
                out = ts.dispatch_input_batch(g, batch_axis_names=batch_axes, check=True)
        else:
            out = ts.dispatch_input_batch(g, batch_axis_names=batch_axes, check=True)
    with mesh:
        return {
            "keys": sorted(out["nested"]),
            "input_keeps_key": KEY in g["nested"],
            "x": _seen(out["x"]),
            "f": _seen(out["nested"]["f"]),
            "y": _seen(out["nested"]["y"]),
            "m": _seen(out["nested"]["m"]),
            "s": _seen(out["s"]),
            "expected_rows": data["perm"],
            "input": mine,
            "data": {k: data[k] for k in ("x", "f", "y", "m", "s")},
        }


# -- InputDispatcher -------------------------------------------------------------------------


def feed_batch(start: int, fl: int) -> dict[str, np.ndarray]:
    """A feed's logical batch: examples ``start .. start + fl - 1`` (features derived from the
    example index, so any mix-up shows)."""
    index = start + np.arange(fl, dtype=np.int64)
    return {
        "example_index": index,
        "x": np.stack([index * 0.5, -index - 0.25], axis=1).astype(np.float32),
        "flag": index % 3 == 0,
    }


def input_dispatcher(
    grid: Any,
    axis_names: tuple[str, ...],
    logical: int,
    physical: int | None,
    feeds: int | None,
    logical_feed_indices: tuple[int, ...] | None,
) -> dict[str, Any]:
    """Rank ``r`` is physical feed ``r``. The dispatcher is made outside any mesh (its
    defaults come from ``process_count()``/``process_index()``, i.e. the DTensor topology);
    the rank builds its feed's logical batch from ``feed_read_config()``, pads it with
    ``logical_to_physical_batch``, assembles it with ``host_to_global_array`` and dispatches it
    in the step with ``physical_to_logical_batch``."""
    import torch.distributed as dist

    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    d = ts.InputDispatcher(
        logical,
        global_physical_batch_size=physical,
        num_physical_feeds=feeds,
        logical_feed_indices=logical_feed_indices,
    )
    read = d.feed_read_config()
    fl = d.feed_logical_batch_size
    mine = d.logical_to_physical_batch(feed_batch(read["shard_index"] * fl, fl))
    shapes = d.logical_to_physical_shapes(
        {
            "example_index": ts.TensorSpec((fl,), np.dtype(np.int64)),
            "x": ts.TensorSpec((fl, 2), np.dtype(np.float32)),
            "flag": ts.TensorSpec((fl,), np.dtype(np.bool_)),
        }
    )
    with _mesh(arr, axis_names):
        g = ts.host_to_global_array(mine, partition=d.partition_spec)
        out = d.physical_to_logical_batch(g, check=True)
        seen = {k: _seen(v) for k, v in out.items()}
        physical_shapes = {k: tuple(v.shape) for k, v in g.items()}
    return {
        "rank": dist.get_rank(),
        "config": {
            "num_physical_feeds": d.num_physical_feeds,
            "physical_feed_index": d.physical_feed_index,
            "logical_feed_index": d.logical_feed_index,
            "feed_logical_batch_size": fl,
            "feed_physical_batch_size": d.feed_physical_batch_size,
            "global_physical_batch_size": d.global_physical_batch_size,
            "read": read,
            "is_identity": d.is_identity,
        },
        "physical": {k: np.asarray(v) for k, v in mine.items()},
        "shapes": {k: (v.shape, str(v.dtype)) for k, v in shapes.items()},
        "physical_shapes": physical_shapes,
        "out": seen,
        "torch_xla_loaded": "torch_xla" in sys.modules,
    }


def defaults_outside_mesh() -> dict[str, Any]:
    """Outside any mesh a DTensor process asks torch.distributed, never torch_xla."""
    ts = _ts()
    d = ts.InputDispatcher(8)
    return {
        "process_index": ts.process_index(),
        "process_count": ts.process_count(),
        "infer": ts.infer_mesh_shape((-1,)),
        "dispatcher": (d.num_physical_feeds, d.physical_feed_index, d.global_physical_batch_size),
        "torch_xla_loaded": "torch_xla" in sys.modules,
    }


def spmd_dispatcher() -> dict[str, Any]:
    """``SpmdInputDispatcher`` on a (2, world / 2) DTensor mesh: feeds from the mesh."""
    import torch.distributed as dist

    ts = _ts()
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    with _mesh(np.arange(world).reshape(2, world // 2), ("data", "model")):
        for name, spec in (("data", ts.P("data")), ("both", ts.P(("data", "model")))):
            d = ts.SpmdInputDispatcher(8, partition_spec=spec)
            read = d.feed_read_config()
            fl = d.feed_logical_batch_size
            batch = d.logical_to_physical_batch(feed_batch(read["shard_index"] * fl, fl))
            g = d.physical_to_logical_batch(
                ts.host_to_global_array(batch, partition=d.partition_spec)
            )
            out[name] = {
                "read": read,
                "fl": fl,
                "example_index": _seen(g["example_index"]),
            }
        out["num_partitions"] = _catch(
            lambda: ts.SpmdInputDispatcher(3, partition_spec=ts.P("data"))
        )
    return out


# -- a training loop fed by a DataLoader -------------------------------------------------------


def loader_dataset(n: int = 96) -> torch.utils.data.Dataset:
    """A regression dataset of ``n`` examples (the same on every process)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=gen)
    return torch.utils.data.TensorDataset(torch.arange(n), x, x.sum(1, keepdim=True).tanh())


def feed_loader(num_shards: int, shard_index: int, batch: int, epoch: int) -> Any:
    """The loader of one feed: a ``DistributedSampler`` over the shard that
    ``feed_read_config()`` names (what ``host_sampler`` will do), batches of the feed's
    logical size."""
    ds = loader_dataset()
    sampler = torch.utils.data.DistributedSampler(
        ds, num_replicas=num_shards, rank=shard_index, shuffle=True, seed=3, drop_last=True
    )
    sampler.set_epoch(epoch)
    return torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler, drop_last=True)


def _as_batch(item: Any) -> dict[str, torch.Tensor]:
    index, x, y = item
    return {"example_index": index, "x": x, "y": y}


def train_with_loader(
    logical: int,
    physical: int,
    logical_feed_indices: tuple[int, ...] | None,
    steps: int,
    make_model: Callable[[], torch.nn.Module] | None = None,
) -> dict[str, Any]:
    """Data-parallel training on DTensors fed by torchshard's loader: per rank a DataLoader
    over ``host_sampler``'s shard, ``GlobalBatchLoader`` padding it with ``InputDispatcher`` and
    assembling the DTensors on its background thread; dispatched in the step; parameters
    replicated."""
    import torch.distributed as dist
    from _dtensor_cases import make_mlp
    from torch.distributed.tensor import distribute_module
    from torch.utils.data import DataLoader, default_collate

    ts = _ts()
    world = dist.get_world_size()
    d = ts.InputDispatcher(
        logical, global_physical_batch_size=physical, logical_feed_indices=logical_feed_indices
    )
    read = d.feed_read_config()
    mesh = _mesh(np.arange(world), ("data",))
    torch.manual_seed(0)
    model = distribute_module((make_model or make_mlp)(), mesh.native)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, seen = [], []
    ds = loader_dataset()
    source = DataLoader(
        ds,
        batch_size=d.feed_logical_batch_size,
        sampler=ts.host_sampler(ds, d, shuffle=True, seed=3, drop_last=True),
        drop_last=True,
        collate_fn=lambda items: _as_batch(default_collate(items)),
    )
    with mesh, ts.GlobalBatchLoader(source, dispatcher=d, prefetch=2) as loader:
        for step, g in enumerate(loader):
            if step == steps:
                break
            batch = d.physical_to_logical_batch(g)
            loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()  # DTensor: no mse_loss rule
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(ts.replicate_to_local_data(loss)))
            seen.append(ts.replicate_to_local_data(batch["example_index"]))
        weight = ts.replicate_to_local_data(model[0].weight.detach())
    return {"losses": losses, "examples": seen, "weight": weight, "read": read}


def reference_loader_training(
    num_logical_feeds: int, feed_logical: int, steps: int
) -> dict[str, Any]:
    """``train_with_loader`` in one process on plain tensors: step ``s`` trains on the
    concatenation, in logical feed order, of every logical feed's ``s``-th batch."""
    from _dtensor_cases import make_mlp

    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loaders = [
        iter(feed_loader(num_logical_feeds, i, feed_logical, 0)) for i in range(num_logical_feeds)
    ]
    losses, seen = [], []
    for _ in range(steps):
        parts = [_as_batch(next(it)) for it in loaders]
        batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
        seen.append(batch["example_index"])
    return {"losses": losses, "examples": seen, "weight": model[0].weight.detach().clone()}


# -- Backend.take_rows on other layouts ------------------------------------------------------


def take_rows_layouts() -> dict[str, Any]:
    """``take_rows`` on a (2, world / 2) mesh for every kind of placement of the rows: dim 0
    split over one or both axes, not split (replicated, or dim 1 split), ``Partial`` (summed
    first); an uneven logical batch; and gradients back to the split input."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from torchshard._backend.registry import lookup

    world = dist.get_world_size()
    mesh = _mesh(np.arange(world).reshape(2, world // 2), ("data", "model"))
    dm = mesh.native
    backend = lookup(mesh)
    g = global_value((4 * world, 4), "float64")
    index = torch.tensor([5, 0, 4 * world - 1, 3, 2 * world, 1, 7])  # 7 rows: uneven
    layouts = {
        "rows_data": [Shard(0), Replicate()],
        "rows_both": [Shard(0), Shard(0)],
        "rows_data_cols_model": [Shard(0), Shard(1)],
        "cols_model": [Replicate(), Shard(1)],
        "replicated": [Replicate(), Replicate()],
    }
    out: dict[str, Any] = {"expected": g[index]}
    for name, placements in layouts.items():
        x = DTensor.from_local(g, dm, [Replicate(), Replicate()]).redistribute(dm, placements)
        y = backend.step.take_rows(x, index)
        out[name] = {"placements": placement_names(y.placements), "full": y.full_tensor()}
    short = g[: world - 1]  # split over every rank, the last holds no row
    x = DTensor.from_local(short, dm, [Replicate(), Replicate()]).redistribute(
        dm, [Shard(0), Shard(0)]
    )
    y = backend.step.take_rows(x, torch.tensor([world - 2, 0, world - 2]))
    out["short"] = {
        "held": x.to_local().shape[0],
        "placements": placement_names(y.placements),
        "full": y.full_tensor(),
        "expected": short[[world - 2, 0, world - 2]],
    }
    partial = DTensor.from_local(g / world, dm, [Partial(), Partial()], run_check=False)
    y = backend.step.take_rows(partial, index)
    out["partial"] = {"placements": placement_names(y.placements), "full": y.full_tensor()}
    leaf = g.clone().requires_grad_()
    x = DTensor.from_local(leaf, dm, [Replicate(), Replicate()]).redistribute(
        dm, [Shard(0), Shard(0)]
    )
    (backend.step.take_rows(x, index) ** 2).sum().full_tensor().backward()
    out["grad"] = leaf.grad.clone()
    return out


# -- dispatch moves bits, plans once ----------------------------------------------------------


def _planner_misses() -> dict[str, int]:
    """Cache misses of what plans a DTensor step: torch's redistribute planner
    (``_gen_transform_infos``, keyed by source and target specs) and sharding propagator, and
    torchshard's placements. Flat over repeated calls: nothing is planned again."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from torchshard._backend.dtensor.backend import placements

    propagator = DTensor._op_dispatcher.sharding_propagator
    return {
        "redistribute": _gen_transform_infos.cache_info().misses,
        "propagation": propagator.propagate_op_sharding.cache_info().misses,
        "placements": placements.cache_info().misses,
    }


def dispatch_bits(logical: int, calls: int = 3) -> dict[str, Any]:
    """Rank ``r`` is physical feed ``r`` of an ``InputDispatcher`` of ``logical`` rows over
    ``4 * world`` physical rows (never the identity); the global logical batch has one leaf per
    float dtype, of values a float sum would change (``bit_patterns.odd_values``), and each rank
    supplies its feed's shard. The step dispatches ``calls`` times; returned: the planners'
    cache misses after each call, each leaf's placements and its whole value's bits (read back
    with ``replicate_to_local_data``)."""
    import torch.distributed as dist
    from bit_patterns import FLOATS, bits, odd_values

    ts = _ts()
    world = dist.get_world_size()
    table = {str(dt): odd_values(dt, 3 * logical).reshape(logical, 3) for dt in FLOATS}
    d = ts.InputDispatcher(logical, global_physical_batch_size=4 * world)
    assert not d.is_identity
    fl = d.feed_logical_batch_size
    start = d.feed_read_config()["shard_index"] * fl
    mine = {k: v[start : start + fl] for k, v in table.items()}
    misses = []
    with _mesh(np.arange(world), ("data",)):
        g = ts.host_to_global_array(d.logical_to_physical_batch(mine), partition=d.partition_spec)
        for _ in range(calls):
            out = d.physical_to_logical_batch(g)
            misses.append(_planner_misses())
        full = ts.replicate_to_local_data(out)
    return {
        "misses": misses,
        "placements": {k: placement_names(v.placements) for k, v in out.items()},
        "bits": {k: bits(v) for k, v in full.items()},
        "dtypes": {k: str(v.dtype) for k, v in full.items()},
    }
