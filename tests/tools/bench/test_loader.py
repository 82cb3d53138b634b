"""The input-pipeline benchmark (torchshard._tools.bench.loader): its host batches, the timed
loop, and the loop every method feeds (its case, its batches, its step on the mesh). The lab's
``loader_gil`` (the GIL-holding transfer) is tested in ``benchmarks/tests/test_loader_gil.py``."""

import time

import pytest
import torch

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


def test_the_loop_feeds_every_device_of_the_run_one_step_at_a_time(monkeypatch):
    import torchshard as ts

    monkeypatch.setattr(bench, "DEVICE_MS", 0.0)  # the step's sleep: nothing to wait for here
    loop = bench.make_loop()
    assert dict(loop.mesh.shape) == {"data": 8} and loop.spec == ts.P("data")
    assert loop.case == "[1024,1024] f32 (8,), step 0 ms device + sync"
    batches = list(loop.source())
    assert len(batches) == bench.STEPS + 8 and batches[8] is loop.pool[0]
    with loop.mesh:
        seconds, wait = bench.run_loop(
            (ts.host_to_global_array(b, partition=loop.spec) for b in batches), loop.step, 2
        )
    assert seconds >= wait >= 0
