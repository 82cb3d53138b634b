"""The end-of-data and memory benchmark (benchmarks.ends): its source, each method's epoch
(steps, real examples, compilations), the RSS probe, a quick run, and its sizes on any device
count (no torch_xla needed for those)."""

import mmap

import pytest
import torch

from benchmarks import ends as bench
from torchshard._tools.bench import _report


@pytest.mark.xla
def test_rows_source_numbers_the_rows_of_the_epoch():
    source = bench.rows_source(2, 8, 3, 5)
    assert [b["x"].shape for b in source] == [(8, 3), (8, 3), (5, 3)]
    col = torch.cat([b["x"][:, 2] for b in source])
    assert torch.equal(col, torch.arange(21, dtype=torch.float32) / 1000)


@pytest.mark.xla
def test_each_method_runs_the_epoch_it_names(mesh8):
    import torch_xla

    import torchshard as ts

    source = bench.rows_source(3, 16, 4, 8)
    weight = torch.ones(4, 3).to(torch_xla.device())
    seen = {}
    for name, feed in bench.feeds(source, ts.P("data")).items():
        _, steps, examples, counts = bench.epoch(feed, weight)
        seen[name] = (steps, examples, len(counts))
    assert seen == {"pad": (4, 56, 4), "drop": (3, 48, 3), "as is": (4, 56, 4)}


@pytest.mark.xla
def test_pad_compiles_no_new_graph_at_the_end_and_as_is_does(mesh8):
    import torch_xla

    import torchshard as ts

    source = bench.rows_source(3, 16, 4, 8)
    feeds = bench.feeds(source, ts.P("data"))
    _, _, _, pad = bench.epoch(feeds["pad"], torch.ones(4, 29).to(torch_xla.device()))
    _, _, _, as_is = bench.epoch(feeds["as is"], torch.ones(4, 31).to(torch_xla.device()))
    assert pad[-1] == pad[0]
    assert as_is[-1] > as_is[0]


@pytest.mark.xla
def test_peak_rss_sees_an_allocation():
    # Fresh pages of an anonymous mapping, each written: the RSS must grow by them. (Not a numpy
    # array: late in a long test process malloc may hand back memory that is still resident,
    # and the RSS did not move; seen once in CI.)
    size = 64 * 2**20
    with bench.PeakRSS() as rss:
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
    assert rss.peak - rss.start >= 48 * 2**20
    block.close()


@pytest.mark.xla
def test_a_memory_epoch_in_a_fresh_process_reads_every_batch(mesh8):
    peaks = bench.memory_in_a_fresh_process([2**20, None], n=3, rows=64, cols=64, step_ms=1)
    assert len(peaks) == 2 and all(isinstance(p, int) and p >= 0 for p in peaks)


@pytest.mark.xla
def test_a_quick_run_records_every_figure(mesh8):
    _report.configure(quick=True)
    try:
        report = _report.Report()
        bench.run(report)
    finally:
        _report.configure(quick=False)
    methods = {f.method: f.value for f in report.figures}
    assert methods["pad: steps"] == methods["as is: steps"] == methods["drop: steps"] + 1
    assert methods["pad: graphs compiled after step 1"] == 0
    assert methods["as is: graphs compiled after step 1"] >= 1
    assert methods["pad: examples seen"] == methods["as is: examples seen"] == 3 * 64 + 24
    assert methods["drop: examples seen"] == 3 * 64
    assert {"pad", "drop", "as is"} <= set(methods)
    assert {(r.numerator, r.denominator) for r in report.ratios} == {
        ("pad", "drop"),
        ("pad", "as is"),
    }


@pytest.mark.parametrize("devices", [1, 3, 8, 512])
def test_every_size_splits_evenly(devices):
    for quick in (True, False):
        rows, _, _, short = bench.sizes(quick, devices)
        assert rows % devices == 0 and short % devices == 0 and short < rows


def test_on_8_devices_the_documented_sizes():
    assert bench.sizes(False, 8) == (bench.ROWS, bench.COLS, bench.BATCHES, bench.SHORT)
    assert bench.sizes(True, 8) == (64, 32, 3, 24)
