"""The exchange torchshard ran through the default group's store until its exchange tree, kept
here as the baseline of ``benchmarks/exchange.py`` (the lab only; the package no longer has it).

Per exchange every process ``compare_set``s its call's digest against the first written for
the call, ``add``s itself to the call's arrival count, records its arrival (``set``), and waits
(``get``) for the verdict that the last to arrive writes (one ``multi_set``, which also resets
the slot of the exchange after next): 4N + 1 requests, all served by the one thread of the
store's server (rank 0's TCPStore).
"""

from __future__ import annotations

from typing import Any

from torchshard._core.agreement import digest

_BAD = 1 << 32
_SLOTS = 4


class StoreExchange:
    """One process's side of the store exchange (``store``: its own client of the server)."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.prefix = prefix
        self.n = 0
        self.requests = 0

    def exchange(self, what: str, items: list[str]) -> bool:
        """Whether every process passed the same ``[what, *items]``."""
        store, world = self.store, self.world
        self.n += 1
        n = self.n
        key = f"{self.prefix}main/{n}/"
        slot = f"{self.prefix}main/slot{n % _SLOTS}/"
        code = str(digest([what, *items]))
        store.set(f"{self.prefix}at/{self.rank}", f"{n}\t{what}")  # the arrival record
        differs = store.compare_set(slot + "d", "", code).decode() != code
        count = store.add(slot + "n", _BAD + 1 if differs else 1)
        self.requests += 3
        if count % _BAD == world:
            nxt = f"{self.prefix}main/slot{(n + 2) % _SLOTS}/"
            verdict = "bad" if count >= _BAD else "ok"
            store.multi_set([nxt + "d", nxt + "n", key + "done"], ["", "0", verdict])
            self.requests += 1
            if n > 2:
                store.delete_key(f"{self.prefix}main/{n - 2}/done")
                self.requests += 1
            return verdict == "ok"
        verdict = store.get(key + "done").decode()
        self.requests += 1
        return verdict == "ok"
