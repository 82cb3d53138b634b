"""The runtime topology: which process owns which device, and which process this is.

In production the mesh's backend reports it (torch_xla: ``xr.process_index()`` and friends).
Tests replace it, process-wide, with ``torchshard.testing.virtual_hosts``: one real process then
plays every host, and the assembly code reads each host's data from a per-host list. The
topology is process-wide (not per thread) because it describes the process, and a loader's
background thread must see the same one as the thread that made the loader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torchshard._backend import get_backend

if TYPE_CHECKING:
    from torchshard._mesh import Mesh


@dataclasses.dataclass(frozen=True)
class Topology:
    """Device ownership of a multi-process run.

    Attributes:
        process_index: this process's index.
        process_count: the number of processes.
        device_process: ``device_process[d]`` is the index of the process that owns device ``d``.
        virtual: True for an emulation (``virtual_hosts``) where this one real process holds
            every device and supplies every host's data.
    """

    process_index: int
    process_count: int
    device_process: tuple[int, ...]
    virtual: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(
                f"process_index must be in [0, {self.process_count}), but got {self.process_index}."
            )
        owners = set(self.device_process)
        if not owners <= set(range(self.process_count)):
            raise ValueError(
                f"device_process names processes {sorted(owners)} outside "
                f"[0, {self.process_count})."
            )

    @property
    def device_count(self) -> int:
        """The number of devices of the whole run."""
        return len(self.device_process)

    def devices_of(self, process: int) -> tuple[int, ...]:
        """The device ids owned by ``process``, ascending."""
        return tuple(d for d, p in enumerate(self.device_process) if p == process)


class _Override:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stack: list[Topology] = []


_OVERRIDE = _Override()


def current_topology(mesh: Mesh | None = None) -> Topology:
    """The emulated topology if one is installed, else the one ``mesh``'s backend reports
    (without a mesh: the process's default backend, ``_backend.default_backend_name``)."""
    stack = _OVERRIDE.stack  # read without the lock (hot path): one list read, atomic
    if stack:
        try:
            return stack[-1]
        except IndexError:  # emptied by another thread between the two reads
            pass
    return get_backend(mesh).topology()


def is_virtual() -> bool:
    """Whether a ``virtual_hosts`` emulation is active."""
    return bool(_OVERRIDE.stack)


@contextlib.contextmanager
def override_topology(topology: Topology) -> Iterator[Topology]:
    """Installs ``topology`` process-wide for the duration of the block (nests)."""
    with _OVERRIDE.lock:
        _OVERRIDE.stack.append(topology)
    try:
        yield topology
    finally:
        with _OVERRIDE.lock:
            # Remove this very object (the innermost occurrence), not the first equal one:
            # Topology is a value type, and equal overrides may be nested or installed by
            # other threads.
            stack = _OVERRIDE.stack
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is topology:
                    del stack[i]
                    break


def process_index() -> int:
    """This process's index (the emulated one inside ``virtual_hosts``).

    Asked of the current mesh's backend; outside any mesh, of the process's default backend:
    torch_xla when it is imported, else DTensor once torch.distributed's default process group
    is initialised (the rank), else torch_xla.

    Example:
        >>> torchshard.process_index()   # rank 1 of a gloo job, no mesh entered
        1
    """
    return current_topology(_current_mesh()).process_index


def process_count() -> int:
    """The number of processes (hosts) of the run (emulated inside ``virtual_hosts``); asked
    of the same backend as ``process_index()``."""
    return current_topology(_current_mesh()).process_count


def _current_mesh() -> Mesh | None:
    from torchshard._mesh import current_mesh

    return current_mesh()
