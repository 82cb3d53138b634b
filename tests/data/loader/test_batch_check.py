"""Checks on a stream of host batches (torchshard.data._loader.batch_check): the same structure,
shapes and dtypes in every batch, and an indivisible batch turned into an error that says which
dispatcher setting fixes it; through the loader, and BatchChecker and the helpers directly."""

import re

import numpy as np
import pytest
import torch
from data_helpers import FakeDispatcher

import torchshard as ts
from torchshard.data._loader.batch_check import BatchChecker, host_nbytes, indivisible_error
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


def test_inconsistent_shapes_name_the_batch_and_path(mesh42):
    source = [{"x": np.ones((8, 3), np.float32), "y": np.zeros(8)}] * 2
    source.append({"x": np.ones((8, 4), np.float32), "y": np.zeros(8)})
    it = iter(ts.GlobalBatchLoader(source))
    next(it), next(it)
    msg = (
        "GlobalBatchLoader: batch 2: batch['x'] has shape (8, 4) and dtype float32, but in "
        "batch 0 it had shape (8, 3) and dtype float32. Every batch must have the same "
        "structure, shapes and dtypes (each new shape compiles a new XLA step). For a short "
        "last batch, pass drop_last=True to the DataLoader, or pad it with a dispatcher "
        "(torchshard.InputDispatcher)."
    )
    with pytest.raises(ts.ShardingError) as info:
        next(it)
    assert str(info.value) == msg


def test_inconsistent_structure_names_the_batch(mesh42):
    source = [{"x": np.ones((8, 3))}, {"x": np.ones((8, 3)), "y": np.ones(8)}]
    it = iter(ts.GlobalBatchLoader(source))
    next(it)
    msg = (
        "GlobalBatchLoader: batch 1: batch has a different structure from the first batch "
        "(batch 0); expected PyTreeSpec({'x': *}), got PyTreeSpec({'x': *, 'y': *}). Every "
        "batch must have the same structure"
    )
    with pytest.raises(ts.errors.TreeStructureError) as info:
        next(it)
    assert str(info.value).startswith(msg)


def test_indivisible_batch_names_the_dispatcher_setting(mesh42):
    it = iter(ts.GlobalBatchLoader([{"x": np.ones((6, 2), np.float32)}]))
    msg = (
        "GlobalBatchLoader: batch 0: batch['x']: dim 0 has size 6, not divisible by 8 "
        "(axes ('data', 'model') of P(('data', 'model'),) on mesh {'data': 4, 'model': 2}); "
        "global shape (6, 2). Pad the batch to a multiple, or use torchshard.InputDispatcher to "
        "pad and drop the padding in the step.\n"
        "The global batch has 6 rows (6 per host x 1 host) at batch['x'], which do not split "
        "over the 8 shards of dim 0. Fix: pad every host's batch with dispatcher="
        "torchshard.InputDispatcher(6, global_physical_batch_size=8) and drop the padding in the "
        "step with dispatcher.physical_to_logical_batch(batch); or make the per-host batch size "
        "a multiple of 8."
    )
    with pytest.raises(ts.errors.IndivisibleError) as info:
        next(it)
    assert str(info.value) == msg


def test_indivisible_feature_dim_keeps_the_original_message(mesh42):
    source = [{"x": np.ones((8, 3), np.float32)}]
    it = iter(ts.GlobalBatchLoader(source, partition=ts.P(None, "model")))
    with pytest.raises(ts.errors.IndivisibleError) as info:
        next(it)
    assert str(info.value) == (
        "GlobalBatchLoader: batch 0: batch['x']: dim 1 has size 3, not divisible by 2 "
        "(axes ('model',) of P(None, 'model') on mesh {'data': 4, 'model': 2}); global shape "
        "(8, 3). Pad the batch to a multiple, or use torchshard.InputDispatcher to pad and drop "
        "the padding in the step."
    )


def test_indivisible_physical_batch_names_the_physical_size(mesh42):
    source = [{"x": np.ones((6, 2), np.float32)}]
    it = iter(ts.GlobalBatchLoader(source, dispatcher=FakeDispatcher(ts.P("data"))))
    msg = (
        "The dispatcher's physical batch has 6 rows (6 per host x 1 host) at batch['x'], which "
        "do not split over the 4 shards of dim 0: set the dispatcher's "
        "global_physical_batch_size to a multiple of 4 (e.g. 8)."
    )
    with pytest.raises(ts.errors.IndivisibleError) as info:
        next(it)
    assert str(info.value).endswith("\n" + msg)


def test_indivisible_with_virtual_hosts_counts_every_host(mesh42):
    sources = [[{"x": np.ones((3, 2), np.float32)}]] * 2
    with virtual_hosts(2):
        it = iter(global_batch_loader_per_host(sources))
        with pytest.raises(ts.errors.IndivisibleError) as info:
            next(it)
    assert str(info.value).endswith(
        "The global batch has 6 rows (3 per host x 2 hosts) at batch['x'], which do not split "
        "over the 8 shards of dim 0. Fix: pad every host's batch with dispatcher="
        "torchshard.InputDispatcher(6, global_physical_batch_size=8) and drop the padding in the "
        "step with dispatcher.physical_to_logical_batch(batch); or make the per-host batch size "
        "a multiple of 4."
    )


# -- BatchChecker and the helpers, directly -----------------------------------------------------


def test_the_first_batch_is_the_reference():
    check = BatchChecker()
    first = {"x": np.zeros((8, 2), np.float32), "y": [torch.zeros(8, dtype=torch.int64)]}
    check(first, batch=0)
    for n in range(1, 3):  # equal shapes and dtypes: nothing raised, numpy or torch alike
        check({"x": torch.zeros(8, 2), "y": [np.zeros(8, np.int64)]}, batch=n)


def test_a_new_shape_names_the_batch_the_path_and_the_reference_batch():
    check = BatchChecker()
    check({"x": np.zeros((8, 2), np.float32)}, batch=5)
    with pytest.raises(
        ts.ShardingError,
        match="^"
        + re.escape(
            "GlobalBatchLoader: batch 7: batch['x'] has shape (8, 2) and dtype float64, but in "
            "batch 5 it had shape (8, 2) and dtype float32. Every batch must have the same "
            "structure, shapes and dtypes (each new shape compiles a new XLA step). For a short "
            "last batch, pass drop_last=True to the DataLoader, or pad it with a dispatcher "
            "(torchshard.InputDispatcher)."
        )
        + "$",
    ):
        check({"x": np.zeros((8, 2))}, batch=7)


def test_a_leaf_that_is_not_an_array_is_shown_so():
    check = BatchChecker()
    check({"x": np.zeros(4)}, batch=0)
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "GlobalBatchLoader: batch 1: batch['x'] has not an array, but in batch 0 it had "
            "shape (4,) and dtype float64."
        ),
    ):
        check({"x": "text"}, batch=1)


def test_per_host_batches_are_named_by_host():
    check = BatchChecker()
    check({"x": np.zeros(4)}, batch=0, host=0)
    with pytest.raises(
        ts.errors.TreeStructureError,
        match=re.escape(
            "GlobalBatchLoader: batch 0: host_batches[1] has a different structure from the "
            "first batch (batch 0, host_batches[0]); expected PyTreeSpec({'x': *}), got "
            "PyTreeSpec([*])."
        ),
    ):
        check([np.zeros(4)], batch=0, host=1)
    with pytest.raises(
        ts.ShardingError, match=re.escape("batch 3: host_batches[1]['x'] has shape (5,)")
    ):
        check({"x": np.zeros(5)}, batch=3, host=1)


def test_host_nbytes_counts_every_array_leaf_of_every_host():
    trees = [
        {"a": np.zeros((4, 2), np.float32), "b": torch.zeros(3, dtype=torch.int64), "c": None},
        [torch.zeros(2, dtype=torch.bfloat16), "not an array"],
    ]
    assert host_nbytes(trees) == 4 * 2 * 4 + 3 * 8 + 2 * 2
    assert host_nbytes([]) == 0


@pytest.mark.xla
def test_indivisible_error_without_a_fix_keeps_the_message(mesh42):
    error = ts.errors.IndivisibleError("host_arrays['x']: dim 1 has size 3, not divisible by 2")
    out = indivisible_error(
        error,
        mesh=mesh42,
        spec_tree=ts.P(None, "model"),
        host_batch={"x": np.zeros((8, 3))},
        batch=4,
        dispatcher=False,
    )
    assert type(out) is ts.errors.IndivisibleError
    assert (
        str(out)
        == "GlobalBatchLoader: batch 4: host_arrays['x']: dim 1 has size 3, not divisible by 2"
    )
