"""Where a placing call may run (torchshard._place.guard): not in a DataLoader worker process,
not inside a torch.func transform."""

import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchshard as ts


def _collate_to_global(examples):
    return ts.host_to_global_array(np.stack(examples), partition=ts.P())


def test_a_dataloader_worker_is_refused_at_once(mesh8):
    """Before: a collate_fn calling host_to_global_array in a worker process hung with no
    outcome (180 s seen); now the worker raises at once and the DataLoader re-raises it."""
    dataset = [np.full(2, i, np.float32) for i in range(8)]
    loader = DataLoader(
        dataset,
        batch_size=8,
        num_workers=1,
        collate_fn=_collate_to_global,
        multiprocessing_context="fork",
        timeout=60,
    )
    with mesh8, pytest.raises(ts.errors.WorkerProcessError) as info:
        next(iter(loader))
    assert (
        "host_to_global_array: called in DataLoader worker process 0 of 1 (from a dataset or a "
        "collate_fn); global tensors cannot be made in worker processes, which reach neither "
        "the devices nor the other processes. Keep a host collate_fn in the DataLoader and "
        "wrap it: torchshard.GlobalBatchLoader(DataLoader(..., num_workers=N)) transfers on a "
        "thread of the main process (torchshard.sharded_collate() is for num_workers=0)."
    ) in str(info.value)
    # the fix the message names: the same collate on the main process's side
    loader = ts.GlobalBatchLoader(
        DataLoader(dataset, batch_size=8, num_workers=1, multiprocessing_context="fork"),
        partition=ts.P(),
    )
    with mesh8:
        (batch,) = list(loader)
        np.testing.assert_array_equal(ts.global_to_host_array(batch).numpy(), np.stack(dataset))


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_torch_func_transform_is_refused(mesh8, transform):
    """Before: the functorch-wrapped leaves reached the runtime (an obscure error)."""

    def f(x):
        ts.host_to_global_array({"x": x}, partition=ts.P())
        return x.sum()

    message = (
        "host_to_global_array: called inside a torch.func transform (grad, vmap, jacrev, ...), "
        "whose wrapped tensors are not host data. Place the data before the transform and pass "
        "the global tensors in."
    )
    fn = torch.func.grad(f) if transform == "grad" else torch.func.vmap(f)
    with mesh8, pytest.raises(RuntimeError, match=re.escape(message)):
        fn(torch.ones(8))


def test_calls_traced_by_torch_compile_run_eagerly(mesh8):
    """Before: tracing a step that placed its batch failed inside Dynamo ("AssertionError:
    unsafe constant ConstantVariable(bool: True)" from place.py). Now the placing and
    read-back calls break the graph and run eagerly; the traced rest still runs compiled."""
    seen = []

    @torch.compile(backend="eager", fullgraph=False)
    def step(x):
        batch = ts.host_to_global_array({"x": x * 2}, partition=ts.P("data"))
        seen.append(torch.compiler.is_compiling())
        host = ts.global_to_host_array(batch)
        full = ts.replicate_to_local_data(batch)
        return host["x"] + 1, full["x"]

    x = torch.arange(16.0).reshape(8, 2)
    with mesh8:
        host, full = step(x)
        again, _ = step(x + 1)  # the compiled step, run again: new values, not traced ones
    assert seen[0] is True  # it was traced
    torch.testing.assert_close(host, x * 2 + 1, rtol=0, atol=0)
    torch.testing.assert_close(full, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(again, (x + 1) * 2 + 1, rtol=0, atol=0)
    assert host.device.type == full.device.type == "cpu"
