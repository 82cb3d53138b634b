"""Real multi-process JAX runs for tests: N fresh interpreters joined by ``jax.distributed``.

``JaxPool(n)`` starts ``n`` fresh interpreters running this file, each with ``8 // n`` CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count``), JAX's CPU collectives over gloo,
and ``jax.distributed.initialize`` on 127.0.0.1: one JAX job of 8 devices on this machine
(process 1 of 2 has JAX ids 2048-2051). They do not load ``conftest.py``. Each runs the cases
the test process sends it, one at a time and in lockstep with the others (a function of a
module of ``tests/``, named ``"module:function"``, which all processes call together);
``pool.run("module:case", **kwargs)`` returns one result per process.

Every wait is bounded: torchshard's exchanges by ``TORCHSHARD_JAX_TIMEOUT`` (a pool's
``exchange_timeout``), and the test process gives each case ``timeout`` seconds; a worker that
does not answer in time, or dies, brings the pool down, and the error carries the workers'
stderr. Messages travel as pickles over the workers' stdin/stdout pipes (the workers move their
own stdout to stderr first).

The coordinator's port: JAX's coordination service binds the port it is given and cannot
report one the kernel picked, so process 0 asks the kernel for a free port (binding port 0),
releases it and starts the service on it at once; the test process passes it to the others.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

EXCHANGE_TIMEOUT = 60.0  # seconds; shorter than a case's timeout, so hangs become errors
DEVICES = 8  # in all, over the processes
_STRIPPED_ENV = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS", "XLA_USE_SPMD", "JAX_PLATFORMS")


class WorkerError(RuntimeError):
    """A case raised on some process, or a worker died or did not answer in time."""


class JaxPool:
    """``n`` JAX processes, ``8 // n`` CPU devices each, running cases on request."""

    def __init__(
        self, n: int, *, timeout: float = 300.0, exchange_timeout: float = EXCHANGE_TIMEOUT
    ) -> None:
        self.n = n
        self.timeout = timeout
        self.broken = False
        self.closed = False
        self._procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        self._send: list[Connection] = []
        self._recv: list[Connection] = []
        base = {k: v for k, v in os.environ.items() if k not in _STRIPPED_ENV}
        base.update(
            OMP_NUM_THREADS="1",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES // n}",
            TORCHSHARD_JAX_TIMEOUT=str(exchange_timeout),
            JAX_WORLD=str(n),
            TF_CPP_MIN_LOG_LEVEL="2",
        )
        try:
            for rank in range(n):
                log = tempfile.TemporaryFile()
                proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=dict(base, JAX_RANK=str(rank)),
                )
                self._logs.append(log)
                self._procs.append(proc)
                self._send.append(Connection(os.dup(proc.stdin.fileno()), readable=False))
                self._recv.append(Connection(os.dup(proc.stdout.fileno()), writable=False))
            (port,) = self._collect("start-up: process 0's coordinator", ranks=1)
            for conn in self._send[1:]:
                conn.send_bytes(pickle.dumps(port))
            self._collect("start-up")
        except BaseException:
            self.close()
            raise

    def run(self, case: str, /, **kwargs: Any) -> list[Any]:
        """Runs ``case(**kwargs)`` on every process; returns the results, indexed by process."""
        if self.broken:
            raise WorkerError("the worker pool is down (an earlier case failed to finish)")
        blob = pickle.dumps((case, kwargs))
        for conn in self._send:
            conn.send_bytes(blob)
        return self._collect(case)

    def _collect(self, what: str, ranks: int | None = None) -> list[Any]:
        deadline = time.monotonic() + self.timeout
        results = []
        for rank, conn in enumerate(self._recv[:ranks]):
            problem = None
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    results.append(pickle.loads(conn.recv_bytes()))
                else:
                    problem = f"process {rank} did not answer in {self.timeout} s"
            except (EOFError, OSError) as e:
                problem = f"process {rank}: {e!r} (the worker died)"
            if problem is not None:
                self.broken = True
                raised = "".join(
                    f"--- process {r} raised ---\n{value}\n"
                    for r, (status, value) in enumerate(results)
                    if status != "ok"
                )
                logs = self._stderr()
                self.close()
                raise WorkerError(f"{what}: {problem}\n{raised}{logs}")
        failed = [(rank, value) for rank, (status, value) in enumerate(results) if status != "ok"]
        if failed:
            details = "\n".join(f"--- process {rank} ---\n{tb}" for rank, tb in failed)
            raise WorkerError(
                f"case {what} raised on process(es) {[r for r, _ in failed]}:\n{details}"
            )
        return [value for _, value in results]

    def _stderr(self, tail: int = 4000) -> str:
        out = []
        for rank, log in enumerate(self._logs):
            with contextlib.suppress(OSError, ValueError):
                log.seek(0)
                text = log.read().decode(errors="replace")
                out.append(f"--- process {rank} stderr ---\n{text[-tail:]}")
        return "\n".join(out)

    def close(self) -> None:
        """Stops the workers (asks first, then kills); idempotent."""
        self.closed = True
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_main() -> None:
    inp = Connection(os.dup(0), writable=False)
    out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # stray prints (gloo's, the cases') must not corrupt the channel
    rank, world = int(os.environ["JAX_RANK"]), int(os.environ["JAX_WORLD"])
    try:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if rank == 0:
            port = _free_port()
            out.send_bytes(pickle.dumps(("ok", port)))
        else:
            port = pickle.loads(inp.recv_bytes())
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=world,
            process_id=rank,
            initialization_timeout=120,
        )
        assert jax.process_count() == world and jax.device_count() == DEVICES
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
            case = getattr(importlib.import_module(module), fn)
            result = ("ok", case(**kwargs))
        except BaseException:  # noqa: BLE001 -- a process boundary: report, keep serving
            result = ("error", traceback.format_exc())
        out.send_bytes(pickle.dumps(result))
    # No jax.distributed.shutdown(): it waits at a barrier for every process, which a case that
    # left processes out of step would never reach; the test process ends the workers.


if __name__ == "__main__":
    _worker_main()
