"""The GIL-holding transfer's bench (benchmarks.loader_gil): the GIL-stall probe, the
GIL-holding loader (which restores the backend's threshold) and the engine transfer it times,
checked against numpy slicing."""

import math
import time

import numpy as np
import pytest
import torch
from helpers import xla_shards

import torchshard as ts
from benchmarks import BENCHES, loader_gil

pytestmark = pytest.mark.xla


def test_registered_in_the_lab():
    assert BENCHES["loader_gil"] == "benchmarks.loader_gil"
    assert loader_gil.HOLDING == "torchshard, GIL-holding transfer"


def test_gil_stall_of_a_transfer_that_releases_the_gil_is_small():
    stall = loader_gil.gil_stall(lambda: time.sleep(0.001), 0.05)
    assert 0 <= stall < 0.05


def test_the_holding_loader_turns_the_gil_free_route_off_while_iterated(mesh8):
    from torchshard._backend.xla import backend as xla

    threshold = xla.GIL_FREE_MIN_BYTES
    loader = loader_gil.HoldingLoader([{"x": np.arange(8)}] * 2, partition=ts.P("data"), prefetch=0)
    it = iter(loader)
    assert xla.GIL_FREE_MIN_BYTES == math.inf
    assert ts.replicate_to_local_data(next(it)["x"]).tolist() == list(range(8))
    loader.close()
    assert xla.GIL_FREE_MIN_BYTES == threshold


@pytest.mark.parametrize("background", [False, True])
def test_transfer_places_the_batch_as_the_spec_says(mesh8, background):
    batch = {"x": torch.arange(32.0).reshape(8, 4)}
    g = loader_gil.transfer(batch, ts.P("data"), background)
    for d, (ranges, data) in xla_shards(g["x"]).items():
        assert ranges == ((d, d + 1), (0, 4)) and torch.equal(data, batch["x"][d : d + 1])


def test_transfer_needs_a_mesh():
    with pytest.raises(ts.errors.NoMeshError, match="transfer must be called inside"):
        loader_gil.transfer({"x": np.zeros(8)}, ts.P("data"), False)
