"""The machine a bench ran on (for the JSON and the README): cores, CPU model, RAM, versions."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from typing import Any


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _ram_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Cores usable by this process (``nproc``), CPU model, RAM, Python/torch/torch_xla."""
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "nproc": nproc,
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "torch_xla": _version("torch-xla"),
    }
