"""Host memory for devices that live in it (torch_xla's CPU devices, the emulation): a call
whose device copies cannot fit is refused before anything moves (standard library only).

A replicated leaf gets one copy per device; on 8 emulated devices a 1 GiB leaf asks for 8 GiB
of host memory, and when that is not there XLA aborted the process ("thread creation failed"
under a 6 GiB address-space limit). ``check_fits`` compares a newly planned call's bytes with
what Linux says the process can still allocate: the address-space limit (``RLIMIT_AS``) less
the process's virtual size, and the machine's available memory and free swap. It runs when a
call is planned (plans are kept, so not per batch). Elsewhere than Linux it checks nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

from torchshard._core.blocks import HostPlan

_GIB = 1 << 30


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field: N kB`` line of ``/proc/...`` in bytes (``None``: not there)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def headroom() -> int | None:
    """The bytes this process can still allocate (``None``: unknown)."""
    bounds = []
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        size = _proc_kib(f"/proc/{os.getpid()}/status", "VmSize")
        if soft != resource.RLIM_INFINITY and size is not None:
            bounds.append(soft - size)
    except (ImportError, OSError, ValueError):
        pass
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        bounds.append(available + (_proc_kib("/proc/meminfo", "SwapFree") or 0))
    return min(bounds) if bounds else None


def plan_bytes(plan: HostPlan, itemsize: int) -> int:
    """The bytes of every device copy of one leaf's plan."""
    total = 0
    for piece in plan.pieces:
        shape = list(plan.shape_of(piece.owner) if plan.owner_shapes else plan.local_shape)
        for dim, _start, length in piece.cuts:
            shape[dim] = length
        total += math.prod(shape) * itemsize
    return total


def _size(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / (1 << 20):.1f} MiB"


def check_fits(
    argname: str,
    plans: Sequence[HostPlan | None],
    itemsizes: Sequence[int],
    path: Callable[[int], str],
) -> None:
    """Raises ``MemoryError`` when the device copies of a call exceed ``headroom()``; ``path``
    gives a leaf's path (for the error)."""
    sizes = [0 if p is None else plan_bytes(p, n) for p, n in zip(plans, itemsizes, strict=True)]
    need = sum(sizes)
    if need < 64 << 20:  # small calls: no system calls on the path
        return
    free = headroom()
    if free is None or need <= free:
        return
    big = max(range(len(sizes)), key=sizes.__getitem__)
    plan = plans[big]
    copies = 0 if plan is None else len(plan.pieces)
    raise MemoryError(
        f"{argname}: the devices of this process keep their buffers in host memory (torch_xla's "
        f"CPU devices), and this call's copies need {_size(need)}, but only {_size(free)} can "
        f"still be allocated (the address-space limit, ulimit -v, or the machine's free "
        f"memory); the largest leaf, {path(big)}, takes {_size(sizes[big])} in {copies} "
        "device copies. Shard large leaves over the mesh (e.g. P('data')) instead of "
        "replicating them, place smaller batches, or emulate fewer devices "
        "(torchshard.setup_cpu_emulation(n))."
    )
