"""The end of data (torchshard.data._loader.last_batch): ``last_batch="error"|"drop"|"pad"`` over
sources that run out unevenly (map-style shards whose length does not divide, streams whose
per-process lengths differ), on torch_xla (one process, and virtual hosts) and on real gloo
processes: the same number of steps everywhere, mask values against a numpy oracle, an evaluation
weighted by the mask counting every example once, the dropped examples counted, no recompilation at
the epoch's end; and the pure parts (padding, the decision every process takes)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

import torchshard as ts
from torchshard._core.verdict import Verdict
from torchshard.data._loader.last_batch import (
    ENDED,
    ENDED_EMPTY,
    Template,
    check_policy,
    ended_status,
    rows_status,
    settle,
    status_counts,
    status_items,
)

CASES = "_loader_cases:"


# -- oracles (numpy and torch's own DistributedSampler, never torchshard's index maths) -------


def epoch_order(n, seed=0, epoch=0):
    """The epoch's global order, from torch's DistributedSampler over one replica."""
    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    s.set_epoch(epoch)
    return list(s)


def map_shards(n, hosts, seed=0):
    order = epoch_order(n, seed)
    return [order[h::hosts] for h in range(hosts)]


def stream_shards(n, hosts):
    from _loader_cases import stream_ids

    return [stream_ids(h, hosts, n) for h in range(hosts)]


def expected(policy, shards, batch):
    """Per step, each host's (ids block, mask block) under ``policy``; and per host the
    examples dropped with prefetch 0."""
    chunks = [[s[i : i + batch] for i in range(0, len(s), batch)] for s in shards]
    if policy == "pad":
        steps = max(len(c) for c in chunks)
        out = []
        for k in range(steps):
            blocks = []
            for c in chunks:
                real = c[k] if k < len(c) else []
                ids = np.zeros(batch, np.int64)
                ids[: len(real)] = real
                mask = np.arange(batch) < len(real)
                blocks.append((ids.tolist(), mask.tolist()))
            out.append(blocks)
        return out, [0] * len(shards)
    steps = min(len(s) // batch for s in shards)  # the first short batch or end stops
    out = [[(c[k], None) for c in chunks] for k in range(steps)]
    dropped = [len(c[steps]) if steps < len(c) else 0 for c in chunks]
    return out, dropped


# -- the pure parts --------------------------------------------------------------------------


def test_check_policy_names_the_choices():
    assert [check_policy(p) for p in ("error", "drop", "pad")] == ["error", "drop", "pad"]
    msg = (
        "last_batch must be one of ['error', 'drop', 'pad'], but got 'keep': 'error' raises where "
        "the processes' sources disagree, 'drop' stops every process at the first batch a source "
        "ends, 'pad' pads with masked rows until every source has ended."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        check_policy("keep")


@settings(max_examples=25, deadline=None)
@given(full=st.integers(1, 9), data=st.data())
def test_a_template_pads_short_batches_with_zero_rows_and_masks_them(full, data):
    rows = data.draw(st.integers(1, full))
    first = {"x": np.ones((full, 3), np.float32), "y": torch.arange(full)}
    t = Template(first, None, name="batch")
    short = {"x": np.full((rows, 3), 7, np.float32), "y": torch.arange(rows) + 1}
    assert t.short(short) == (rows if rows < full else None)
    padded = t.pad(short, rows)
    assert padded["x"].shape == (full, 3) and padded["y"].shape == (full,)
    assert np.array_equal(padded["x"][:rows], short["x"]) and not padded["x"][rows:].any()
    assert torch.equal(padded["y"][:rows], short["y"]) and not padded["y"][rows:].any()
    assert t.mask(rows).tolist() == [True] * rows + [False] * (full - rows)
    pad = t.padding()
    assert pad["x"].dtype == np.float32 and pad["y"].dtype == torch.int64
    assert not pad["x"].any() and not pad["y"].any()


def test_a_template_takes_the_batch_size_of_the_source():
    t = Template({"x": np.ones((3, 2))}, 8, name="batch")  # a short first (and only) batch
    assert t.rows == 8 and t.short({"x": np.ones((3, 2))}) == 3
    assert t.short({"x": np.ones((3, 5))}) is None  # another shape: not short, an error


def _verdict(*outcomes):
    """The verdict of the processes' ``(status, made, description)``, as the exchange gives it:
    the items grouped, the status counts summed."""
    items = [status_items(s, made) + list(d) for s, made, d in outcomes]
    counts = [status_counts(s) for s, _, _ in outcomes]
    v = Verdict.of(items)
    sums = tuple(sum(c[i] for c in counts) for i in range(3))
    return dataclasses.replace(v, sums=sums)


def test_settle_is_the_same_decision_on_every_process():
    where = lambda i: f"leaf {i}"  # noqa: E731
    desc = ("structure s", "(4,) int64")
    go = (rows_status(4), True, desc)
    end = (ENDED, False, ())
    assert settle("pad", _verdict(go, go), what="b", where=where) == (False, 8)
    assert settle("pad", _verdict(go, (ENDED, True, desc)), what="b", where=where) == (False, 4)
    assert settle("pad", _verdict(go, (rows_status(1), True, desc)), what="b", where=where) == (
        False,
        5,
    )
    assert settle("drop", _verdict(go, end), what="b", where=where) == (True, 4)
    assert settle("pad", _verdict(end, end), what="b", where=where) == (True, 0)
    other = (rows_status(4), True, ("structure s", "(4,) int32"))
    with pytest.raises(ts.errors.ProcessDisagreementError, match=re.escape("leaf 0: every")):
        settle("drop", _verdict(go, other), what="b", where=where)
    failed = Verdict.of([list(desc), ["a failure: ValueError: bad"]])
    with pytest.raises(
        ts.errors.ProcessDisagreementError,
        match=re.escape("process 0: a batch; process 1: a failure: ValueError: bad"),
    ):
        settle("pad", failed, what="b", where=where)
    empty = _verdict(go, (ENDED_EMPTY, False, ()), go)
    with pytest.raises(ts.errors.ProcessDisagreementError, match=re.escape("process(es) [1] ")):
        settle("pad", empty, what="b", where=where)


# -- one process and virtual hosts (torch_xla) ------------------------------------------------


def _rows(n):
    from data_helpers import Rows

    return Rows(n)


def _per_host_loaders(kind, n, hosts, batch, seed=0):
    if kind == "map":
        data = _rows(n)
        samplers = [
            ts.host_sampler(
                data, {"num_shards": hosts, "shard_index": h}, seed=seed, drop_last=False
            )
            for h in range(hosts)
        ]
        return [DataLoader(data, batch_size=batch, sampler=s) for s in samplers]
    from _loader_cases import Filtered

    return [DataLoader(Filtered(h, hosts, n), batch_size=batch) for h in range(hosts)]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("policy", ["pad", "drop"])
@pytest.mark.parametrize(
    ("kind", "n", "hosts"), [("map", 19, 2), ("map", 37, 4), ("stream", 40, 4)]
)
def test_virtual_hosts_end_together(mesh8, kind, n, hosts, policy, prefetch):
    from torchshard.testing import (
        global_batch_loader_per_host,
        global_to_host_array_per_host,
        virtual_hosts,
    )

    batch = 8 // hosts
    shards = map_shards(n, hosts) if kind == "map" else stream_shards(n, hosts)
    want, dropped = expected(policy, shards, batch)
    with virtual_hosts(hosts):
        loader = global_batch_loader_per_host(
            _per_host_loaders(kind, n, hosts, batch),
            partition=ts.P("data"),
            prefetch=prefetch,
            last_batch=policy,
        )
        got = []
        for step in loader:
            b, mask = step if policy == "pad" else (step, None)
            ids = [blk["id"].tolist() for blk in global_to_host_array_per_host(b)]
            if mask is None:
                got.append([(i, None) for i in ids])
            else:
                assert tuple(mask.shape) == (batch * hosts,) and mask.dtype == torch.bool
                ms = [m.tolist() for m in global_to_host_array_per_host(mask)]
                got.append(list(zip(ids, ms, strict=True)))
    assert got == [[(list(i), m) for i, m in step] for step in want]
    if policy == "drop":
        read_ahead = sum(len(s) for s in shards) - batch * hosts * len(want)
        assert sum(dropped) <= loader.stats.dropped_examples <= read_ahead
        if prefetch == 0:
            assert loader.stats.dropped_examples == sum(dropped)


def test_an_evaluation_weighted_by_the_mask_counts_every_example_once(mesh8):
    from torchshard.testing import global_batch_loader_per_host, virtual_hosts

    n, hosts = 37, 4
    with virtual_hosts(hosts):
        loader = global_batch_loader_per_host(
            _per_host_loaders("map", n, hosts, 2), partition=ts.P("data"), last_batch="pad"
        )
        total = count = 0.0
        seen = []
        for b, mask in loader:
            w = mask.to(torch.float32)
            total += float((b["x"][:, 0] * w).sum().cpu())  # a metric weighted by the mask
            count += float(w.sum().cpu())
            full = ts.replicate_to_local_data(b["id"])
            seen += full[ts.replicate_to_local_data(mask)].tolist()
    assert sorted(seen) == list(range(n))  # each example once, no repeats
    assert (total, count) == (float(sum(range(n))), float(n))


def test_one_process_pads_and_drops_its_short_last_batch(mesh8):
    pad = ts.GlobalBatchLoader(DataLoader(_rows(19), batch_size=8), last_batch="pad")
    steps = [(ts.replicate_to_local_data(b["id"]).tolist(), m.cpu().tolist()) for b, m in pad]
    assert steps[-1] == ([16, 17, 18, 0, 0, 0, 0, 0], [True] * 3 + [False] * 5)
    assert [s[1] for s in steps[:2]] == [[True] * 8] * 2
    drop = ts.GlobalBatchLoader(DataLoader(_rows(19), batch_size=8), last_batch="drop", prefetch=0)
    assert [ts.replicate_to_local_data(b["id"]).tolist()[0] for b in drop] == [0, 8]
    assert drop.stats.dropped_examples == 3
    error = ts.GlobalBatchLoader(DataLoader(_rows(19), batch_size=8))
    with pytest.raises(ts.ShardingError, match=re.escape("batch 2: batch['id'] has shape (3,)")):
        list(error)


def test_the_batch_leaf_is_the_first_whose_dim_0_the_partition_splits(mesh8):
    """A per-batch table as the first key (``P()``) or a 0-d leaf does not count rows: the
    short batch of ``x`` is padded and masked; the table keeps its shape."""
    table = np.arange(24, dtype=np.float32).reshape(8, 3)
    source = [{"a_table": table, "x": np.ones((n, 2), np.float32)} for n in (8, 4)]
    partition = {"a_table": ts.P(), "x": ts.P("data")}
    out = list(ts.GlobalBatchLoader(source, last_batch="pad", partition=partition))
    assert [m.cpu().tolist() for _, m in out] == [[True] * 8, [True] * 4 + [False] * 4]
    assert out[1][0]["a_table"].shape == (8, 3) and out[1][0]["x"].shape == (8, 2)
    scalar = [{"a": np.float32(n), "x": np.ones((n, 2), np.float32)} for n in (8, 4)]
    out = list(
        ts.GlobalBatchLoader(scalar, last_batch="drop", partition={"a": ts.P(), "x": ts.P("data")})
    )
    assert len(out) == 1


def test_batch_leaf_names_the_leaf_and_its_errors_say_which_it_is(mesh8):
    """Under the default partition every leaf's dim 0 is split, so a table first is taken for
    the batch's: the error says which leaf was counted; ``batch_leaf`` names the right one."""
    table = np.zeros((8, 3), np.float32)
    source = [{"a_table": table, "x": np.ones((n, 2), np.float32)} for n in (8, 4)]
    with pytest.raises(ts.ShardingError) as info:
        list(ts.GlobalBatchLoader(source, last_batch="pad"))
    assert "(last_batch='pad' counts a batch's rows on batch['a_table'], the leaf that " in (
        "\n".join(info.value.__notes__)
    )
    named = ts.GlobalBatchLoader(source, last_batch="pad", batch_leaf="x")
    assert [m.cpu().tolist().count(True) for _, m in named] == [8, 4]
    nested = [{"in": {"ids": np.ones((n, 2), np.float32)}, "a": table} for n in (8, 4)]
    named = ts.GlobalBatchLoader(nested, last_batch="drop", batch_leaf=("in", "ids"))
    assert len(list(named)) == 1
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "GlobalBatchLoader(batch_leaf='y'): batch has no leaf at that path; its leaves are "
            "[\"batch['a_table']\", \"batch['x']\"]."
        ),
    ):
        list(ts.GlobalBatchLoader(source, last_batch="pad", batch_leaf="y"))
    with pytest.raises(TypeError, match=re.escape("batch_leaf: expected the path of the leaf")):
        ts.GlobalBatchLoader(source, batch_leaf=1.5)


def test_per_host_lists_whose_first_batch_differs_pad_to_the_largest(mesh8):
    """Host 1's first (and only) batch is short: without a batch_size every host's whole batch
    is the largest first batch, so host 1's is padded, not taken for a whole one."""
    from torchshard.testing import global_batch_loader_per_host, virtual_hosts

    full = {"x": np.ones((4, 2), np.float32)}
    short = {"x": np.ones((2, 2), np.float32)}
    with virtual_hosts(2):
        loader = global_batch_loader_per_host([[full, full], [short]], last_batch="pad")
        masks = [m.cpu().tolist() for _, m in loader]
        assert len(loader) == 2
    assert masks == [[True] * 6 + [False] * 2, [True] * 4 + [False] * 4]


def test_settle_needs_one_whole_batch_size():
    where = lambda i: f"leaf {i}"  # noqa: E731
    msg = (
        "b: last_batch='pad' needs one size of a whole batch, but it has 4 on process 0; 2 on "
        "process 1: each process takes its source's batch_size"
    )
    with pytest.raises(ts.errors.ProcessDisagreementError, match=re.escape(msg)):
        settle(
            "pad",
            _verdict((rows_status(4, 4), True, ()), (rows_status(2, 2), True, ())),
            what="b",
            where=where,
        )
    assert settle(
        "pad",
        _verdict((rows_status(4, 4), True, ()), (rows_status(2, 4), True, ())),
        what="b",
        where=where,
    ) == (False, 6)
    ended = _verdict((rows_status(4, 4), True, ()), (ended_status(4), True, ()))
    assert ended.agreed  # an ended process that pads compares alike: one round
    assert settle("pad", ended, what="b", where=where) == (False, 4)


def test_pad_keeps_one_compiled_step_to_the_end_of_the_epoch(mesh8):
    """torch_xla's CompileTime count (read-backs excluded: nothing is read inside the loop) is
    the same after the last unpadded step as at the end; feeding the short batch as it is
    compiles again (the check can fail)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    device = torch_xla.device()
    w = torch.linspace(0, 1, 3).to(device)

    def step(x, mask):
        out = ((x * w).sum(1) * mask).sum()
        torch_xla.sync()
        return out

    def compiles():
        data = met.metric_data("CompileTime")
        return 0 if data is None else data[0]

    counts, masks = [], []
    outs = []
    for b, mask in ts.GlobalBatchLoader(
        DataLoader(_rows(44), batch_size=8), last_batch="pad", prefetch=2, partition=ts.P()
    ):
        outs.append(step(b["x"], mask.to(torch.float32)))
        counts.append(compiles())
        masks.append(mask)
    real = [int(m.cpu().sum()) for m in masks]  # read back after the loop
    assert real == [8, 8, 8, 8, 8, 4]
    last_full = max(i for i, r in enumerate(real) if r == 8)
    assert counts[last_full] == counts[-1]
    total = sum(float(o.cpu()) for o in outs)
    assert total == pytest.approx(sum(3 * i * 0.5 for i in range(44)), rel=1e-5)
    before = compiles()
    for b in DataLoader(_rows(44), batch_size=8):  # no padding: the short batch is a new shape
        x = ts.host_to_global_array(b["x"], partition=ts.P())
        step(x, ts.host_to_global_array(torch.ones(x.shape[0]), partition=ts.P()))
    assert compiles() > before


def test_the_mask_is_split_like_the_batch(mesh42):
    import torch_xla

    loader = ts.GlobalBatchLoader(
        DataLoader(_rows(12), batch_size=8), last_batch="pad", partition=ts.P("data")
    )
    b, mask = next(iter(loader))
    spec = torch_xla._XLAC._get_xla_sharding_spec
    assert spec(mask) == "{devices=[4,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert spec(b["id"]) == spec(mask)
    loader.close()


def test_pad_with_a_dispatcher_masks_the_physical_rows(mesh8):
    dispatcher = ts.InputDispatcher(
        4, num_physical_feeds=1, physical_feed_index=0, logical_feed_indices=(0,),
        global_physical_batch_size=8,
    )  # fmt: skip
    loader = ts.GlobalBatchLoader(
        DataLoader(_rows(6), batch_size=4), dispatcher=dispatcher, last_batch="pad"
    )
    steps = [(b, m.cpu().tolist()) for b, m in loader]
    assert [m for _, m in steps] == [[True] * 4 + [False] * 4, [True] * 2 + [False] * 6]
    logical = dispatcher.physical_to_logical_batch(steps[1][0])
    assert ts.replicate_to_local_data(logical["id"]).tolist() == [4, 5, 0, 0]


def test_pad_with_a_dispatcher_compiles_once_over_two_epochs(mesh8):
    """A loader with a dispatcher and last_batch="pad", two epochs of 20 examples in batches
    of 8 (the third batch padded): torch_xla's CompileTime count is the same after the first
    step as at the end. The step dispatches in the step (row targets), weights by the mask and
    sums. Before, the dispatch compiled on every step (Tensor.view(dtype) fell back to the
    CPU)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    def compiles():
        data = met.metric_data("CompileTime")
        return 0 if data is None else data[0]

    dispatcher = ts.InputDispatcher(
        8, num_physical_feeds=1, physical_feed_index=0, global_physical_batch_size=16
    )
    loader = ts.GlobalBatchLoader(
        DataLoader(_rows(20), batch_size=8), dispatcher=dispatcher, last_batch="pad"
    )
    counts, sums = [], []
    for _ in range(2):
        for b, mask in loader:
            logical = dispatcher.physical_to_logical_batch({**b, "mask": mask})
            w = logical["mask"].to(torch.float32)
            sums.append((logical["x"][:, 0] * w).sum() + (logical["id"] * w).sum())
            torch_xla.sync()
            counts.append(compiles())
    assert len(counts) == 6 and counts[1:] == [counts[0]] * 5, counts
    assert [float(s.cpu()) for s in sums] == [
        2.0 * sum(range(k, min(k + 8, 20))) for k in (0, 8, 16)
    ] * 2


def test_last_batch_is_checked_when_the_loader_is_made():
    with pytest.raises(ValueError, match=re.escape("last_batch must be one of")):
        ts.GlobalBatchLoader([], last_batch=None)


# -- gloo processes ------------------------------------------------------------------------


def _gloo(pools, world, policy, kind, n, batch, prefetch, check):
    results = pools(world).run(
        CASES + "loader_ends",
        policy=policy,
        kind=kind,
        n=n,
        batch=batch,
        prefetch=prefetch,
        check=check,
    )
    shards = map_shards(n, world) if kind == "map" else stream_shards(n, world)
    want, dropped = expected(policy, shards, batch)
    steps = {len(r["blocks"]) for r in results}
    assert steps == {len(want)}  # the same number of steps on every process
    for rank, r in enumerate(results):
        assert r["blocks"] == [list(step[rank][0]) for step in want]
        assert r["after"] == [(world, 2)] * 2  # still in step
        if policy == "pad":
            assert r["masks"] == [step[rank][1] for step in want]
            assert r["full_masks"] == [[m for blk in step for m in blk[1]] for step in want]
            assert r["placements"] == ["S(0)"]
            kept = sum(len(s) for s in shards)
            assert r["count"] == kept  # every example once
            assert r["total"] == float(sum(i for s in shards for i in s))
        else:
            assert dropped[rank] <= r["dropped"] <= len(shards[rank]) - batch * len(want)
            if prefetch == 0:
                assert r["dropped"] == dropped[rank]
    return results


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("policy", ["pad", "drop"])
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_gloo_processes_end_together(pools, kind, policy, check):
    _gloo(pools, 2, policy, kind, 23 if kind == "map" else 30, 3, 2, check)


@pytest.mark.parametrize(("policy", "prefetch"), [("pad", 0), ("drop", 0), ("pad", 3)])
def test_four_gloo_processes_end_together(pools, policy, prefetch):
    _gloo(pools, 4, policy, "stream", 50, 2, prefetch, True)
    _gloo(pools, 4, policy, "map", 30, 4, prefetch, True)


def test_gloo_pad_refuses_a_process_with_nothing_to_pad_with(pools):
    errors = pools(2).run(CASES + "loader_empty_pad")
    msg = (
        "ProcessDisagreementError: GlobalBatchLoader: batch 0: last_batch='pad' pads a process "
        "whose source has ended with zero rows shaped like its first batch, but the source of "
        "process(es) [1] ended before its first batch, so there is nothing to pad with. Give "
        "every process at least one batch (fewer processes, or a smaller batch), or use "
        "last_batch='drop'."
    )
    assert errors == [msg, msg]


def test_expected_is_a_sound_oracle():
    shards = [[1, 2, 3, 4, 5], [6, 7, 8]]
    pad, _ = expected("pad", shards, 2)
    assert pad[2] == [([5, 0], [True, False]), ([0, 0], [False, False])]
    drop, dropped = expected("drop", shards, 2)
    assert len(drop) == 1 and dropped == [2, 1]
    assert math.ceil(5 / 2) == len(pad)


def test_gloo_uneven_streams_end_within_a_short_group_timeout():
    """With the workers' process group timeout at 5 s, each policy's epoch over streams of
    uneven length ends on every process without an error: a process left waiting in a
    collective for a peer that had ended would raise CollectiveError after 5 s instead. (No
    wall-clock bound: on a loaded machine an epoch that waits for no one still takes long.)"""
    from _multiproc import WorkerPool

    pool = WorkerPool(2, timeout=120, collective_timeout=5.0)
    try:
        for policy in ("drop", "pad"):
            _gloo(lambda world: pool, 2, policy, "stream", 30, 3, 2, True)
    finally:
        pool.close()
