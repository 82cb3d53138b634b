"""The per-call overhead benchmark (torchshard._tools.bench.overhead): the raw binding on
``tensor_split`` views (the floor) places the batch as torchshard does, and the run records
microseconds per call and the ratios against the target, with the timing stubbed."""

import numpy as np
import pytest
import torch
from helpers import xla_shards

import torchshard as ts
from torchshard._tools.bench import overhead
from torchshard._tools.bench._report import Report

pytestmark = pytest.mark.xla


def test_split_views_places_dim_0_over_the_devices(mesh8):
    # 2-D leaves, as the bench's batches are (its sharding names dim 0 and dim 1)
    batch = {"a": torch.arange(32.0).reshape(16, 2), "b": torch.arange(24.0).reshape(8, 3)}
    out = overhead.split_views(mesh8, batch)()
    for k, g in out.items():
        index = ts.NamedSharding(mesh8, ts.P("data")).devices_indices_map(tuple(batch[k].shape))
        for d, (_, data) in xla_shards(g).items():
            assert torch.equal(data, batch[k][index[d]])


def test_run_records_microseconds_and_ratios(quick, stub_measure):
    stub_measure(overhead)
    report = Report()
    overhead.run(report)
    cases = ["4 KiB/host, 1 leaf", "4 KiB/host, 8 leaves"]
    methods = ["torchshard", "direct", overhead.SPLIT]
    assert [(f.case, f.method, f.unit) for f in report.figures] == [
        (c, m, "us/call") for c in cases for m in methods
    ]
    assert report.figures[0].value == pytest.approx(1e3)  # the best round: 1 ms
    assert report.figures[0].median == pytest.approx(2e3)
    assert [(r.case, r.denominator, r.target) for r in report.ratios] == [
        (c, d, t) for c in cases for d, t in (("direct", overhead.TARGET), (overhead.SPLIT, None))
    ]
    assert overhead.TARGET == 0.9 and overhead.QUICK_SIZES == (4 * 1024,)
    assert np.all([r.value == 1.0 for r in report.ratios])  # equal stubbed rounds
