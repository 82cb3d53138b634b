"""Real multi-process runs for tests: N fresh interpreters joined by torch.distributed (gloo).

``WorkerPool(n)`` starts ``n`` fresh interpreters running this file. They do not load
``conftest.py`` (so never torch_xla): each initialises torch.distributed's default process
group over gloo (or the backend named by ``TORCHSHARD_TEST_PG``, e.g.
``cpu:gloo,cuda:nccl`` with one GPU per rank) on 127.0.0.1, then runs the cases the test
process sends it, one at a time and in lockstep with the others (a case is a function of
``tests/_dtensor_cases.py``, or of another module of ``tests/`` named as
``"module:function"``, which all ranks call together). The case modules live in ``tests/``
itself, beside this file, whatever folder the test that runs them is in: a worker runs this
file, so its ``sys.path[0]`` is ``tests/`` and the cases import by name.
``pool.run("case", **kwargs)`` returns one result per rank.

Every wait is bounded: the workers' collectives time out (``COLLECTIVE_TIMEOUT``, or a pool's
``collective_timeout``: tests of hangs use a pool of their own with a short one), and the test
process gives each case ``timeout`` seconds; a worker that does not answer in time, or dies,
brings the pool down, and the error carries the workers' stderr. Messages travel as pickles
over the workers' stdin/stdout pipes (the workers move their own stdout to stderr first).

Ports: rank 0 binds its TCPStore to port 0 and reports the port the kernel gave it, which the
test process passes on to the other ranks (and sets as their ``MASTER_PORT``). No port is
picked free and bound later (another process, say another pytest-xdist worker starting a pool
at the same moment, could take it in between), and each pool's store, keys included, is its
own.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

COLLECTIVE_TIMEOUT = 60.0  # seconds; shorter than a case's timeout, so hangs become errors
CASES_MODULE = "_dtensor_cases"
BACKEND_ENV = "TORCHSHARD_TEST_PG"  # the workers' process-group backend (default gloo)
_STRIPPED_ENV = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS", "XLA_USE_SPMD")


class WorkerError(RuntimeError):
    """A case raised on some rank, or a worker died or did not answer in time."""


class WorkerPool:
    """``n`` worker processes, one rank each, running cases on request."""

    def __init__(
        self,
        n: int,
        *,
        timeout: float = 240.0,
        env: dict[str, str] | None = None,
        collective_timeout: float = COLLECTIVE_TIMEOUT,
    ):
        self.n = n
        self.timeout = timeout
        self.broken = False
        self._procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        self._send: list[Connection] = []
        self._recv: list[Connection] = []
        base = {k: v for k, v in os.environ.items() if k not in _STRIPPED_ENV}
        base.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
        base.update(WORLD_SIZE=str(n), TORCHSHARD_TEST_COLLECTIVE_TIMEOUT=str(collective_timeout))
        base.update(env or {})
        try:
            for rank in range(n):
                log = tempfile.TemporaryFile()
                proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=dict(base, RANK=str(rank)),
                )
                self._logs.append(log)
                self._procs.append(proc)
                self._send.append(Connection(os.dup(proc.stdin.fileno()), readable=False))
                self._recv.append(Connection(os.dup(proc.stdout.fileno()), writable=False))
            (port,) = self._collect("start-up: rank 0's store", ranks=1)
            for conn in self._send[1:]:
                conn.send_bytes(pickle.dumps(port))
            self._collect("start-up")
        except BaseException:
            self.close()
            raise

    def run(self, case: str, /, **kwargs: Any) -> list[Any]:
        """Runs ``case(**kwargs)`` on every rank; returns the results, indexed by rank."""
        if self.broken:
            raise WorkerError("the worker pool is down (an earlier case failed to finish)")
        blob = pickle.dumps((case, kwargs))
        for conn in self._send:
            conn.send_bytes(blob)
        return self._collect(case)

    def run_some(self, case: str, /, **kwargs: Any) -> list[Any]:
        """``run``, for a case in which ranks exit on purpose: a rank that died gives ``None``
        (the pool is down afterwards); one that raised gives its traceback as a string."""
        if self.broken:
            raise WorkerError("the worker pool is down (an earlier case failed to finish)")
        blob = pickle.dumps((case, kwargs))
        for conn in self._send:
            conn.send_bytes(blob)
        deadline = time.monotonic() + self.timeout
        out: list[Any] = []
        for rank, conn in enumerate(self._recv):
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    self.broken = True
                    logs = self._stderr()
                    self.close()
                    raise WorkerError(f"{case}: rank {rank} did not answer\n{logs}")
                _, value = pickle.loads(conn.recv_bytes())
                out.append(value)
            except (EOFError, OSError):
                self.broken = True
                out.append(None)
        return out

    def _collect(self, what: str, ranks: int | None = None) -> list[Any]:
        """One result from each rank (from the first ``ranks`` only, if given)."""
        deadline = time.monotonic() + self.timeout
        results = []
        for rank, conn in enumerate(self._recv[:ranks]):
            problem = None
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    results.append(pickle.loads(conn.recv_bytes()))
                else:
                    problem = f"rank {rank} did not answer in {self.timeout} s"
            except (EOFError, OSError) as e:
                problem = f"rank {rank}: {e!r} (the worker died)"
            if problem is not None:
                self.broken = True
                # What the ranks before it raised (a rank 0 that failed after binding its store
                # leaves the others waiting for it): the cause, ahead of the logs.
                raised = "".join(
                    f"--- rank {r} raised ---\n{value}\n"
                    for r, (status, value) in enumerate(results)
                    if status != "ok"
                )
                logs = self._stderr()
                self.close()
                raise WorkerError(f"{what}: {problem}\n{raised}{logs}")
        failed = [(rank, value) for rank, (status, value) in enumerate(results) if status != "ok"]
        if failed:
            details = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in failed)
            raise WorkerError(f"case {what} raised on rank(s) {[r for r, _ in failed]}:\n{details}")
        return [value for _, value in results]

    def _stderr(self, tail: int = 4000) -> str:
        out = []
        for rank, log in enumerate(self._logs):
            with contextlib.suppress(OSError, ValueError):
                log.seek(0)
                text = log.read().decode(errors="replace")
                out.append(f"--- rank {rank} stderr ---\n{text[-tail:]}")
        return "\n".join(out)

    def close(self) -> None:
        """Stops the workers (asks first, then kills); idempotent."""
        for conn in self._send:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + 20
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for conn in self._send + self._recv:
            conn.close()
        for proc in self._procs:
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
        for log in self._logs:
            log.close()
        self._procs, self._send, self._recv, self._logs = [], [], [], []


class Pools:
    """One lazily started pool per world size (restarted if a case brought it down)."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, n: int) -> WorkerPool:
        pool = self._pools.get(n)
        if pool is None or pool.broken:
            pool = self._pools[n] = WorkerPool(n)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _worker_main() -> None:
    inp = Connection(os.dup(0), writable=False)
    out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # stray prints (gloo's, the cases') must not corrupt the channel
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get(BACKEND_ENV, "gloo")
    timeout = datetime.timedelta(seconds=float(os.environ["TORCHSHARD_TEST_COLLECTIVE_TIMEOUT"]))
    try:
        if "nccl" in backend:  # one GPU per rank, current before any DeviceMesh (torchrun's way)
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
        if rank == 0:  # the kernel picks the port as the store binds it (see the docstring)
            store = dist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
            out.send_bytes(pickle.dumps(("ok", store.port)))
        else:
            port = pickle.loads(inp.recv_bytes())  # rank 0's, from the test process
            store = dist.TCPStore("127.0.0.1", port, world, False, timeout)
        os.environ["MASTER_PORT"] = str(store.port)  # as torchrun sets it
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        cases = importlib.import_module(CASES_MODULE)
        out.send_bytes(pickle.dumps(("ok", rank)))
    except BaseException:  # noqa: BLE001 -- a process boundary: report, then stop
        out.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    while True:
        try:
            msg = pickle.loads(inp.recv_bytes())
        except EOFError:
            break
        if msg is None:
            break
        name, kwargs = msg
        try:
            module, _, fn = name.rpartition(":")
            case = getattr(importlib.import_module(module) if module else cases, fn)
            result = ("ok", case(**kwargs))
        except BaseException:  # noqa: BLE001 -- a process boundary: report, keep serving
            result = ("error", traceback.format_exc())
        out.send_bytes(pickle.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker_main()
