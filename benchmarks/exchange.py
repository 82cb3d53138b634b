"""The exchanges between processes at scale: torchshard's exchange tree against the store
exchange it replaced, N = 2 to 512 simulated processes on one machine, and a model fitted to
them for 2,048 to 16,384 processes (docs/design.md, "The exchanges at pod scale").

**Measured.** N ranks run in ``workers`` OS processes (``N / workers`` ranks each, every rank a
thread with its own node: its own sockets and I/O thread, or its own store client), over the
real transports on loopback: the tree (``torchshard._backend.exchange``, bootstrapped through a
torch ``TCPStore``) and the store exchange (``_store_exchange.py``: 4N + 1 requests per
exchange through the one thread of the store's server, which the parent process hosts). Each
rank makes ``rounds`` exchanges back to back after a warm-up; a sample is one rank's time from
the exchange's begin to its verdict. Reported per N and transport: the median and p99 sample,
and for the tree the messages (frames sent and received) of the busiest process per exchange
and its connections (opened and accepted); for the store its requests per exchange and the
server's CPU time per exchange (the parent's).

**The model.** This machine has 2 cores for N processes, so past a few ranks the samples measure
the CPU share, not the protocol. On a pod every process has its own core, and an exchange is
``2 x depth`` one-way hops (up, then down): ``T(N) = depth(N) x (RTT + 2 h) + (fanout - 1) x
depth(N) x m``, with ``h`` the CPU time of one hop (a frame sent, the I/O thread woken, parsed,
merged, forwarded) and ``m`` that of one more child's frame at a node. ``h`` and ``m`` are fitted
from the runs at N = 2 (one hop each way) and N = 1 + fanout (one level, ``fanout`` children),
where the 2 cores are not the limit; the loopback RTT is measured by a ping-pong in the same
run. The store's model: ``(4N + 1) x s`` at the server, ``s`` its CPU per request here, plus a
round trip. Figures past 512 are the model's, labelled so.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

NAME = "exchange"
DESCRIPTION = (
    "the exchange tree against the store exchange, 2 to 512 simulated processes, and the model "
    "to 16,384 (100 us round trips)"
)
SIZES = (2, 9, 32, 128, 512)
QUICK_SIZES = (2, 9)
ROUNDS = 60
QUICK_ROUNDS = 15
WARMUP = 5
MODEL_SIZES = (2048, 8192, 16384)
MODEL_RTT = 100e-6  # seconds: a pod's network round trip, the figure
LOCAL = 8  # processes per host in the model (one per GPU, TorchTPU's per chip)
TIMEOUT = 120.0


def _workers_for(n: int) -> int:
    return max(1, min(16, n // 8)) if n > 2 else n


# -- one worker process ---------------------------------------------------------------------


def _worker(
    transport: str, port: int, world: int, lo: int, hi: int, rounds: int, fanout: int
) -> dict[str, Any]:
    """Ranks ``lo`` to ``hi - 1`` of ``world``, each on a thread: their samples and counts."""
    from datetime import timedelta

    import torch.distributed as dist

    from benchmarks._store_exchange import StoreExchange
    from torchshard._backend.exchange.session import Session

    def client() -> Any:
        return dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=TIMEOUT))

    samples: dict[int, list[float]] = {}
    counts: dict[int, tuple[int, int, int]] = {}
    errors: list[str] = []
    prefix = f"{transport}/{world}/"

    def rank_main(rank: int) -> None:
        try:
            store = client()
            if transport == "tree":

                def kv_set(key: str, value: str) -> None:
                    store.set(prefix + key, value)

                kv = client()  # the node's bootstrap reads on a client of its own

                def kv_get(key: str, wait: float) -> str:
                    kv.wait([prefix + key], timedelta(seconds=wait))
                    return kv.get(prefix + key).decode()

                s = Session(
                    rank,
                    world,
                    timeout=TIMEOUT,
                    kv_set=kv_set,
                    kv_get=kv_get,
                    host="127.0.0.1",
                    fanout=fanout,
                )

                def once(i: int) -> None:
                    s.exchange(f"call {i}", ["alike"], "bench")
            else:
                ex = StoreExchange(store, rank, world, prefix)

                def once(i: int) -> None:
                    ex.exchange(f"call {i}", ["alike"])

            for i in range(WARMUP):
                once(i)
            held = s.node.connections if transport == "tree" else 1  # all joined, none gone
            mine = []
            for i in range(rounds):
                t0 = time.perf_counter()
                once(WARMUP + i)
                mine.append(time.perf_counter() - t0)
            samples[rank] = mine
            if transport == "tree":
                node = s.node
                counts[rank] = (node.sent, node.received, held)
                s.close()
            else:
                counts[rank] = (ex.requests, 0, 1)
        except Exception as e:  # noqa: BLE001 -- reported to the parent
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(lo, hi)]
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "samples": {str(k): v for k, v in samples.items()},
        "counts": {str(k): v for k, v in counts.items()},
        "errors": errors,
        "cpu": time.process_time() - cpu0,
    }


# -- the parent ------------------------------------------------------------------------------


def measure(transport: str, world: int, rounds: int = ROUNDS, fanout: int = 8) -> dict[str, float]:
    """One transport at ``world`` ranks: median and p99 sample (ms), the busiest process's
    messages per exchange and connections (tree), requests per exchange and the server's CPU
    per exchange (store)."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=TIMEOUT))
    port = server.port
    workers = _workers_for(world)
    bounds = [world * w // workers for w in range(workers + 1)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                (
                    "import json, sys; from benchmarks.exchange import _worker; "
                    f"print(json.dumps(_worker({transport!r}, {port}, {world}, {bounds[w]}, "
                    f"{bounds[w + 1]}, {rounds}, {fanout})))"
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        for w in range(workers)
    ]
    results = []
    for p in procs:
        printed, err = p.communicate(timeout=TIMEOUT * 4)
        if p.returncode != 0:
            raise RuntimeError(f"exchange bench worker failed ({p.returncode}): {err[-2000:]}")
        results.append(json.loads(printed.strip().splitlines()[-1]))
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    errors = [e for r in results for e in r["errors"]]
    if errors:
        raise RuntimeError("exchange bench: " + "; ".join(errors[:4]))
    samples = sorted(x for r in results for v in r["samples"].values() for x in v)
    counts = [tuple(c) for r in results for c in r["counts"].values()]
    total = rounds + WARMUP
    out = {
        "median": statistics.median(samples) * 1e3,
        "p99": samples[min(len(samples) - 1, int(0.99 * len(samples)))] * 1e3,
        "cpu per exchange": sum(r["cpu"] for r in results) / total * 1e3,
    }
    if transport == "tree":
        out["messages (busiest)"] = max(s + r for s, r, _ in counts) / total
        out["connections (most)"] = max(c for _, _, c in counts)
    else:
        out["requests"] = sum(s for s, _, _ in counts) / total
        server_cpu = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
        out["server cpu per exchange"] = server_cpu / total * 1e3
    del server
    return out


def loopback_rtt(rounds: int = 2000) -> float:
    """The round trip of a small frame between two threads over a loopback TCP connection,
    Python on both ends (seconds, median)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(64):
            conn.sendall(data)
        conn.close()

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        c.sendall(b"x" * 32)
        c.recv(64)
        out.append(time.perf_counter() - t0)
    c.close()
    t.join(5)
    server.close()
    return statistics.median(out)


# -- the model -------------------------------------------------------------------------------


def depth(world: int, fanout: int, local: int) -> int:
    from torchshard._backend.exchange.tree import depth as tree_depth

    return tree_depth(world, fanout, local if world % local == 0 else 1)


def fit(t2: float, tk: float, rtt: float, fanout: int) -> tuple[float, float]:
    """``(h, m)`` from the medians at N = 2 (``t2``) and N = 1 + fanout (``tk``), seconds."""
    h = max(0.0, (t2 - rtt) / 2)
    m = max(0.0, (tk - t2) / (fanout - 1))
    return h, m


def model(world: int, h: float, m: float, rtt: float, fanout: int, local: int = LOCAL) -> float:
    """The exchange's time on a pod of ``world`` processes (``local`` per host), seconds."""
    d = depth(world, fanout, local)
    return d * (rtt + 2 * h) + (fanout - 1) * d * m


def run(report: Any) -> None:
    """Both transports at each size, the loopback RTT, the fit and the model."""
    sizes = QUICK_SIZES if report.quick else SIZES
    rounds = QUICK_ROUNDS if report.quick else ROUNDS
    fanout = 8
    rtt = loopback_rtt(300 if report.quick else 2000)
    report.figure(NAME, "loopback", "round trip", rtt * 1e3, "ms")
    medians: dict[int, float] = {}
    for n in sizes:
        for transport in ("tree", "store"):
            report.progress(f"{NAME} {transport} {n} processes")
            got = measure(transport, n, rounds, fanout)
            if transport == "tree":
                medians[n] = got["median"] / 1e3
            for key, value in got.items():
                unit = "ms" if key in ("median", "p99") or "cpu" in key else "per exchange"
                if key.startswith("connections"):
                    unit = "connections"
                report.figure(NAME, f"{n} processes", f"{transport}: {key}", value, unit)
    if 2 in medians and 1 + fanout in medians:
        h, m = fit(medians[2], medians[1 + fanout], rtt, fanout)
        report.figure(NAME, "fit", "h (one hop's CPU)", h * 1e3, "ms")
        report.figure(NAME, "fit", "m (one more child's frame)", m * 1e3, "ms")
        for n in MODEL_SIZES:
            t = model(n, h, m, MODEL_RTT, fanout)
            report.figure(NAME, f"{n} processes (model)", "tree: per exchange", t * 1e3, "ms")
            report.figure(
                NAME,
                f"{n} processes (model)",
                "tree: messages (busiest)",
                2 * (fanout + LOCAL - 1 + 1),
                "per exchange",
            )
    report.notes.append(
        f"{NAME}: loopback, ranks as threads in OS processes (<= 16), fanout {fanout}; the model "
        f"(labelled): {LOCAL} processes per host, {MODEL_RTT * 1e6:.0f} us round trips, h and m "
        "fitted at N = 2 and 1 + fanout"
    )


def main(argv: Sequence[str]) -> None:  # python benchmarks/exchange.py 2,9,32 [rounds]
    sizes = [int(n) for n in argv[0].split(",")] if argv else list(SIZES)
    rounds = int(argv[1]) if len(argv) > 1 else ROUNDS
    print(f"loopback rtt {loopback_rtt() * 1e3:.3f} ms")
    for n in sizes:
        for transport in ("tree", "store"):
            got = measure(transport, n, rounds)
            print(n, transport, json.dumps({k: round(v, 3) for k, v in got.items()}), flush=True)
    print("depth at 8192:", depth(8192, 8, LOCAL), math.log(8192, 8))


if __name__ == "__main__":
    main(sys.argv[1:])
