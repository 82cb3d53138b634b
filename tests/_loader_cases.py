"""GlobalBatchLoader cases on real gloo processes (run by ``_multiproc``'s workers as
``"_loader_cases:<name>"``; pure torch, no torch_xla): the end of data (``last_batch``) over
uneven map-style and stream sources, resuming on another number of processes (by the union of
the processes' states and through torch.distributed.checkpoint), and streams split by worker.

The sources' examples are pure functions of (rank, world) here (``shard_ids``), so the test
process builds the numpy oracle from the same rules. Each case returns plain values.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from _dtensor_cases import placement_names
from torch.utils.data import DataLoader, Dataset, IterableDataset


def _ts() -> Any:
    import torchshard

    return torchshard


def _mesh(world: int) -> Any:
    return _ts().create_device_mesh((world,), ("data",), backend="dtensor")


class Rows(Dataset):
    """Example ``i`` is ``{"id": i, "x": [i, i] float32}``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": np.int64(i), "x": np.full(2, i, np.float32)}


def kept(i: int) -> bool:
    """The stream's filter: which examples it keeps (per-process lengths then differ)."""
    return i % 5 != 3


def stream_ids(rank: int, world: int, n: int) -> list[int]:
    """Process ``rank``'s examples of the filtered stream: ``i % world == rank``, kept."""
    return [i for i in range(rank, n, world) if kept(i)]


class Filtered(IterableDataset):
    """A stream of ``n`` examples, this process's every ``world``-th one, filtered."""

    def __init__(self, rank: int, world: int, n: int) -> None:
        self.rank, self.world, self.n = rank, world, n

    def __iter__(self) -> Any:
        for i in stream_ids(self.rank, self.world, self.n):
            yield {"id": np.int64(i), "x": np.full(2, i, np.float32)}


def _source(kind: str, rank: int, world: int, n: int, batch: int, seed: int) -> Any:
    ts = _ts()
    if kind == "map":
        data = Rows(n)
        feed = {"num_shards": world, "shard_index": rank}
        sampler = ts.host_sampler(data, feed, shuffle=True, seed=seed, drop_last=False)
        return DataLoader(data, batch_size=batch, sampler=sampler)
    return DataLoader(Filtered(rank, world, n), batch_size=batch)


def loader_ends(
    policy: str, kind: str, n: int, batch: int, prefetch: int, check: bool, seed: int = 0
) -> dict[str, Any]:
    """One epoch under ``last_batch=policy`` over uneven sources; per step this rank's id and
    mask blocks and the full (replicated) ids and mask, the step count, the dropped count; and
    an evaluation weighted by the mask (sum of ids, count of examples)."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    old = ts.set_agreement_check(check)
    try:
        mesh = _mesh(world)
        source = _source(kind, rank, world, n, batch, seed)
        blocks, masks, full_ids, full_masks = [], [], [], []
        total, count = 0.0, 0.0
        with mesh:
            loader = ts.GlobalBatchLoader(source, prefetch=prefetch, last_batch=policy)
            for step in loader:
                if policy == "pad":
                    b, mask = step
                    weight = mask.to(torch.float32)
                    total += float((b["id"].to(torch.float32) * weight).sum().full_tensor())
                    count += float(weight.sum().full_tensor())
                    masks.append(ts.global_to_host_array(mask).tolist())
                    full_masks.append(ts.replicate_to_local_data(mask).tolist())
                    placements = placement_names(mask.placements)
                else:
                    b = step
                    placements = []
                blocks.append(ts.global_to_host_array(b["id"]).tolist())
                full_ids.append(ts.replicate_to_local_data(b["id"]).tolist())
            after = [tuple(ts.host_to_global_array(torch.zeros(1, 2)).shape) for _ in range(2)]
        return {
            "blocks": blocks,
            "masks": masks,
            "full_ids": full_ids,
            "full_masks": full_masks,
            "dropped": loader.stats.dropped_examples,
            "total": total,
            "count": count,
            "placements": placements,
            "after": after,
        }
    finally:
        ts.set_agreement_check(old)


def loader_empty_pad() -> str:
    """Rank 1's stream is empty: with last_batch='pad' there is nothing to pad it with."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    source = [] if rank == 1 else [{"x": np.zeros((2, 2), np.float32)}] * 2
    with _mesh(world):
        try:
            list(ts.GlobalBatchLoader(source, last_batch="pad", prefetch=2))
        except Exception as e:  # noqa: BLE001 -- the message is the result
            return f"{type(e).__name__}: {e}"
    return "no error"


# -- resuming on another number of processes -------------------------------------------------


def _resumable(n: int, batch: int, seed: int, epoch: int, stateful: bool, prefetch: int) -> Any:
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Rows(n)
    sampler = ts.host_sampler(data, {"num_shards": world, "shard_index": rank}, seed=seed)
    sampler.set_epoch(epoch)
    kind = StatefulDataLoader if stateful else DataLoader
    source = kind(data, batch_size=batch, sampler=sampler)
    return ts.GlobalBatchLoader(source, prefetch=prefetch, last_batch="pad"), sampler


def _real(step: Any) -> list[int]:
    ts = _ts()
    batch, mask = step
    return ts.replicate_to_local_data(batch["id"])[ts.replicate_to_local_data(mask)].tolist()


def resume_save(
    n: int,
    batch: int,
    take: int,
    *,
    seed: int = 0,
    epoch: int = 1,
    stateful: bool = True,
    prefetch: int = 2,
    path: str | None = None,
) -> dict[str, Any]:
    """Takes ``take`` global batches (a step slower than a batch read), saves the loader's
    state (and, with ``path``, a torch.distributed.checkpoint of ``{"loader": loader}``)."""
    import torch.distributed as dist

    loader, _ = _resumable(n, batch, seed, epoch, stateful, prefetch)
    taken = []
    with _mesh(dist.get_world_size()):
        it = iter(loader)
        for _ in range(take):
            taken.append(_real(next(it)))
            time.sleep(0.01)
        state = loader.state_dict()
        if path is not None:
            import torch.distributed.checkpoint as dcp

            dcp.save({"loader": loader}, checkpoint_id=path)
        loader.close()
    return {"taken": taken, "state": state}


def resume_load(
    n: int,
    batch: int,
    *,
    states: dict[str, Any] | None = None,
    path: str | None = None,
    seed: int = 0,
    epoch: int = 1,
    stateful: bool = True,
    prefetch: int = 2,
) -> dict[str, Any]:
    """A loader on this world resumed from ``states`` (the union of the saving processes'
    states) or from the checkpoint at ``path``; the rest of the epoch, as global batches."""
    import torch.distributed as dist

    loader, sampler = _resumable(n, batch, seed, epoch, stateful, prefetch)
    if path is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner

        dcp.load(
            {"loader": loader},
            checkpoint_id=path,
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
    else:
        loader.load_state_dict(states)
    sampler.set_epoch(epoch)  # the training loop's own call: the same epoch keeps its start
    with _mesh(dist.get_world_size()):
        rest = [_real(b) for b in loader]
        again = [_real(b) for b in loader]
    return {"rest": rest, "again": again, "epoch": sampler.epoch}


def resume_stream_on_another_count(states: dict[str, Any]) -> str:
    """A stream's state (per process) loaded on another number of processes."""
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = ts.GlobalBatchLoader(StatefulDataLoader(Filtered(rank, world, 40), batch_size=2))
    try:
        loader.load_state_dict(states)
    except ValueError as e:
        return str(e)
    return "no error"


def stream_state(n: int = 40) -> dict[str, Any]:
    """The state of a stream loader after one batch (to load elsewhere)."""
    import torch.distributed as dist
    from torchdata.stateful_dataloader import StatefulDataLoader

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = ts.GlobalBatchLoader(StatefulDataLoader(Filtered(rank, world, n), batch_size=2))
    with _mesh(world):
        next(iter(loader))
        state = loader.state_dict()
        loader.close()
    return state


# -- streams and DataLoader workers ------------------------------------------------------------


class Shards(IterableDataset):
    """A webdataset-style stream: ``shards`` files of ``per`` examples; each copy reads the
    shards ``stream_shard(partition)`` gives it (or every shard, unsplit)."""

    def __init__(self, shards: int, per: int, split: bool, partition: Any = None) -> None:
        self.shards, self.per, self.split, self.partition = shards, per, split, partition

    def __iter__(self) -> Any:
        ts = _ts()
        index, count = ts.stream_shard(self.partition) if self.split else (0, 1)
        for s in range(index, self.shards, count):
            for j in range(self.per):
                i = s * self.per + j
                yield {"id": np.int64(i), "x": np.full(2, i, np.float32)}


def stream_workers(split: bool, workers: int = 2) -> dict[str, Any]:
    """A stream read by DataLoader workers, split with ``stream_shard`` or not."""
    import torch.distributed as dist

    ts = _ts()
    world = dist.get_world_size()
    source = DataLoader(Shards(4 * world * workers, 4, split), batch_size=4, num_workers=workers)
    got: list[int] = []
    error = "no error"
    with _mesh(world):
        shard = ts.stream_shard()
        try:
            loader = ts.GlobalBatchLoader(source, last_batch="pad")
            for b, mask in loader:
                ids = ts.replicate_to_local_data(b["id"])
                keep = ts.replicate_to_local_data(mask)
                got += ids[keep].tolist()
        except Exception as e:  # noqa: BLE001 -- the message is the result
            error = f"{type(e).__name__}: {e}"
        after = tuple(ts.host_to_global_array(torch.zeros(1, 2)).shape)
    return {"got": got, "error": error, "shard": shard, "after": after}


def stream_unsplit(policy: str, allow: bool, split: bool = False) -> dict[str, Any]:
    """A stream every process reads whole (not split by process; ``split``: by process), no
    workers, under ``last_batch=policy``; ``allow``: ``allow_equal_batches``."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Filtered(rank, world, 16) if split else Filtered(0, 1, 16)
    got: list[int] = []
    error = "no error"
    with _mesh(world):
        try:
            loader = ts.GlobalBatchLoader(
                DataLoader(data, batch_size=2, drop_last=policy == "error"),
                last_batch=policy,
                allow_equal_batches=allow,
            )
            for b in loader:
                if policy == "pad":
                    ids, keep = ts.replicate_to_local_data((b[0]["id"], b[1]))
                    got += ids[keep].tolist()
                else:
                    got += ts.replicate_to_local_data(b["id"]).tolist()
        except Exception as e:  # noqa: BLE001 -- the message is the result
            error = f"{type(e).__name__}: {e}"
        after = tuple(ts.host_to_global_array(torch.zeros(1, 2)).shape)
    return {"got": got, "error": error, "after": after}


# -- len() and the size of a whole batch across processes -------------------------------------


def loader_lengths(sizes: list[int], batch: int = 4) -> dict[str, Any]:
    """``len(loader)`` and the batches the loop yields under each ``last_batch`` policy, over
    DataLoaders of ``sizes[rank]`` examples (with the agreement check on, and off for "pad");
    then list sources whose first batch is short on rank 1 only, under "pad"."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Rows(sizes[rank])
    out: dict[str, Any] = {}

    def attempt(f: Any) -> Any:
        try:
            return f()
        except Exception as e:  # noqa: BLE001 -- the message is the result
            return f"{type(e).__name__}: {e}"

    with _mesh(world):
        for policy, check in (("pad", True), ("pad", False), ("drop", True), ("error", True)):
            old = ts.set_agreement_check(check)
            try:
                loader = ts.GlobalBatchLoader(DataLoader(data, batch_size=batch), last_batch=policy)
                out[f"{policy} {check}"] = (
                    attempt(lambda: len(loader)),  # noqa: B023 -- called at once
                    attempt(lambda: len(list(loader))),  # noqa: B023
                )
            finally:
                ts.set_agreement_check(old)
        full = {"id": np.arange(batch, dtype=np.int64), "x": np.zeros((batch, 2), np.float32)}
        short = {"id": np.arange(2, dtype=np.int64), "x": np.zeros((2, 2), np.float32)}
        source = [short] if rank == 1 else [full, full]
        loader = ts.GlobalBatchLoader(source, last_batch="pad")
        out["lists"] = attempt(lambda: len(list(loader)))
        out["after"] = tuple(ts.host_to_global_array(torch.zeros(1, 2)).shape)
    return out


# -- a KeyboardInterrupt raised by one process's source ------------------------------------------


def source_interrupted(at: int = 3) -> dict[str, Any]:
    """Rank 1's source raises ``KeyboardInterrupt`` at batch ``at`` (a generator); rank 0's
    goes on. Each rank's batches taken (its local block's first value), its error and notes."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()

    def source() -> Any:
        for k in range(8):
            if rank == 1 and k == at:
                raise KeyboardInterrupt
            yield {"x": torch.full((2, 4), float(k))}

    got: list[int] = []
    error, notes = "no error", []
    with _mesh(world):
        loader = ts.GlobalBatchLoader(source(), prefetch=2)
        try:
            for batch in loader:
                got.append(int(batch["x"].to_local()[0, 0]))
        except BaseException as e:  # noqa: BLE001 -- the error is the result
            error = f"{type(e).__name__}: {e}"
            notes = list(getattr(e, "__notes__", []))
        loader.close()
        after = tuple(ts.host_to_global_array(torch.zeros(1, 2)).shape)
    return {"got": got, "error": error, "notes": notes, "after": after}
