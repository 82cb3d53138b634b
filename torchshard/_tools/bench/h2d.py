"""Host -> accelerator on the DTensor backend: torchshard against plain copies and the link.

Needs an accelerator (``torch.accelerator``: CUDA, XPU, TorchTPU's ``tpu``); without one it
records a one-line note and measures nothing. One process: a world-1 process group
(``cpu:gloo,<accelerator>:<its default backend>``) and a mesh ``(1,)`` over ``data`` built by
``create_device_mesh(backend="dtensor")``, so the whole batch is this process's block.

Methods, each to completion (``torch.accelerator.synchronize()``), in interleaved rounds:

- ``torchshard``: ``host_to_global_array`` (pinned staging ring, copy stream, event).
- ``.to(device)``: ``.to(device)`` of each block from pageable memory (synchronous).
- ``pinned non_blocking``: by hand, each block copied into a pinned buffer allocated once, then
  ``.to(device, non_blocking=True)``.
- ``link``: one pinned buffer of the batch's size to the device: the host -> device link's
  rate, which the others are compared with.

Cases: 1 and 8 leaves of a 64 MiB float32 batch (4 MiB with ``--quick``); figures in GB/s.

Then the loader: a ``GlobalBatchLoader`` (prefetch 2) feeds a step whose device work (matmuls,
calibrated) takes at least 3x the batch's transfer; the input wait (time in ``next()``) is
reported as a % of the step. Target: < 1%.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from torchshard._tools.bench._report import Report, measure

NAME = "h2d"
DESCRIPTION = "host -> accelerator (DTensor): torchshard vs .to() vs pinned non_blocking, GB/s"
MIB = 1 << 20
SIZE, QUICK_SIZE = 64 * MIB, 4 * MIB
STEPS, QUICK_STEPS = 40, 8
WAIT_TARGET = 0.01  # input wait / step


def accelerator() -> torch.device | None:
    """This process's accelerator, ``None`` without one."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    dev = acc.current_accelerator()
    if dev is None:
        return None
    return torch.device(dev.type, acc.current_device_index())


def run(report: Report) -> None:
    """Measures the methods and the loader's wait; a one-line note without an accelerator."""
    device = accelerator()
    if device is None:
        report.notes.append(
            "h2d: no accelerator (torch.accelerator.is_available() is False); nothing measured."
        )
        return
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        _init_world_of_one(device.type)
    try:
        _run(report, device)
    finally:
        if own_group:
            dist.destroy_process_group()


def _init_world_of_one(device_type: str) -> None:
    import datetime

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = dist.get_default_backend_for_device(device_type)
    dist.init_process_group(
        f"cpu:gloo,{device_type}:{name}",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    os.environ.setdefault("LOCAL_RANK", "0")


def _sync() -> None:
    torch.accelerator.synchronize()


def _run(report: Report, device: torch.device) -> None:
    import torchshard as ts

    size = QUICK_SIZE if report.quick else SIZE
    mesh = ts.create_device_mesh((1,), ("data",), backend="dtensor")
    rates: dict[int, float] = {}
    with mesh:
        for leaves in (1, 8):
            case = f"{size // MIB} MiB, {leaves} " + ("leaf" if leaves == 1 else "leaves")
            report.progress(f"h2d {case}")
            rows = size // leaves // 4 // 1024
            batch = {f"x{i}": torch.randn(rows, 1024) for i in range(leaves)}
            methods = _methods(batch, device)
            timings = measure(methods, rounds=11, min_seconds=0.05)
            gbs = report.throughput(NAME, case, timings, size)
            rates[leaves] = gbs["torchshard"]
            for method in ("torchshard", ".to(device)", "pinned non_blocking"):
                report.ratio(NAME, case, method, "link", gbs[method] / gbs["link"])
        _loader_wait(report, mesh, device, size, rates[1])


def _methods(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Callable[[], Any]]:
    import torchshard as ts

    pinned = {k: torch.empty_like(v, pin_memory=True) for k, v in batch.items()}
    link_src = torch.empty(sum(v.nbytes for v in batch.values()), dtype=torch.uint8)
    link_src = link_src.pin_memory()

    def torchshard() -> None:
        ts.host_to_global_array(batch)
        _sync()

    def to_device() -> None:
        for v in batch.values():
            v.to(device)
        _sync()

    def by_hand() -> None:
        for k, v in batch.items():
            pinned[k].copy_(v)
            pinned[k].to(device, non_blocking=True)
        _sync()

    def link() -> None:
        link_src.to(device, non_blocking=True)
        _sync()

    return {
        "torchshard": torchshard,
        ".to(device)": to_device,
        "pinned non_blocking": by_hand,
        "link": link,
    }


def _loader_wait(report: Report, mesh: Any, device: torch.device, size: int, rate: float) -> None:
    """A step whose device work is >= 3x the transfer, fed by a loader: input wait / step."""
    import torchshard as ts

    report.progress("h2d loader")
    transfer = size / (rate * 1e9)
    a = torch.randn(2048, 2048, device=device)
    a @ a
    _sync()
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    _sync()
    per_mm = (time.perf_counter() - t0) / 5
    matmuls = max(1, math.ceil(3 * transfer / per_mm))
    rows = size // 4 // 1024
    steps = QUICK_STEPS if report.quick else STEPS
    source = [{"x": torch.randn(rows, 1024)} for _ in range(4)]
    batches = [source[i % len(source)] for i in range(steps)]
    loader = ts.GlobalBatchLoader(batches, prefetch=2)
    waited = stepped = 0.0
    it = iter(loader)
    b = next(it)  # the first batch has nothing to overlap with
    for _ in range(steps - 1):
        t0 = time.perf_counter()
        y = a
        for _ in range(matmuls):
            y = y @ a
        b["x"].to_local().sum()
        _sync()
        t1 = time.perf_counter()
        b = next(it)
        t2 = time.perf_counter()
        stepped += t1 - t0
        waited += t2 - t1
    loader.close()
    del y, b
    case = f"{size // MIB} MiB batch, step {matmuls} matmuls"
    report.figure(NAME, case, "step / transfer", (stepped / (steps - 1)) / transfer, "x")
    report.figure(NAME, case, "input wait", 100 * waited / stepped, "% of step")
    report.ratio(NAME, case, "step", "input wait x100", stepped / max(100 * waited, 1e-12), 1.0)
    report.notes.append(
        f"h2d: loader input wait {100 * waited / stepped:.3f}% of the step (target < "
        f"{100 * WAIT_TARGET:g}%); the step's device work is "
        f"{(stepped / (steps - 1)) / transfer:.1f}x the transfer (>= 3x asked) on {device}."
    )
