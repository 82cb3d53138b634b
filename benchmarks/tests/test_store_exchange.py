"""The store exchange baseline (benchmarks._store_exchange): on a real TCPStore, processes as
threads agree, a differing digest is a "bad" verdict on every process, and each exchange costs
the requests the module says."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from benchmarks._store_exchange import StoreExchange


def test_the_store_exchange_agrees_and_counts_its_requests():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    world, out = 3, {}

    def run(rank):
        store = dist.TCPStore("127.0.0.1", server.port, world, False, timedelta(seconds=30))
        ex = StoreExchange(store, rank, world, "t/")
        out[rank] = ([ex.exchange(f"c{i}", ["x" if i != 2 or rank else "y"]) for i in range(5)], ex)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for verdicts, _ in out.values():
        assert verdicts == [True, True, False, True, True]
    total = sum(ex.requests for _, ex in out.values())
    assert total == 5 * (4 * world + 1) - 2  # 4N + 1 each; the first two delete no verdict
