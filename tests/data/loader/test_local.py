"""GlobalBatchLoader(..., local=True) (torchshard.data._loader.local): on torch_xla the batches are
unchanged (its SPMD step takes global tensors); the DTensor side, on gloo processes, is in
tests/cross/test_stacks.py (local blocks equal to a DistributedSampler feed, the checks run on
the global batch)."""

import re

import numpy as np
import pytest
import torch

import torchshard as ts


def test_local_must_be_a_bool():
    with pytest.raises(TypeError, match=re.escape("local: expected a bool, but got 1.")):
        ts.GlobalBatchLoader([], local=1)


def test_xla_batches_are_the_global_ones(mesh42):
    source = [{"x": np.arange(16.0).reshape(8, 2)} for _ in range(2)]
    with ts.GlobalBatchLoader(source, local=True) as loader:
        epoch = iter(loader)
        got = list(epoch)
        epoch.close()  # the local epoch closes its epoch; closing again is fine
        epoch.close()
    assert len(got) == 2
    for b in got:
        assert b["x"].device.type == "xla" and tuple(b["x"].shape) == (8, 2)
        assert torch.equal(ts.replicate_to_local_data(b["x"]), torch.arange(16.0).reshape(8, 2))
