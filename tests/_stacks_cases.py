"""Cases for the stacks people train with, on real gloo processes (``_multiproc.py``): local
views (``to_local``, ``to_submesh``), feeds from the mesh (``feed_read_config``,
``feed_slices``), context parallel against torch's own ``context_parallel``, and FSDP2 / TP /
SP training fed by torchshard against the same training fed by ``DistributedSampler``.

Run by the workers as ``"_stacks_cases:<case>"``; pure torch (no torch_xla). Each case returns
plain, picklable values for the test process to assert on; the oracles are numpy slicing of a
known global value (``_dtensor_cases.block_slices``), DTensor's ``full_tensor()``, torch's own
``context_parallel`` sharding and a ``DistributedSampler`` feed of the same model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from _dtensor_cases import _catch, _mesh, block_slices, global_value, placement_names


def _ts() -> Any:
    import torchshard

    return torchshard


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# -- local views ----------------------------------------------------------------------------


def views(
    grid: Any, names: tuple[str, ...], spec: list[Any], shape: tuple[int, ...], sub: list[str]
) -> dict[str, Any]:
    """A global value placed with ``spec`` on ``grid``; its local view and its re-homing on
    the sub-mesh of the axes ``sub`` (given as the DeviceMesh slice)."""
    from torch.distributed.tensor import DTensor

    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    g = global_value(tuple(shape), "float32")
    block = g[block_slices(arr, names, spec, tuple(shape), _rank())].clone()
    mesh = _mesh(arr, names)
    with mesh:
        x = ts.host_to_global_array(block, partition=ts.P(*spec))
    tree = {"x": x, "n": 3, "plain": torch.ones(2), "none": None, "arr": np.zeros(2)}
    local = ts.to_local(tree)
    key = tuple(sub) if len(sub) > 1 else sub[0]
    dm_sub = mesh.native[key]
    moved = ts.to_submesh(tree, dm_sub)
    y = moved["x"]
    # The same through a torchshard.Mesh over the sub-mesh, with and without its DeviceMesh.
    via_mesh = ts.to_submesh(x, ts.Mesh.from_device_mesh(dm_sub))
    bare = ts.Mesh(dm_sub.mesh.numpy(), tuple(sub), backend="dtensor")
    via_bare = ts.to_submesh(x, bare)
    return {
        "local_is_plain": type(local["x"]) is torch.Tensor,
        "local": local["x"].clone(),
        "block": block,
        "shares_memory": local["x"].data_ptr() == x.to_local().data_ptr(),
        "others_kept": (local["n"], local["none"]) == (3, None)
        and local["plain"] is tree["plain"]
        and local["arr"] is tree["arr"]
        and moved["plain"] is tree["plain"],
        "sub_is_dtensor": isinstance(y, DTensor),
        "sub_mesh_is_given": y.device_mesh is dm_sub,
        "sub_ranks": y.device_mesh.mesh.tolist(),
        "sub_shape": tuple(y.shape),
        "sub_placements": placement_names(y.placements),
        "sub_local_same": y.to_local().data_ptr() == x.to_local().data_ptr(),
        "sub_full": y.full_tensor().clone(),
        "via_mesh_full": via_mesh.full_tensor().clone(),
        "via_mesh_is_given": via_mesh.device_mesh is dm_sub,
        "via_bare_full": via_bare.full_tensor().clone(),
        "same_mesh_kept": ts.to_submesh(y, dm_sub) is y,
        "g": g,
    }


def views_uneven() -> dict[str, Any]:
    """Uneven splits on (dp=2, tp=2): DTensor's own uneven layout, re-homed on ``tp``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ts = _ts()
    mesh = _mesh([[0, 1], [2, 3]], ("dp", "tp"))
    dm = mesh.native
    g = global_value((5, 7), "float32")
    full = DTensor.from_local(g.clone(), dm, [Replicate(), Replicate()], run_check=False)
    x = full.redistribute(dm, [Shard(0), Shard(1)])  # rows 3 | 2, columns 4 | 3
    y = ts.to_submesh(x, dm["tp"])
    return {
        "shape": tuple(y.shape),
        "placements": placement_names(y.placements),
        "full": y.full_tensor().clone(),
        "g": g,
        "local": y.to_local().clone(),
        "x_local": x.to_local().clone(),
    }


def views_errors() -> dict[str, str]:
    """Every error of to_local / to_submesh, on (dp=2, tp=2)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from torchshard._backend.dtensor._torch_private import StridedShard

    ts = _ts()
    mesh = _mesh([[0, 1], [2, 3]], ("dp", "tp"))
    dm = mesh.native
    t = torch.ones(2, 3)
    other = _mesh([0, 1, 2, 3], ("data",))  # a mesh of other axes

    def dt(placements: list[Any], shape: tuple[int, ...] = (4, 3), on: Any = dm) -> Any:
        stride = (shape[1], 1)
        return DTensor.from_local(t, on, placements, run_check=False, shape=shape, stride=stride)

    flat = dt([Shard(0)], (8, 3), other.native)
    rank = _rank()
    far_row = [[2, 3], [0, 1]][rank // 2]  # the tp row that does not hold this process
    return {
        "partial_local": _catch(lambda: ts.to_local({"a": [dt([Partial(), Replicate()])]})),
        "partial_dropped": _catch(
            lambda: ts.to_submesh({"a": dt([Partial(), Replicate()])}, dm["tp"])
        ),
        "partial_kept": placement_names(
            ts.to_submesh(dt([Replicate(), Partial()]), dm["tp"]).placements
        ),
        "strided": _catch(
            lambda: ts.to_submesh(
                {"s": dt([StridedShard(0, split_factor=2), Shard(0)], (8, 3))}, dm["tp"]
            )
        ),
        "kept_before_dropped": _catch(
            lambda: ts.to_submesh({"k": dt([Shard(0), Shard(0)], (8, 3))}, dm["dp"])
        ),
        "dropped_before_kept": placement_names(
            ts.to_submesh(dt([Shard(0), Shard(0)], (8, 3)), dm["tp"]).placements
        ),
        "not_contained": _catch(lambda: ts.to_submesh({"f": flat}, dm["tp"])),
        "other_slice": _catch(
            lambda: ts.to_submesh(
                {"x": dt([Shard(0), Replicate()])}, ts.Mesh(far_row, ("tp",), backend="dtensor")
            )
        ),
        "out_of_order": _catch(
            lambda: ts.to_submesh(
                {"x": dt([Shard(0), Replicate()])},
                ts.Mesh(np.array([[0, 2], [1, 3]]), ("tp", "dp"), backend="dtensor"),
            )
        ),
        "not_a_mesh": _catch(lambda: ts.to_submesh({"x": t}, "tp")),
        "xla_mesh": _catch(
            lambda: ts.to_submesh({"x": t}, ts.Mesh(np.arange(2), ("tp",), backend="xla"))
        ),
    }


# -- feeds from the mesh --------------------------------------------------------------------


def feeds(
    grid: Any, names: tuple[str, ...], spec: list[Any], shape: tuple[int, ...]
) -> dict[str, Any]:
    """``feed_read_config`` and ``feed_slices`` on every rank, and a batch fed from them."""
    ts = _ts()
    arr = np.asarray(grid, dtype=np.int64)
    mesh = _mesh(arr, names)
    g = global_value(tuple(shape), "float32")
    partition = ts.P(*spec)
    config = ts.feed_read_config(partition, mesh=mesh)
    with mesh:
        current = ts.feed_read_config(partition)
        slices = ts.feed_slices(partition, shape)
        x = ts.host_to_global_array(g[slices], partition=partition)
        full = x.full_tensor()
    return {
        "config": config,
        "current": current,
        "old_recipe": {"num_shards": ts.process_count(), "shard_index": ts.process_index()},
        "slices": [(s.start, s.stop) for s in slices],
        "local": x.to_local().clone(),
        "full_equal": bool(torch.equal(full, g)),
        "oracle": g[block_slices(arr, names, spec, tuple(shape), _rank())].clone(),
    }


# -- context parallel -----------------------------------------------------------------------


class CountingSequences:
    """A token source of ``n`` sequences of ``seq_len``: ``read(row, positions)`` returns those
    positions of one sequence and counts every position read."""

    def __init__(self, n: int, seq_len: int) -> None:
        self.tokens = 1000 * torch.arange(n)[:, None] + torch.arange(seq_len)
        self.read_positions = 0

    def read(self, row: int, positions: list[int]) -> torch.Tensor:
        self.read_positions += len(positions)
        return self.tokens[row, positions]


def context_parallel_shards(dp: int, cp: int, batch: int, seq_len: int) -> dict[str, Any]:
    """A (dp, cp) mesh: each host reads its dp shard's rows and only its cp part of each
    sequence (torchshard's recipe); torch's ``context_parallel`` shards the whole rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    ts = _ts()
    dm = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    mesh = ts.Mesh.from_device_mesh(dm)
    partition = ts.P("dp", "cp")
    source = CountingSequences(batch, seq_len)
    config = ts.feed_read_config(partition, mesh=mesh)
    rows = list(range(batch))[config["shard_index"] :: config["num_shards"]]
    positions = ts.context_parallel_positions(partition, seq_len, mesh=mesh)
    tokens_read = torch.stack([source.read(r, positions) for r in rows])
    host = {
        "tokens": tokens_read,
        "labels": tokens_read + 1,
        "positions": torch.tensor(positions).expand(len(rows), -1).contiguous(),
    }
    with mesh:
        batch_g = ts.host_to_global_array(host, partition=partition)
        local = ts.to_local(batch_g)
        whole = ts.replicate_to_local_data(batch_g)
        back = ts.global_to_host_array(batch_g)
    # torch's own: every cp rank holds the dp shard's whole rows, context_parallel shards them.
    tokens = source.tokens[rows].clone()
    labels = tokens + 1
    pos = torch.arange(seq_len).expand(len(rows), -1).contiguous()
    with context_parallel(dm["cp"], buffers=[tokens, labels, pos], buffer_seq_dims=[1, 1, 1]):
        torch_shards = {
            "tokens": tokens.clone(),
            "labels": labels.clone(),
            "positions": pos.clone(),
        }
    restore = ts.head_tail_order(seq_len, cp, inverse=True)
    original_rows = [
        r for s in range(config["num_shards"]) for r in range(batch)[s :: config["num_shards"]]
    ]
    return {
        "local": {k: v.clone() for k, v in local.items()},
        "torch": torch_shards,
        "read_positions": source.read_positions,
        "positions": positions,
        "restored_equal": bool(
            torch.equal(whole["tokens"][:, restore], source.tokens[original_rows])
        ),
        "back_equal": bool(torch.equal(back["tokens"], source.tokens[rows][:, positions])),
    }


# -- training through the stacks ------------------------------------------------------------


class Examples(torch.utils.data.Dataset):
    """``n`` examples ``{"x": [*shape], "y": [*target]}`` (deterministic)."""

    def __init__(self, n: int, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, *shape, generator=gen)
        self.y = torch.randn(n, *target, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def _losses_and_params(model: torch.nn.Module, losses: list[torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return {"losses": torch.stack(losses), "params": params}


def _ordered(layers: dict[str, torch.nn.Module]) -> torch.nn.Module:
    from collections import OrderedDict

    return torch.nn.Sequential(OrderedDict(layers))


def fsdp2_training(feed: str, steps: int = 3, per_rank: int = 2, epochs: int = 1) -> dict[str, Any]:
    """An MLP under FSDP2 (``fully_shard`` on a 1-D dp mesh), fed by a ``DistributedSampler``
    (``feed="sampler"``, ``sampler.set_epoch(e)`` each epoch) or by torchshard
    (``feed="torchshard"``: ``host_sampler(data, P("dp"))`` -> ``GlobalBatchLoader(...,
    local=True)``, ``loader.set_epoch(e)`` each epoch; ``feed="to_local"``: the global
    batches and ``to_local`` in the step). ``orders``: each epoch's first inputs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    ts = _ts()
    world, rank = dist.get_world_size(), dist.get_rank()
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    data = Examples(world * per_rank * steps, (4,), (1,))
    model = _ordered(
        {"up": torch.nn.Linear(4, 8), "act": torch.nn.ReLU(), "down": torch.nn.Linear(8, 1)}
    )
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    fully_shard(model, mesh=dm)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())

    orders = []
    if feed == "sampler":
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
        for e in range(epochs):
            sampler.set_epoch(e)
            for i, b in enumerate(DataLoader(data, batch_size=per_rank, sampler=sampler)):
                if i == 0:
                    orders.append(b["x"].clone())
                step(b["x"], b["y"])
    else:
        mesh = ts.Mesh.from_device_mesh(dm)
        partition = ts.P("dp")
        with mesh:
            sampler = ts.host_sampler(data, partition, shuffle=True, seed=3, drop_last=False)
        source = DataLoader(data, batch_size=per_rank, sampler=sampler)
        local = feed == "torchshard"
        with mesh, ts.GlobalBatchLoader(source, partition=partition, local=local) as loader:
            assert loader.sampler is sampler and loader.dataset is data
            for e in range(epochs):
                loader.set_epoch(e)
                for i, b in enumerate(loader):
                    if not local:
                        b = ts.to_local(b)
                    assert type(b["x"]) is torch.Tensor
                    if i == 0:
                        orders.append(b["x"].clone())
                    step(b["x"], b["y"])
    return {**_losses_and_params(model, losses), "orders": orders}


def tp_training(
    feed: str,
    sequence_parallel: bool = False,
    fsdp: bool = True,
    steps: int = 2,
    per_row: int = 2,
    seq: int = 4,
) -> dict[str, Any]:
    """An MLP under tensor parallelism (``parallelize_module`` on ``mesh["tp"]`` of a (dp, tp)
    mesh; ``fsdp``: and FSDP2 over ``mesh["dp"]``; ``sequence_parallel``: a LayerNorm under
    ``SequenceParallel`` first, its input split along the sequence), fed by a
    ``DistributedSampler`` over the dp rows (each tp rank slicing its part of the sequence by
    hand for SP) or by torchshard (``feed_read_config`` / ``feed_slices`` ->
    ``host_to_global_array`` on the (dp, tp) mesh -> ``to_submesh(batch, mesh["tp"])`` in the
    step; ``feed="process_index"``: the same with the old recipe's shard, one per process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.utils.data import DataLoader, DistributedSampler

    ts = _ts()
    world = dist.get_world_size()
    tp = 2
    dp = world // tp
    dm = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = dm.get_coordinate()
    width = 6
    shape = (seq, width) if sequence_parallel else (width,)
    target = (seq, 1) if sequence_parallel else (1,)
    data = Examples(dp * per_row * steps, shape, target)
    layers: dict[str, torch.nn.Module] = {}
    if sequence_parallel:
        layers["norm"] = torch.nn.LayerNorm(width)
    layers.update(up=torch.nn.Linear(width, 8), act=torch.nn.ReLU(), down=torch.nn.Linear(8, 1))
    model = _ordered(layers)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    if sequence_parallel:
        plan = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, dm["tp"], plan)
    if fsdp:  # FSDP2 over dp on top (2-D: parameters sharded over dp, split over tp)
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=dm["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []

    def step(x: Any, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())

    chunk = seq // tp
    if feed == "sampler":
        sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=True, seed=5)
        for b in DataLoader(data, batch_size=per_row, sampler=sampler):
            x, y = b["x"], b["y"]
            if sequence_parallel:  # SequenceParallel takes a plain input as this rank's part
                x = x[:, tp_rank * chunk : (tp_rank + 1) * chunk]
                y = y[:, tp_rank * chunk : (tp_rank + 1) * chunk]
            step(x, y)
    else:
        mesh = ts.Mesh.from_device_mesh(dm)
        partition = ts.P("dp", "tp") if sequence_parallel else ts.P("dp")
        config: Any = partition  # host_sampler reads the feed of P(...) on the current mesh
        if feed == "process_index":  # the README's old recipe: one shard per process
            config = {"num_shards": ts.process_count(), "shard_index": ts.process_index()}
        with mesh:
            sampler = ts.host_sampler(data, config, shuffle=True, seed=5, drop_last=False)
        for b in DataLoader(data, batch_size=per_row, sampler=sampler):
            if sequence_parallel:  # this process's part of every sequence
                cut = ts.feed_slices(partition, (dp * per_row, seq, width), mesh=mesh)[1]
                b = {"x": b["x"][:, cut], "y": b["y"][:, cut]}
            with mesh:
                g = ts.host_to_global_array(b, partition=partition)
            step(ts.to_submesh(g["x"], dm["tp"]), ts.to_local(g["y"]))
    return _losses_and_params(model, losses)


# -- integrations ---------------------------------------------------------------------------


def torchtitan_loader(
    tp: int, batches: int = 4, per_rank: int = 2, path: str | None = None
) -> dict[str, Any]:
    """torchshard.integrations.torchtitan.dataloader over a per-dp-rank StatefulDataLoader of
    ``(input_dict, labels)`` batches, the mesh from ``ParallelDims(tp=tp)``; then a fresh
    loader resumed from the state after two batches, and (``path``) one resumed through
    torch.distributed.checkpoint, as torchtitan's checkpointer saves it (one value per key:
    a dp rank's tp peers share its entry)."""
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.dataloader import BaseDataLoader

    from torchshard.integrations.torchtitan import dataloader

    world = dist.get_world_size()
    try:  # torchtitan 0.3.0's ParallelDims needs spmd_types (==0.2.3): else its fields
        from torchtitan.distributed.parallel_dims import ParallelDims

        dims: Any = ParallelDims(
            dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=1, world_size=world
        )
    except ImportError:
        import types

        dims = types.SimpleNamespace(
            dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, world_size=world
        )
    dp = world // tp
    n = dp * per_rank * batches
    tokens = torch.arange(n * 4).reshape(n, 4)

    class Pairs(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> Any:
            return {"input": tokens[i]}, tokens[i] + 1

    def source(dp_rank: int) -> Any:
        sampler = torch.utils.data.DistributedSampler(
            Pairs(), num_replicas=dp, rank=dp_rank, shuffle=True, seed=1
        )
        return StatefulDataLoader(Pairs(), batch_size=per_rank, sampler=sampler)

    first = None
    dp_rank = dist.get_rank() // tp  # torchtitan's layout: tp innermost
    loader = dataloader(source(dp_rank), parallel_dims=dims)
    own = [b for b in source(dp_rank)]  # the stock per-rank feed
    got, state = [], None
    for i, b in enumerate(loader):
        got.append(b)
        if i == 1:
            state = loader.state_dict()
        if first is None:
            first = b
    resumed = dataloader(source(dp_rank), parallel_dims=dims)
    resumed.load_state_dict(state)
    rest = list(resumed)
    through_dcp = None
    if path is not None:
        import torch.distributed.checkpoint as dcp

        saving = dataloader(source(dp_rank), parallel_dims=dims)
        it = iter(saving)
        next(it), next(it)
        dcp.save({"dataloader": saving}, checkpoint_id=path)
        saving.loader.close()
        loaded = dataloader(source(dp_rank), parallel_dims=dims)
        dcp.load({"dataloader": loaded}, checkpoint_id=path)
        through_dcp = [b[0]["input"].tolist() for b in loaded] == [
            o[0]["input"].tolist() for o in own[2:]
        ]
    # A state without this rank's key, saved on the same dp degree: torchtitan's own loader
    # logs a warning naming the key and starts afresh; so does this one.
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("torchshard.integrations.torchtitan")
    log.addHandler(handler)
    fresh = dataloader(source(dp_rank), parallel_dims=dims)
    try:
        fresh.load_state_dict({f"dp_rank_{dp + 5}": b"", "world_size": dp})
    finally:
        log.removeHandler(handler)
    afresh = next(iter(fresh))
    fresh.loader.close()
    return {
        "attributes": (loader.batch_size, loader.num_workers),
        "warned": [(r.levelname, r.getMessage()) for r in records],
        "afresh": torch.equal(afresh[0]["input"], own[0][0]["input"]),
        "is_base": isinstance(loader, BaseDataLoader),
        "dp": (loader.dp_rank, loader.dp_world_size),
        "expected_dp": (dp_rank, dp),
        "plain": all(type(t) is torch.Tensor for b in got for t in (b[0]["input"], b[1])),
        "equal_own": all(
            torch.equal(a[0]["input"], o[0]["input"]) and torch.equal(a[1], o[1])
            for a, o in zip(got, own, strict=True)
        ),
        "state_keys": sorted(state),
        "resumed_equal": len(rest) == batches - 2
        and all(
            torch.equal(a[0]["input"], o[0]["input"]) for a, o in zip(rest, own[2:], strict=True)
        ),
        "through_dcp": through_dcp,
        "mesh": dict(loader.loader._mesh.shape) if loader.loader._mesh is not None else None,
        "parallel_dims": type(dims).__name__,
    }
