"""accelerate (torchshard.integrations.accelerate): ``prepare`` passes a GlobalBatchLoader
through, refuses a DataLoader already sharded per process (accelerate would shard it again),
and prepares everything else as accelerate does. Skips without accelerate."""

import re

import pytest
import torch
from torch.utils.data import DataLoader

from torchshard._core.version import pip_install

accelerate = pytest.importorskip("accelerate", reason=f"needs accelerate: {pip_install('stacks')}")

import torchshard as ts  # noqa: E402
from torchshard.integrations.accelerate import prepare  # noqa: E402


@pytest.fixture(scope="module")
def accelerator():
    return accelerate.Accelerator(cpu=True)


def test_a_global_batch_loader_passes_through(accelerator):
    data = torch.arange(16.0).reshape(8, 2)
    sampler = ts.host_sampler(data, {"num_shards": 1, "shard_index": 0})
    loader = ts.GlobalBatchLoader(DataLoader(data, batch_size=2, sampler=sampler), local=True)
    model = torch.nn.Linear(2, 1)
    got_model, got_loader = prepare(accelerator, model, loader)
    assert got_loader is loader
    assert isinstance(got_model, torch.nn.Module)
    assert prepare(accelerator, loader) is loader


def test_a_dataloader_on_a_host_sampler_is_refused(accelerator):
    data = torch.arange(16.0).reshape(8, 2)
    sampler = ts.host_sampler(data, {"num_shards": 2, "shard_index": 1})
    inner = DataLoader(data, batch_size=2, sampler=sampler)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "prepare: objects[1] is a DataLoader that already reads shard 1 of 2 (its sampler "
            "is a DistributedSampler, e.g. torchshard.host_sampler's); accelerate would shard "
            "it again, so each process would see only part of its shard. Pass the "
            "torchshard.GlobalBatchLoader that wraps it instead"
        ),
    ):
        prepare(accelerator, torch.nn.Linear(2, 1), inner)
    # a DataLoader over the whole dataset is accelerate's to shard
    whole = DataLoader(data, batch_size=2)
    assert prepare(accelerator, whole) is not None


class Stream(torch.utils.data.IterableDataset):
    """A stream split per process with ``stream_shard`` (each process reads its own half)."""

    def __iter__(self):
        index, count = ts.stream_shard()
        yield from (torch.tensor([i]) for i in range(index, 8, count))


def test_a_stream_on_several_processes_is_refused(accelerator, monkeypatch):
    """accelerate would read process 0's half and hand it to both (or keep every 2nd batch of
    each half): refused on 2 processes (the 2-process run: examples/stacks/accelerate_ddp.py);
    on one process nothing is split."""
    stream = DataLoader(Stream(), batch_size=2)
    assert prepare(accelerator, stream) is not None
    monkeypatch.setattr(type(accelerator), "num_processes", property(lambda self: 2))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "prepare: objects[0] is a DataLoader over a stream (Stream, an IterableDataset) on 2 "
            "processes; accelerate would have process 0 read it and hand its batches to every "
            "process (dispatch_batches, its default for streams)"
        ),
    ):
        prepare(accelerator, stream)


def test_not_an_accelerator():
    with pytest.raises(
        TypeError, match=re.escape("prepare: expected an accelerate.Accelerator, but got str.")
    ):
        prepare("acc", torch.nn.Linear(2, 1))
