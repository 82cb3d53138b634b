"""sharded_collate: global batches straight from a DataLoader with num_workers=0."""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
from data_helpers import FakeDispatcher, Rows, ids
from torch.utils.data import DataLoader, default_collate

import torchshard as ts
from torchshard.data import sharded_collate
from torchshard.errors import WorkerProcessError


def test_batches_are_global_and_equal_to_the_host_collate(mesh42):
    loader = DataLoader(Rows(32), batch_size=8, collate_fn=sharded_collate())
    host = list(DataLoader(Rows(32), batch_size=8))
    out = list(loader)
    assert len(out) == 4
    for h, g in zip(host, out, strict=True):
        assert g["x"].device.type == "xla"
        back = ts.global_to_host_array(g)
        assert torch.equal(back["x"], h["x"]) and torch.equal(back["id"], h["id"])
    spec = torch_xla._XLAC._get_xla_sharding_spec(out[0]["x"])
    assert spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def test_custom_collate_partition_type_and_tuples(mesh42):
    def as_tuple(examples):
        batch = default_collate(examples)
        return (batch["id"], batch["x"])

    collate = sharded_collate(as_tuple, partition=ts.DataPartitionType.REPLICATED)
    (first,) = list(DataLoader(Rows(8), batch_size=8, collate_fn=collate))
    assert type(first) is tuple
    assert torch_xla._XLAC._get_xla_sharding_spec(first[1]) == "{replicated}"
    assert ts.replicate_to_local_data(first[0]).tolist() == list(range(8))


def test_dispatcher_and_its_spec(mesh42):
    dispatcher = FakeDispatcher(ts.P("data"), add_key=True)
    collate = sharded_collate(dispatcher=dispatcher)
    out = list(DataLoader(Rows(16), batch_size=8, collate_fn=collate))
    assert dispatcher.calls == 2
    assert [ids(b) for b in out] == [list(range(8)), list(range(8, 16))]
    assert "__physical_to_logical_batch_dispatch" in out[0]
    spec = "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert torch_xla._XLAC._get_xla_sharding_spec(out[0]["x"]) == spec


def test_mesh_argument_without_a_current_mesh():
    mesh = ts.Mesh(np.arange(8), ("data",))
    (batch,) = DataLoader(Rows(8), batch_size=8, collate_fn=sharded_collate(mesh=mesh))
    with mesh:
        assert ids(batch) == list(range(8))


def test_no_mesh():
    msg = (
        "sharded_collate must be called inside `with mesh:`, but there is no current mesh in "
        "this thread. Create one with torchshard.create_device_mesh(...) and enter it."
    )
    with pytest.raises(ts.errors.NoMeshError, match=f"^{re.escape(msg)}$"):
        next(iter(DataLoader(Rows(8), batch_size=8, collate_fn=sharded_collate())))


def test_worker_processes_get_a_clear_error(mesh42):
    loader = DataLoader(Rows(16), batch_size=8, num_workers=1, collate_fn=sharded_collate())
    msg = (
        "sharded_collate: called in DataLoader worker process 0 of 1; XLA tensors cannot be made "
        "in worker processes. Either set num_workers=0, or keep a host collate_fn in the "
        "DataLoader and wrap it: torchshard.GlobalBatchLoader(DataLoader(..., num_workers=N)) "
        "transfers on a background thread of the main process."
    )
    # The DataLoader re-raises the worker's error in this process, with the worker's traceback.
    with pytest.raises(WorkerProcessError, match=re.escape(msg)):
        next(iter(loader))


@pytest.mark.parametrize(
    ("args", "kwargs", "msg"),
    [
        ((3,), {}, "collate_fn: expected a callable, but got int."),
        (
            (),
            {"dispatcher": object()},
            (
                "dispatcher: expected an input dispatcher (e.g. torchshard.InputDispatcher, with "
                "logical_to_physical_batch), but got object."
            ),
        ),
    ],
)
def test_bad_arguments(args, kwargs, msg):
    with pytest.raises(TypeError, match=f"^{re.escape(msg)}$"):
        sharded_collate(*args, **kwargs)
