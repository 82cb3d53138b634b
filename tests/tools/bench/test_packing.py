"""The packing bench (torchshard._tools.bench.packing): its documents, its padding figure, and a
quick run through the command line's report (the loader's part on emulated devices)."""

import numpy as np
import pytest

from torchshard._tools.bench import packing as bench
from torchshard._tools.bench._report import Report, configure


def test_documents_are_seeded_and_log_normal_around_1_5k():
    a, b = bench.lognormal_documents(2000, 8192), bench.lognormal_documents(2000, 8192)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    lengths = np.array([len(d) for d in a])
    assert lengths.max() <= 8192 and 1200 < np.median(lengths) < 1800
    assert a[0].dtype == np.int32


def test_padding_counts_positions_without_a_document():
    batch = {"segment_ids": np.array([[1, 1, 0, 0], [1, 2, 2, 2]])}
    last = {"segment_ids": np.zeros((2, 4), dtype=int)}
    assert bench.padding([batch, last]) == 0.25  # the last batch is left out


@pytest.mark.xla
def test_a_quick_run_reports_every_method_and_the_wait():
    configure(quick=True)
    try:
        report = Report()
        bench.run(report)
    finally:
        configure(quick=False)
    methods = {f.method for f in report.figures}
    assert {"best_fit", "first_fit", "concat_split", "input wait"} <= methods
    assert all(f.value >= 0 for f in report.figures)
