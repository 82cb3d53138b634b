"""The input-pipeline benchmark (torchshard._tools.bench.loader): its host batches, the timed
loop, the GIL-stall probe, the GIL-holding loader (which restores the backend's threshold) and
the engine transfer it times, checked against numpy slicing."""

import math
import time

import numpy as np
import pytest
import torch
from helpers import xla_shards

import torchshard as ts
from torchshard._tools.bench import loader as bench

pytestmark = pytest.mark.xla


def test_host_batches_are_distinct_and_seeded():
    a, b = bench.host_batches(3), bench.host_batches(3)
    assert len(a) == 3 and all(torch.equal(x["x"], y["x"]) for x, y in zip(a, b, strict=True))
    assert a[0]["x"].shape == (bench.ROWS, bench.COLS) and a[0]["x"].dtype == torch.float32
    assert [int(x["y"][0]) for x in a] == [0, 1, 2]
    assert not torch.equal(a[0]["x"], a[1]["x"])
    assert not torch.equal(a[0]["x"], bench.host_batches(1, seed=1)[0]["x"])


def test_run_loop_counts_steps_and_the_wait_in_next():
    class Slow:
        closed = False

        def __iter__(self):
            for i in range(5):
                time.sleep(0.01)
                yield i

        def close(self):
            Slow.closed = True

    seen = []
    seconds, wait = bench.run_loop(Slow(), seen.append, 3)
    assert seen == [0, 1, 2] and Slow.closed
    assert seconds >= wait >= 0.02
    drained = iter(range(10))
    bench.run_loop(drained, lambda b: None, 2)  # no close(): drained
    assert next(drained, None) is None


def test_gil_stall_of_a_transfer_that_releases_the_gil_is_small():
    stall = bench.gil_stall(lambda: time.sleep(0.001), 0.05)
    assert 0 <= stall < 0.05


def test_the_holding_loader_turns_the_gil_free_route_off_while_iterated(mesh8):
    from torchshard._backend.xla import backend as xla

    threshold = xla.GIL_FREE_MIN_BYTES
    loader = bench.HoldingLoader([{"x": np.arange(8)}] * 2, partition=ts.P("data"), prefetch=0)
    it = iter(loader)
    assert xla.GIL_FREE_MIN_BYTES == math.inf
    assert ts.replicate_to_local_data(next(it)["x"]).tolist() == list(range(8))
    loader.close()
    assert xla.GIL_FREE_MIN_BYTES == threshold


@pytest.mark.parametrize("background", [False, True])
def test_transfer_places_the_batch_as_the_spec_says(mesh8, background):
    batch = {"x": torch.arange(32.0).reshape(8, 4)}
    g = bench.transfer(batch, ts.P("data"), background)
    for d, (ranges, data) in xla_shards(g["x"]).items():
        assert ranges == ((d, d + 1), (0, 4)) and torch.equal(data, batch["x"][d : d + 1])


def test_transfer_needs_a_mesh():
    with pytest.raises(ts.errors.NoMeshError, match="transfer must be called inside"):
        bench.transfer({"x": np.zeros(8)}, ts.P("data"), False)
