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

    def cpu(k):
        return 10e-6 * k

    # 8192 = 1024 hosts of 8: the leader's host, then 4 host levels (fanout 8); 15 children each
    t = exchange.model(8192, cpu, 100e-6, 20e-6, 8, 8)
    assert t == pytest.approx(20e-6 + 4 * 100e-6 + 5 * (150e-6 + 20e-6))
    assert exchange.model(2, cpu, 100e-6, 20e-6, 8, 1) == pytest.approx(100e-6 + 2 * 30e-6)
    assert exchange.store_model(512, 10e-6, 100e-6) == pytest.approx(2049 * 10e-6 + 100e-6)
    assert exchange.level_cpu(3, rounds=50) > 0


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
    # 4N + 1 requests per exchange (counted over the measured rounds, after the warm-up)
    assert store["requests"] == pytest.approx(4 * world + 1)
    assert store["server cpu per exchange"] >= 0


def test_the_quick_run_reports_the_fit_and_the_model(quick):
    report = Report(progress=lambda msg: None)
    exchange.run(report)
    cases = {(f.case, f.method) for f in report.figures}
    assert ("loopback", "round trip") in cases
    assert ("one level", "CPU for 8 children") in cases
    for n in exchange.MODEL_SIZES:
        assert (f"{n} processes (model)", "tree, fanout 8: per exchange") in cases
        assert (f"{n} processes (model)", "store: per exchange") in cases
    assert report.notes[0].startswith("exchange: loopback")
