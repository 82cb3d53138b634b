"""One epoch of a GlobalBatchLoader (torchshard.data._loader.epoch): the consumer's side.
``next()`` takes what the producer made (on the loader's thread, or in place with
``prefetch=0``: the plan chooses, once), counts it and moves the epoch's cursor; the end of the
sources ends the epoch and resets the cursor; an error reaches the consumer with its batch; an
epoch closed by something else says so."""

import re
import threading

import numpy as np
import pytest
from data_helpers import make_plan, no_loader_thread_left

import torchshard as ts
from torchshard.data._loader.cursor import Cursor
from torchshard.data._loader.epoch import Epoch
from torchshard.data._loader.producer import producer_for
from torchshard.data._loader.stats import Counters

DATA = ts.P("data")


def _epoch(batches, mesh, *, prefetch, first=0):
    counters, cursor = Counters(), Cursor(None, first)
    plan = make_plan(mesh, DATA, first=first, explicit_partition=True, prefetch=prefetch)
    producer = producer_for(plan, [iter(batches)], [batches], None, counters)
    return Epoch(plan, producer, counters=counters, cursor=cursor), counters, cursor


def _rows(batch):
    return ts.replicate_to_local_data(batch["id"]).tolist()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_epoch_yields_every_batch_and_moves_its_cursor(mesh8, prefetch):
    batches = [{"id": np.arange(8) + 8 * k} for k in range(3)]
    epoch, counters, cursor = _epoch(batches, mesh8, prefetch=prefetch)
    assert iter(epoch) is epoch
    for k in range(3):
        assert _rows(next(epoch)) == list(range(8 * k, 8 * k + 8))
        assert cursor.next_batch == k + 1
    assert counters.value.batches == 3 and counters.value.wait_seconds >= 0
    with pytest.raises(StopIteration):
        next(epoch)
    assert cursor.next_batch == 0  # the next epoch starts over
    with pytest.raises(StopIteration):
        next(epoch)  # a finished epoch just stops
    assert no_loader_thread_left()


def test_prefetch_runs_the_producer_on_a_thread_with_the_mesh(mesh8):
    seen = []

    def source():
        seen.append((threading.current_thread().name, ts.current_mesh()))
        yield {"id": np.arange(8)}

    epoch, _, _ = _epoch(source(), mesh8, prefetch=1)
    next(epoch)
    epoch.close()
    ((name, mesh),) = seen
    assert name.startswith("torchshard-loader") and name != threading.current_thread().name
    assert mesh is mesh8  # the mesh, made current on the loader's thread
    here, _, _ = _epoch(iter([{"id": np.arange(8)}]), mesh8, prefetch=0)
    assert _rows(next(here)) == list(range(8))


def test_a_resumed_epoch_counts_from_its_first_batch(mesh8):
    epoch, _, cursor = _epoch([{"id": np.zeros(6)}], mesh8, prefetch=0, first=5)
    with pytest.raises(ts.errors.IndivisibleError) as info:
        next(epoch)
    assert str(info.value).startswith("GlobalBatchLoader: batch 5: batch['id']")
    assert info.value.__notes__ == ["(raised by GlobalBatchLoader at batch 5)"]
    assert cursor.next_batch == 5  # the failed batch was not taken
    with pytest.raises(StopIteration):
        next(epoch)  # an error closes the epoch


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_epoch_closed_by_another_call_says_so(mesh8, prefetch):
    batches = [{"id": np.arange(8)}] * 3
    epoch, _, _ = _epoch(batches, mesh8, prefetch=prefetch)
    next(epoch)
    epoch.close(by="load_state_dict()")
    epoch.close(by="a later iter()")  # the first reason stays
    message = (
        "GlobalBatchLoader: this iterator was ended before batch 1 by load_state_dict() on the "
        "same loader; a loader runs one epoch at a time, and each iter() starts a new one (the "
        "source's position moves with it). Use the newest iterator, or make a second "
        "GlobalBatchLoader for a second stream."
    )
    for _ in range(2):
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
            next(epoch)
    assert no_loader_thread_left()


def test_closing_a_closed_epoch_by_another_call_changes_nothing(mesh8):
    epoch, _, _ = _epoch([{"id": np.arange(8)}], mesh8, prefetch=0)
    epoch.close()
    epoch.close()  # idempotent
    epoch.close(by="a later iter()")
    with pytest.raises(StopIteration):
        next(epoch)


# -- nothing silent when processes share a block: the first batch of every epoch is compared --


def _shared_block_error(n, also=""):
    return (
        re.escape(
            f"ProcessDisagreementError: batch['x']: GlobalBatchLoader: batch {n}: the ranks "
            "[0, 1] hold the same block (global ranges ((0, 2), (0, 1)), one (start, stop) per "
            "dimension) and must pass the same values, but found checksum "
        )
        + "[0-9a-f]{16}"
        + re.escape(" on rank(s) [0]; checksum ")
        + "[0-9a-f]{16}"
        + re.escape(
            f" on rank(s) [1].{also} A replicated leaf (P()) or a mesh axis the spec leaves free "
            "gives several processes the same block: give them equal values, or shard the leaf "
            "over that axis. A loader's feed that reads one shard per process gives them different "
            "examples: read the shard of the mesh's data axes, "
            "torchshard.feed_read_config(spec) (or torchshard.host_sampler(dataset, spec)), "
            "which gives the processes that share a block the same one."
        )
    )


CASE = "_collective_cases:first_batch_values"


def test_the_old_recipe_raises_at_the_first_batch_of_every_epoch_by_default(pools):
    """``{"num_shards": process_count(), "shard_index": process_index()}`` with ``P("dp")`` on
    ``(dp=2, tp=2)``: the tp peers pass different rows for the block they share. Before, the
    loader placed each process's rows silently (the value check was opt-in); now, with no
    setting, every rank raises at batch 0 of epoch 0 and again of epoch 1."""
    results = pools(4).run(CASE, feed="old")
    assert len(results) == 4
    # Both tp pairs differ, and both are named (before: only the first).
    also = " The ranks [2, 3] (global ranges ((2, 4), (0, 1))) differ too."
    for r in results:
        for epoch in ("epoch 0", "epoch 1"):
            assert re.fullmatch(_shared_block_error(0, also), r[epoch]["error"]), r
            assert r[epoch]["taken"] == 0
        assert r["after"] == (8, 2)  # the processes are still in step


def test_the_feed_from_the_mesh_passes_and_the_check_can_be_turned_off(pools):
    for r in pools(4).run(CASE, feed="mesh"):
        for epoch in ("epoch 0", "epoch 1"):
            assert r[epoch] | {"seconds": 0} == {"error": "no error", "seconds": 0, "taken": 4}
    for r in pools(4).run(CASE, feed="old", check=False):  # explicitly off: nothing compared
        assert r["epoch 0"]["error"] == r["epoch 1"]["error"] == "no error", r


def test_the_first_batch_check_alone_misses_a_later_batch_set_value_check_catches_it(pools):
    for r in pools(4).run(CASE, feed="mesh", bad_at=2):  # the default: batch 0 only
        assert r["epoch 0"]["error"] == "no error", r
    for r in pools(4).run(CASE, feed="mesh", check=True, bad_at=2):  # every batch
        for epoch in ("epoch 0", "epoch 1"):
            assert re.fullmatch(_shared_block_error(2), r[epoch]["error"]), r
            assert r[epoch]["taken"] == 2
