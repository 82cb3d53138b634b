"""Cases of processes that fall out of step, die or disagree (run by ``_multiproc``'s workers as
``"_collective_cases:<name>"``; pure torch, no torch_xla).

Each case returns the error text each rank saw (``"no error"`` when none) and how long the
failing call took, so that the test process can check that nobody waited past the default
group's timeout and that the error names torchshard's call and the ranks.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any

import numpy as np
import torch


def _ts() -> Any:
    import torchshard

    return torchshard


def _mesh(world: int) -> Any:
    ts = _ts()
    return ts.create_device_mesh((world,), ("data",), backend="dtensor")


def _timed(fn: Any) -> dict[str, Any]:
    """``fn()``'s error and time, its result used once (a deferred agreement check raises at
    its first use)."""
    import helpers

    t0 = time.monotonic()
    try:
        helpers.use_every_tensor(fn())
        error = "no error"
    except Exception as e:  # noqa: BLE001 -- the message is the result
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - t0}


def skip_call() -> dict[str, Any]:
    """Rank 1 stays alive but skips a ``host_to_global_array`` that rank 0 makes."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    mesh = _mesh(dist.get_world_size())
    with mesh:
        ts.host_to_global_array(torch.zeros(2, 3))  # in step so far
        if rank == 1:
            return {"error": "skipped", "seconds": 0.0}
        return _timed(lambda: ts.host_to_global_array(torch.zeros(2, 3)))


def loader_break() -> dict[str, Any]:
    """Both ranks iterate a loader; rank 1 breaks out after batch 1, rank 0 goes on."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    mesh = _mesh(dist.get_world_size())
    source = [{"x": torch.full((2, 4), float(i))} for i in range(6)]
    with mesh:
        ts.host_to_global_array(source[0])  # torch's first DTensor.from_local (seconds): not timed
        loader = ts.GlobalBatchLoader(source, prefetch=2)
        epoch = iter(loader)
        taken: list[int] = []

        def consume() -> None:
            for i, _ in enumerate(epoch):
                taken.append(i)
                if rank == 1 and i == 1:
                    break

        out = _timed(consume)
        out["batches"] = len(taken)
        loader.close()
    return out


def peer_dies_mid_call(call: str) -> dict[str, Any]:
    """Rank 1 enters a collective and exits (``os._exit``) while waiting in it; rank 0 enters
    the same call a moment later. ``call``: ``"gather"`` (``replicate_to_local_data``),
    ``"redistribute"`` (``maybe_shard`` to replicated: an all-gather) or ``"agreement"``
    (``host_to_global_array``, whose store-based check rank 1 never enters: it exits first)."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh(world)
    with mesh:
        g = ts.host_to_global_array(torch.arange(8.0).reshape(4, 2) + rank)
        ts.maybe_shard(g, ts.P())  # in step: every rank made these calls
        if call == "agreement":  # the store-based check: rank 1 exits before it
            if rank == 1:
                os._exit(3)
            return _timed(lambda: ts.host_to_global_array(torch.zeros(2, 3)))
        # Rank 1 cannot leave the call before rank 0 enters it, and rank 0 enters only after
        # rank 1 has said it is dying: it dies in the call however slow the machine.
        store = dist.distributed_c10d._get_default_store()
        if rank == 1:

            def die() -> None:
                store.set("peer_dies_mid_call/dying", "1")
                os._exit(3)

            threading.Timer(0.5, die).start()
        else:
            store.wait(["peer_dies_mid_call/dying"], datetime.timedelta(seconds=60))
            time.sleep(0.5)  # rank 1 is gone, or going
        if call == "gather":
            return _timed(lambda: ts.replicate_to_local_data(g))
        return _timed(lambda: ts.maybe_shard(g, ts.P()))


def mesh_on_one_rank() -> dict[str, Any]:
    """Rank 0 alone enters a hand-built two-axis mesh (building its DeviceMesh is collective)."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        return {"error": "did not enter", "seconds": 0.0}
    mesh = ts.Mesh(np.arange(world).reshape(1, world), ("data", "model"), backend="dtensor")

    def enter() -> None:
        with mesh:
            pass

    return _timed(enter)


def out_of_step() -> dict[str, Any]:
    """Rank 0 calls ``host_to_global_array`` where rank 1 takes a loader batch of the same tree,
    shapes and dtypes: the descriptions agree, the calls do not."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    batch = {"x": torch.zeros(2, 4)}
    with _mesh(dist.get_world_size()):
        if rank == 0:
            out = _timed(lambda: ts.host_to_global_array(batch))
        else:
            out = _timed(lambda: next(iter(ts.GlobalBatchLoader([batch], prefetch=0))))
        # Still in step: the next call works everywhere.
        out["after"] = tuple(ts.host_to_global_array(batch)["x"].shape)
    return out


def readback_of_disagreeing_shapes() -> dict[str, Any]:
    """With the agreement check off, rank 1 passes 3 rows where rank 0 passes 4: each builds a
    DTensor of another global shape. Reading it back must fail on both, before the gather."""
    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    old = ts.set_agreement_check(False)
    try:
        with _mesh(dist.get_world_size()):
            g = ts.host_to_global_array({"x": torch.ones(4 - rank, 2)}, partition=ts.P("data"))
            out = _timed(lambda: ts.replicate_to_local_data(g))
            good = ts.host_to_global_array({"x": torch.ones(2, 2)}, partition=ts.P("data"))
            out["after"] = ts.replicate_to_local_data(good)["x"].shape[0]
    finally:
        ts.set_agreement_check(old)
    return out


def agreement_cost(calls: int = 200) -> dict[str, float]:
    """Seconds per ``host_to_global_array`` call of 8 small leaves, with and without the
    agreement check (for a loose bound in the tests; the bench measures it properly)."""
    import torch.distributed as dist

    ts = _ts()
    batch = {f"x{i}": torch.zeros(32, 16) for i in range(8)}
    out = {}
    with _mesh(dist.get_world_size()):
        for checked in (True, False, True):
            old = ts.set_agreement_check(checked)
            try:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    ts.host_to_global_array(batch)
                out[str(checked)] = (time.perf_counter() - t0) / calls
            finally:
                ts.set_agreement_check(old)
    return out


def replica_values(kind: str, check: bool | None) -> dict[str, Any]:
    """Processes that hold the same block pass values that differ by rank. ``kind``:
    ``"replicated"`` (``P()`` on a 1-D mesh), ``"loader"`` (the same through a loader),
    ``"shared"`` (``P("data")`` on a ``(2, 2)`` mesh of 4 processes: ranks 0, 1 and 2, 3 share
    blocks), ``"equal"`` (shared blocks with equal values: no error)."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    old = ts.set_value_check(check)
    try:
        if kind in ("shared", "equal"):
            mesh = ts.create_device_mesh((2, world // 2), ("data", "model"), backend="dtensor")
            spec = ts.P("data")
            value = rank // 2 if kind == "equal" else rank
        else:
            mesh = _mesh(world)
            spec, value = ts.P(), rank
        batch = {"w": torch.full((4, 2), float(value)), "ok": torch.zeros(4, 2)}
        with mesh:
            if kind == "loader":
                loader = ts.GlobalBatchLoader([batch], partition=spec, prefetch=0)
                out = _timed(lambda: list(loader))
            else:
                out = _timed(lambda: ts.host_to_global_array(batch, partition=spec))
            out["after"] = tuple(ts.host_to_global_array({"x": torch.ones(2, 2)})["x"].shape)
    finally:
        ts.set_value_check(old)
    return out


def threads_meet() -> dict[str, Any]:
    """The same calls from threads named differently on the two ranks meet: a
    ``host_to_global_array`` on ``MainThread`` (rank 0) and on a thread named ``trainer``
    (rank 1); default-named threads where rank 1 started an extra thread first; a loader's
    epoch on those threads; two streams named by ``call_stream`` used at once by two threads
    of each rank. Then two threads of rank 0 making calls on one stream at the same time: the
    second raises at once, naming the threads and ``call_stream``."""
    import threading

    import torch.distributed as dist

    ts = _ts()
    rank = dist.get_rank()
    mesh = _mesh(dist.get_world_size())
    out: dict[str, Any] = {}

    def on_thread(name: str | None, fn: Any) -> dict[str, Any]:
        got: dict[str, Any] = {}

        def work() -> None:
            with mesh:
                got.update(_timed(fn))

        t = threading.Thread(target=work, name=name)
        t.start()
        t.join(60)
        return got

    def h2g() -> Any:
        return tuple(ts.host_to_global_array(torch.full((2, 3), float(rank)))[0].shape)

    with mesh:
        ts.host_to_global_array(torch.zeros(2, 3))  # the main threads: in step
        if rank == 0:
            out["named"] = _timed(h2g)
        else:
            out["named"] = on_thread("trainer", h2g)
        if rank == 1:  # one extra default-named thread: the next one's name differs
            threading.Thread(target=lambda: None).start()
        out["default"] = on_thread(None, h2g)

        def epoch() -> None:
            source = [{"x": torch.full((2, 4), float(i))} for i in range(4)]
            with ts.GlobalBatchLoader(source, prefetch=2) as loader:
                assert [int(b["x"].to_local()[0, 0]) for b in loader] == [0, 1, 2, 3]

        out["loader"] = on_thread(f"loop-of-rank-{rank}", epoch) if rank else _timed(epoch)

        def stream(name: str) -> Any:
            def fn() -> None:
                with ts.call_stream(name):
                    for _ in range(5):
                        h2g()

            return lambda: on_thread(f"{name}-{rank}", fn)

        results: dict[str, Any] = {}
        ts_ = [
            threading.Thread(target=lambda n=n: results.update({n: stream(n)()}))
            for n in ("eval", "train")
        ]
        for t in ts_:
            t.start()
        for t in ts_:
            t.join(60)
        out["streams"] = results
        if rank == 0:  # two threads on one stream at once: the second is refused
            gate = threading.Event()
            release = threading.Event()
            from torchshard._backend.dtensor import collective

            s = collective.session()
            assert s is not None

            def hold() -> None:
                end = s.begin("held", [])
                gate.set()
                release.wait(30)
                out["held"] = "agreed" if end().agreed else "differed"

            holder = threading.Thread(target=hold, name="holder")
            holder.start()
            gate.wait(30)
            out["second"] = on_thread("second", h2g)
            release.set()
            holder.join(60)
        else:
            from torchshard._backend.dtensor import collective

            s = collective.session()
            assert s is not None
            out["held"] = "agreed" if s.exchange("held", []).agreed else "differed"
    return out


def first_batch_values(
    feed: str, check: bool | None = None, epochs: int = 2, bad_at: int | None = None
) -> dict[str, Any]:
    """A ``GlobalBatchLoader`` with ``P("dp")`` on a ``(dp=2, tp=2)`` mesh of 4 processes, fed
    by ``feed="old"`` (``{"num_shards": process_count(), "shard_index": process_index()}``:
    the tp peers read different shards) or ``feed="mesh"`` (``feed_read_config(P("dp"))``);
    ``check`` is ``set_value_check``'s setting (``None``: the default); ``bad_at``: rank 1
    changes that batch. Per epoch: the batches taken and the error (``"no error"``)."""
    import torch.distributed as dist

    ts = _ts()
    rank, world = dist.get_rank(), dist.get_world_size()
    old = ts.set_value_check(check)
    out: dict[str, Any] = {}
    try:
        mesh = ts.create_device_mesh((2, world // 2), ("dp", "tp"), backend="dtensor")
        with mesh:
            if feed == "old":
                cfg = {"num_shards": ts.process_count(), "shard_index": ts.process_index()}
            else:
                cfg = ts.feed_read_config(ts.P("dp"))
            rows = torch.arange(16.0).reshape(16, 1)[cfg["shard_index"] :: cfg["num_shards"]]
            batches = [{"x": rows[i : i + 2].clone()} for i in range(0, 4, 2)] * 2
            if bad_at is not None and rank == 1:
                batches[bad_at] = {"x": batches[bad_at]["x"] + 100}
            loader = ts.GlobalBatchLoader(batches, partition=ts.P("dp"), prefetch=0)
            for epoch in range(epochs):
                taken: list[int] = []

                def run(taken: list[int] = taken) -> None:
                    for batch in loader:
                        taken.append(int(batch["x"].full_tensor()[0, 0]))

                out[f"epoch {epoch}"] = {**_timed(run), "taken": len(taken)}
            out["after"] = tuple(ts.host_to_global_array({"x": torch.ones(2, 2)})["x"].shape)
    finally:
        ts.set_value_check(old)
    return out


def pipelined_exchanges(rounds: int = 120, differ_at: int = 57) -> dict[str, Any]:
    """A named channel whose exchanges each rank begins one ahead of their ends (as a loader's
    thread does), at paces that vary by rank and round (so the ranks arrive in every order):
    every verdict is right (one disagreement, at ``differ_at``, with both ranks' items), and the
    channel's keys are gone from the store after its end."""
    import random

    import torch.distributed as dist

    from torchshard._backend.dtensor import collective
    from torchshard._backend.dtensor._torch_private import default_store

    rank = dist.get_rank()
    pace = random.Random(rank)
    s = collective.session()
    assert s is not None
    channel, _ = s.open_channel("pipelined")
    dist.barrier()  # the opening exchange's keys (the main thread's channel) are written
    keys_before = default_store().num_keys()
    dist.barrier()  # every rank counted before any writes the first exchange's keys
    verdicts: list[Any] = []
    ends: list[Any] = []
    for x in range(rounds + 1):
        if x < rounds:
            item = f"rank {rank}" if x == differ_at else "alike"
            time.sleep(pace.random() * 0.002)
            ends.append(s.begin(f"exchange {x}", [item], channel))
        if x >= 1:  # the previous exchange ends after this one began
            time.sleep(pace.random() * 0.002)
            verdicts.append(ends[x - 1]())
    s.close_channel(channel, finished=True, taken=rounds)
    dist.barrier()
    return {
        "agreed": [k for k, v in enumerate(verdicts) if v.agreed],
        "differed": {
            k: [list(i) for i in v.per_process()] for k, v in enumerate(verdicts) if not v.agreed
        },
        "keys": default_store().num_keys() - keys_before,
    }
