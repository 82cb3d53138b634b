"""In-process exchange trees for tests: ``world`` sessions of torchshard's exchange tree
(``_backend.exchange``) in one process, each a node with its own sockets and I/O thread on
loopback, bootstrapped through an in-memory key-value store that counts its requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torchshard._backend.exchange.session import Session


class KV:
    """A key-value store: ``set``, and ``get`` that waits for the key (bounded)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.cond = threading.Condition()
        self.requests = 0

    def set(self, key: str, value: str) -> None:
        with self.cond:
            self.requests += 1
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self.cond:
            self.requests += 1
            while key not in self.data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no key {key!r} within {timeout:g} s")
                self.cond.wait(left)
            return self.data[key]


def sessions(
    world: int, *, timeout: float = 5.0, fanout: int = 3, local: int = 1, kv: KV | None = None
) -> tuple[list[Session], KV]:
    """``world`` sessions joined into one tree (made on threads: each waits for its parent)."""
    kv = kv or KV()
    out: list[Session | None] = [None] * world

    def make(r: int) -> None:
        out[r] = Session(
            r,
            world,
            timeout=timeout,
            kv_set=kv.set,
            kv_get=kv.get,
            host="127.0.0.1",
            local_size=local,
            fanout=fanout,
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(s is not None for s in out)
    return [s for s in out if s is not None], kv


def on_ranks(fn: Callable[[int], Any], ranks: Sequence[int], timeout: float = 60) -> list[Any]:
    """``fn(rank)`` on a thread per rank; each result, or the exception it raised."""
    results: list[Any] = [None] * len(ranks)

    def run(i: int, r: int) -> None:
        try:
            results[i] = fn(r)
        except Exception as e:  # noqa: BLE001 -- the result
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


def close(ss: Sequence[Session]) -> None:
    for s in ss:
        s.close()
