"""The exchange scale bench (benchmarks.exchange): both transports measured at 2 and 9
processes (their counts: the tree's messages per exchange O(fanout), one connection opened; the
store's 4N + 1 requests), the model's depth and fit, and the quick run's report."""

from __future__ import annotations

import pytest

from benchmarks import BENCHES, NEEDS_NO_XLA, exchange
from torchshard._tools.bench._report import Report


def test_the_registry_and_the_model():
    assert BENCHES["exchange"] == "benchmarks.exchange"
    assert exchange.NAME in NEEDS_NO_XLA
    assert exchange.depth(8192, 8, 8) == 5 and exchange.depth(2, 8, 8) == 1
    h, m = exchange.fit(t2=300e-6, tk=1000e-6, rtt=20e-6, fanout=8)
    assert h == pytest.approx(140e-6) and m == pytest.approx(100e-6)
    t = exchange.model(8192, h, m, 100e-6, 8)
    assert t == pytest.approx(5 * (100e-6 + 280e-6) + 7 * 5 * 100e-6)


@pytest.mark.parametrize("world", [2, 9])
def test_both_transports_at_small_sizes(world):
    tree = exchange.measure("tree", world, rounds=5)
    assert tree["median"] > 0 and tree["p99"] >= tree["median"]
    assert tree["connections (most)"] == world - 1  # the root's children (fanout 8)
    # per exchange, the busiest process (the root) receives and sends once per child (the
    # session's first exchange, the join, counted in)
    total = 5 + exchange.WARMUP
    assert 2 * (world - 1) <= tree["messages (busiest)"] <= 2 * (world - 1) * (total + 1) / total
    store = exchange.measure("store", world, rounds=5)
    # 4N + 1 requests per exchange (the first two have no verdict to delete)
    assert store["requests"] == pytest.approx(4 * world + 1 - 2 / total)
    assert store["server cpu per exchange"] >= 0


def test_the_quick_run_reports_the_fit_and_the_model(quick):
    report = Report(progress=lambda msg: None)
    exchange.run(report)
    cases = {(f.case, f.method) for f in report.figures}
    assert ("loopback", "round trip") in cases
    assert ("fit", "h (one hop's CPU)") in cases
    for n in exchange.MODEL_SIZES:
        assert (f"{n} processes (model)", "tree: per exchange") in cases
    assert report.notes[0].startswith("exchange: loopback")
