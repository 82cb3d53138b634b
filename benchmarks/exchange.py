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
the CPU share (every process's CPU over 2 cores), not the protocol. On a pod every process has
its own core, and an exchange's time is its critical path: the deepest process's value goes up
to the root and the result comes down, through its host's leader and one leader per host level
(``depth`` links, a network round trip ``RTT`` per host link, a loopback one to the leader),
each leader spending the CPU of one level of ``k`` children (``level_cpu(k)``, measured here on
one thread: the children's frames read, parsed and merged, the result encoded and sent to each).
The store's model: ``(4N + 1)`` requests through its server's one thread at the CPU per request
measured here, plus a round trip. Figures past 512 processes are the model's, labelled so.
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
from collections.abc import Callable, Sequence
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
FANOUT = 8  # the tree's (torchshard._backend.exchange.session.FANOUT)
FANOUTS = (4, 8, 16)  # the shapes the model compares
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
    counts: dict[int, tuple[int, int, int, float]] = {}
    errors: list[str] = []
    prefix = f"{transport}/{world}/"
    # the process's CPU time over the measured rounds only (after every local rank's warm-up)
    warm = threading.Barrier(hi - lo + 1)
    done = threading.Barrier(hi - lo + 1)

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
            sent0, received0 = (s.node.sent, s.node.received) if transport == "tree" else (0, 0)
            requests0 = 0 if transport == "tree" else ex.requests
            warm.wait()
            mine = []
            for i in range(rounds):
                t0 = time.perf_counter()
                once(WARMUP + i)
                mine.append(time.perf_counter() - t0)
            done.wait()
            samples[rank] = mine
            if transport == "tree":
                node = s.node
                counts[rank] = (node.sent - sent0, node.received - received0, held, 0.0)
                s.close()
            else:
                counts[rank] = (ex.requests - requests0, 0, 1, 0.0)  # the measured rounds
        except Exception as e:  # noqa: BLE001 -- reported to the parent
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(lo, hi)]
    for t in threads:
        t.start()
    warm.wait()
    cpu0 = time.process_time()
    done.wait()
    cpu1 = time.process_time()
    for t in threads:
        t.join()
    return {
        "samples": {str(k): v for k, v in samples.items()},
        "counts": {str(k): v for k, v in counts.items()},
        "errors": errors,
        "cpu": cpu1 - cpu0,
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
        # CPU of every process over the measured rounds, per exchange and per process
        "cpu per process": sum(r["cpu"] for r in results) / rounds / world * 1e3,
    }
    if transport == "tree":
        out["messages (busiest)"] = max(s + r for s, r, _, _ in counts) / rounds
        out["connections (most)"] = max(c for _, _, c, _ in counts)
    else:
        out["requests"] = sum(s for s, _, _, _ in counts) / rounds
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


def level_cpu(children: int, rounds: int = 2000) -> float:
    """The CPU time one node spends per exchange for a level of ``children`` (seconds): each
    child's value read from its socket, parsed and merged, the result encoded and sent to each
    child, on one thread (no wake-ups: the wire and the scheduler are the model's RTT)."""
    from torchshard._backend.exchange import merge
    from torchshard._backend.exchange.node import Node, _Conn
    from torchshard._backend.exchange.tree import TreeShape
    from torchshard._backend.exchange.wire import encode

    node = Node(
        TreeShape(0, children + 1, fanout=max(2, children)),
        timeout=TIMEOUT,
        publish=lambda address: None,
        lookup=lambda rank, wait: "",
    )
    pairs = [socket.socketpair() for _ in range(children)]
    conns = []
    for c, (mine, theirs) in enumerate(pairs, start=1):
        conn = _Conn(mine, c)
        node._conns[c] = conn
        conns.append((conn, theirs))
    what = "GlobalBatchLoader: batch 12"
    frames = [
        encode(["U", "main.loader1", 0, 0, merge.agree_value(what, "123456789", [4, 0, 0], c)])
        for c in range(1, children + 1)
    ]
    t0 = time.thread_time()
    for i in range(rounds):
        pending = node.begin(
            ("main.loader1", i, 0), merge.agree_value(what, "123456789", [4, 0, 0], 0)
        )
        for (conn, theirs), frame in zip(conns, frames, strict=True):
            theirs.sendall(
                frame.replace(b"\x00\x00\x00\x00", i.to_bytes(4, "big"), 1) if False else frame
            )
            data = conn.sock.recv(1 << 16)
            for message in conn.reader.feed(data):
                message[2] = i
                node._handle(conn, message)
        pending.wait(1.0)
        for _, theirs in conns:
            theirs.recv(1 << 16)  # drain what was sent down
    spent = time.thread_time() - t0
    node.close()
    for mine, theirs in pairs:
        mine.close()
        theirs.close()
    return spent / rounds


# -- the model -------------------------------------------------------------------------------


def depth(world: int, fanout: int, local: int) -> int:
    from torchshard._backend.exchange.tree import depth as tree_depth

    return tree_depth(world, fanout, local if world % local == 0 else 1)


def model(
    world: int, cpu: Callable[[int], float], rtt: float, loop: float, fanout: int, local: int
) -> float:
    """The tree's time per exchange on a pod of ``world`` processes, ``local`` per host (one
    core each), seconds: the deepest process's value goes up and the result down through every
    leader on its path (the host's, then one per host level: ``depth`` links), each of which
    spends ``cpu(k)`` on a level of ``k`` children (its host's other processes and its child
    hosts' leaders); a host link costs a network round trip ``rtt`` (half each way), the link
    to the leader a loopback one (``loop``, which also stands for a thread's wake-up)."""
    local = local if world % local == 0 else 1
    hosts = depth(world, fanout, 1 if local == 1 else local) - (1 if local > 1 else 0)
    k = (local - 1) + min(fanout, max(1, world // local - 1))
    return (loop if local > 1 else 0.0) + hosts * rtt + (hosts + 1) * (cpu(k) + loop)


def store_model(world: int, per_request: float, rtt: float) -> float:
    """The store exchange on ``world`` processes: 4N + 1 requests through one server thread
    (``per_request`` seconds of its CPU each), plus a round trip."""
    return (4 * world + 1) * per_request + rtt


def run(report: Any) -> None:
    """Both transports at each size, the loopback RTT, one level's CPU per children count, and
    the model for pods (labelled)."""
    sizes = QUICK_SIZES if report.quick else SIZES
    rounds = QUICK_ROUNDS if report.quick else ROUNDS
    rtt = loopback_rtt(300 if report.quick else 2000)
    report.figure(NAME, "loopback", "round trip", rtt * 1e3, "ms")
    per_request = []
    for n in sizes:
        for transport in ("tree", "store"):
            report.progress(f"{NAME} {transport} {n} processes")
            got = measure(transport, n, rounds, FANOUT)
            if transport == "store":
                per_request.append(got["server cpu per exchange"] / got["requests"] / 1e3)
            for key, value in got.items():
                unit = "ms" if key in ("median", "p99") or "cpu" in key else "per exchange"
                if key.startswith("connections"):
                    unit = "connections"
                report.figure(NAME, f"{n} processes", f"{transport}: {key}", value, unit)
    counts = (1, 4, 8) if report.quick else (1, 2, 4, 8, 11, 15, 23, 39)
    cpus = {k: level_cpu(k, 300 if report.quick else 2000) for k in counts}
    for k, value in cpus.items():
        report.figure(NAME, "one level", f"CPU for {k} children", value * 1e3, "ms")

    def cpu(k: int) -> float:  # linear between the measured counts
        ks = sorted(cpus)
        lo = max([c for c in ks if c <= k], default=ks[0])
        hi = min([c for c in ks if c >= k], default=ks[-1])
        if lo == hi:
            return cpus[lo] if k == lo else cpus[lo] * k / lo
        return cpus[lo] + (cpus[hi] - cpus[lo]) * (k - lo) / (hi - lo)

    s = max(per_request) if per_request else 10e-6
    for n in MODEL_SIZES:
        case = f"{n} processes (model)"
        for fanout in FANOUTS:
            t = model(n, cpu, MODEL_RTT, rtt, fanout, LOCAL)
            report.figure(NAME, case, f"tree, fanout {fanout}: per exchange", t * 1e3, "ms")
        busiest = 2 * (LOCAL - 1 + FANOUT)
        report.figure(
            NAME, case, f"tree, fanout {FANOUT}: messages (busiest)", busiest, "per exchange"
        )
        report.figure(NAME, case, "store: per exchange", store_model(n, s, MODEL_RTT) * 1e3, "ms")
    report.notes.append(
        f"{NAME}: loopback, ranks as threads in OS processes (<= 16); the model (labelled): "
        f"{LOCAL} processes per host, {MODEL_RTT * 1e6:.0f} us round trips, one core per "
        "process, each level's CPU measured here (one level), the store's server CPU per request "
        "measured here"
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
