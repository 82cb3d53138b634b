"""The context-parallel layouts' figure (torchshard._tools.bench.cp_balance): its tile count,
written from the mask, agrees with a brute-force count over the element mask and with PTRR's
own work per query block; a quick run reports every layout."""

import numpy as np

from torchshard._core.context_parallel import query_block_work
from torchshard._tools.bench import cp_balance as bench
from torchshard._tools.bench._report import Report, configure


def brute_force(ids, order, cp, block):
    n = len(ids)
    doc = np.cumsum(np.diff(ids, prepend=-1) != 0)
    orig = np.asarray(order)
    mask = (doc[orig][:, None] == doc[orig][None, :]) & (orig[None, :] <= orig[:, None])
    tiles = mask.reshape(n // block, block, n // block, block).any(axis=(1, 3))
    return tiles.sum(axis=1).reshape(cp, -1).sum(axis=1)


def test_tiles_equal_a_brute_force_count():
    rng = np.random.default_rng(0)
    block = bench.BLOCK
    for cp in (2, 4):
        n = 2 * block * cp
        ids = np.repeat(np.arange(1, 12), 2 * cp * rng.integers(1, 12, 11))[:n]
        ids = np.concatenate([ids, np.zeros(n - len(ids), dtype=ids.dtype)])
        for order in bench.orders(ids, cp).values():
            got = bench.tile_work(ids, order, cp, block)
            assert got.tolist() == brute_force(ids, order, cp, block).tolist()
        # one query block per "rank", the row as it comes: PTRR's work per query block
        blocks = n // block
        work = bench.tile_work(ids, np.arange(n), blocks, block)
        assert work.tolist() == query_block_work(ids, block).tolist()


def test_a_quick_run_reports_every_layout():
    configure(quick=True)
    try:
        report = Report()
        bench.run(report)
    finally:
        configure(quick=False)
    methods = {f.method for f in report.figures}
    assert {f"{lay} imbalance" for lay in bench.LAYOUTS} <= methods
    assert all(f.value >= 1 for f in report.figures if f.unit == "max/mean")
