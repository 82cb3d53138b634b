"""Ctrl-C with the source blocked: seconds from SIGINT to the end of the process, a loop over
``GlobalBatchLoader`` against the plain loop over the same ``DataLoader``.

Each sample is a fresh Python process running a user's program (``PROGRAM``): the runtime set
up and a mesh entered (torch_xla's emulated devices, ``--devices N``), a ``DataLoader`` over a
dataset whose ``__getitem__`` blocks from the third batch on (a stuck read), and a loop that
takes the two batches there are and waits for the third. Once it waits, the process group gets
SIGINT, as a terminal's Ctrl-C sends it (the DataLoader's worker processes get it too; in the
last case only the main process, as ``kill -INT PID`` or a job scheduler sends it), and the
bench times the process's end. Methods: ``DataLoader loop`` (``for batch in source``, the
reference: the same program without torchshard's loader) and ``GlobalBatchLoader`` (``for
batch in GlobalBatchLoader(source, partition=P("data"))``). Cases:

- ``slow __getitem__``: ``num_workers=0``; the loader's thread is the one inside
  ``__getitem__``; the ``KeyboardInterrupt`` is not caught.
- ``forkserver workers stuck``: ``num_workers=2``, the ``forkserver`` context (the one the
  docs advise beside torch_xla's threads); not caught.
- ``... caught, then close()``: the same, the ``KeyboardInterrupt`` caught, then
  ``loader.close()`` (the plain loop: nothing to close), and the program returns normally.
- ``... SIGINT to the main process only``: the workers stay stuck; not caught.

Each (case, method) runs ``ROUNDS`` times, interleaved in a shuffled order; figures are the
best and median seconds, and the difference of the medians. Target: ``GlobalBatchLoader``
within ``TARGET_S`` (2 s) of the plain loop in every case. Before (issue 32): 13-24 s against
about 1 s. A process that does not end within ``LIMIT_S`` is killed and counted as that long.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report

NAME = "ctrl_c"
DESCRIPTION = "Ctrl-C with the source blocked: seconds to exit, GlobalBatchLoader vs DataLoader"
ROUNDS = 3
TARGET_S = 2.0
LIMIT_S = 120.0
SETTLE_S = 1.0  # from the loop's second batch to SIGINT: the loop is waiting by then
METHODS = ("DataLoader loop", "GlobalBatchLoader")
# case -> (num_workers, after the KeyboardInterrupt, SIGINT to the process group)
CASES: dict[str, tuple[int, str, bool]] = {
    "slow __getitem__": (0, "uncaught", True),
    "forkserver workers stuck": (2, "uncaught", True),
    "forkserver workers stuck, caught, then close()": (2, "close", True),
    "forkserver workers stuck, SIGINT to the main process only": (2, "uncaught", False),
}

PROGRAM = '''
import sys, threading
import numpy as np
from torch.utils.data import DataLoader, Dataset


class Stuck(Dataset):
    """Example i; from the third batch on, a read that never returns."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return 64 * self.rows

    def __getitem__(self, i):
        if i >= 2 * self.rows:
            threading.Event().wait(3600)
        return np.full(2, i, np.float32)


def main():
    method, workers, after, devices = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    import torchshard as ts

    ts.setup_cpu_emulation(devices)
    rows = devices * max(1, 8 // devices)
    context = {"multiprocessing_context": "forkserver"} if workers else {}
    source = DataLoader(Stuck(rows), batch_size=rows, num_workers=workers, **context)
    with ts.Mesh(np.arange(devices), ("data",)):
        ts.host_to_global_array(np.zeros((rows, 2), np.float32))  # the runtime runs in both
        if method == "GlobalBatchLoader":
            loop = ts.GlobalBatchLoader(source, partition=ts.P("data"))
        else:
            loop = source
        try:
            for i, _ in enumerate(loop):
                if i == 1:
                    print("waiting", flush=True)
        except KeyboardInterrupt:
            if after == "uncaught":
                raise
            if method == "GlobalBatchLoader":
                loop.close()
            print("closed", flush=True)


if __name__ == "__main__":
    main()
'''


def _env() -> dict[str, str]:
    """This checkout's torchshard first on the child's path."""
    import torchshard

    root = str(Path(torchshard.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def default_sigint() -> None:
    """In the child before its program starts: SIGINT's default action, as a terminal's job has
    it. A command started in the background by a shell without job control (``cmd &`` in a
    script, CI) ignores SIGINT, and its children inherit that: Python then installs no
    ``KeyboardInterrupt`` handler, and every program would ignore the bench's SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(
    argv: Sequence[str], *, group: bool = True, settle: float = SETTLE_S, limit: float = LIMIT_S
) -> dict:
    """Runs ``argv`` in a new process group (SIGINT at its default: ``default_sigint``), waits
    for its line ``waiting`` and ``settle`` seconds more, sends the group SIGINT
    (``group=False``: the process alone), and returns ``{"seconds": from SIGINT to its end,
    "returncode", "shown": whether its stderr shows the KeyboardInterrupt, "stdout", "stderr"
    (tail)}``; killed (and ``seconds`` = ``limit``) if it does not end within ``limit``."""
    child = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=default_sigint,
    )
    guard = threading.Timer(limit + 600.0, os.killpg, (child.pid, signal.SIGKILL))
    guard.start()  # (a child stuck before its loop)
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == "waiting":
                break
        time.sleep(settle)
        t0 = time.perf_counter()
        if group:
            os.killpg(child.pid, signal.SIGINT)
        else:
            os.kill(child.pid, signal.SIGINT)
        try:
            out, err = child.communicate(timeout=limit)
            seconds = time.perf_counter() - t0
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            seconds = limit
    finally:
        guard.cancel()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return {
        "seconds": seconds,
        "returncode": child.returncode,
        "shown": "KeyboardInterrupt" in err,
        "stdout": out,
        "stderr": err[-2000:],
    }


def expected(after: str, run: dict) -> str | None:
    """What is wrong with a run's ending, or ``None``: uncaught, the exit by SIGINT with the
    traceback shown; caught, a normal exit after ``closed``."""
    if after == "uncaught":
        if run["returncode"] == -signal.SIGINT and run["shown"]:
            return None
    elif run["returncode"] == 0 and "closed" in run["stdout"]:
        return None
    return f"exit status {run['returncode']}, stderr: {run['stderr'][-300:]!r}"


def run(report: Report) -> None:
    """Times every (case, method) ``ROUNDS`` times, interleaved; records the figures."""
    devices = _devices.device_count()
    rounds = 1 if report.quick else ROUNDS
    cases = dict(list(CASES.items())[:1]) if report.quick else CASES
    seconds: dict[tuple[str, str], list[float]] = {(c, m): [] for c in cases for m in METHODS}
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-ctrl-c-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(PROGRAM)
        for r in range(rounds):
            order = list(seconds)
            random.shuffle(order)
            for case, method in order:
                workers, after, group = cases[case]
                report.progress(f"ctrl_c: round {r + 1}/{rounds}, {case}, {method}")
                argv = [sys.executable, str(script), method, str(workers), after, str(devices)]
                out = interrupt(argv, group=group)
                seconds[(case, method)].append(out["seconds"])
                wrong = expected(after, out)
                if wrong is not None:
                    problems.append(f"{case}, {method}: {wrong}")
    mesh = f"({devices},)"
    for case in cases:
        label = f"{case}, mesh {mesh}"
        medians = {}
        for method in METHODS:
            samples = seconds[(case, method)]
            medians[method] = statistics.median(samples)
            report.figure(
                NAME, label, f"{method}: SIGINT to exit", min(samples), "s", median=medians[method]
            )
        late = medians["GlobalBatchLoader"] - medians["DataLoader loop"]
        report.figure(NAME, label, "GlobalBatchLoader - DataLoader loop (medians)", late, "s")
        verdict = "ok" if late <= TARGET_S else "MISSED"
        report.notes.append(
            f"ctrl_c: {case}: GlobalBatchLoader exits {late:+.2f} s after the plain loop "
            f"(medians of {rounds}; target <= {TARGET_S:g} s): {verdict}"
        )
    for problem in problems:
        report.notes.append(f"ctrl_c: an unexpected ending: {problem}")
