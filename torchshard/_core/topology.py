"""The topology of a run: which process owns which device, which process this is, and whose data
this process supplies (the value, ``Topology``), and the emulations that stand in for a runtime.

A mesh's backend reports its topology (torch_xla: ``xr.process_index()`` and friends; a bound
mesh, ``torchshard.Mesh``, asks it). A *topology provider* may stand in for a backend:
``override_topology(topology, backend=...)`` installs one for the duration of a block (nests).
``torchshard.testing.virtual_hosts`` is such a provider: one real process then plays every
host, and its topology says so (``data_hosts`` lists every host), so the production code reads
each host's data from a list of per-host trees without knowing it is emulated.

Providers are per asyncio task or thread, like the mesh context (``_core/context.py``): a
stack in a ``ContextVar``, so two threads (or tasks) may emulate 2 and 4 hosts at once, and a
thread that installed none sees its runtime's topology. A helper thread working for another
(a loader's thread) takes the providers of the thread it works for: ``providers()`` there,
``installed(...)`` in the helper (``thread_mesh(mesh, providers=...)`` does both for a mesh).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Topology:
    """Device ownership of a multi-process run.

    Attributes:
        process_index: this process's index.
        process_count: the number of processes.
        device_process: ``device_process[d]`` is the index of the process that owns device ``d``.
        virtual: True for an emulation (``virtual_hosts``), where this one real process holds
            every device.
        data_hosts: the hosts whose data this process passes to ``host_to_global_array`` (one
            tree each, in this order) and reads back: ``(process_index,)`` by default; every
            host under the emulation.

    Example:
        >>> Topology(1, 2, (0, 0, 1, 1)).devices_of(1)
        (2, 3)
    """

    process_index: int
    process_count: int
    device_process: tuple[int, ...]
    virtual: bool = False
    data_hosts: tuple[int, ...] = ()

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
        if not self.data_hosts:
            object.__setattr__(self, "data_hosts", (self.process_index,))
        elif not set(self.data_hosts) <= set(range(self.process_count)):
            raise ValueError(
                f"data_hosts names processes {list(self.data_hosts)} outside "
                f"[0, {self.process_count})."
            )

    def __hash__(self) -> int:  # computed once: topologies key the plan cache of every call
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (
                    self.process_index,
                    self.process_count,
                    self.device_process,
                    self.virtual,
                    self.data_hosts,
                )
            )
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def device_count(self) -> int:
        """The number of devices of the whole run."""
        return len(self.device_process)

    def devices_of(self, process: int) -> tuple[int, ...]:
        """The device ids owned by ``process``, ascending."""
        return tuple(d for d, p in enumerate(self.device_process) if p == process)


Provider = tuple[str, Topology]  # (backend name, topology)

# The installed providers of this task or thread, innermost last: an immutable tuple per
# context (a task that copies its creator's context shares nothing it could mutate with it).
_PROVIDERS: contextvars.ContextVar[tuple[Provider, ...]] = contextvars.ContextVar(
    "torchshard_topology_providers", default=()
)


def emulated(backend: str) -> Topology | None:
    """The innermost provider's topology in this task or thread when it stands in for
    ``backend``, else ``None`` (the backend's own topology applies)."""
    stack = _PROVIDERS.get()  # the hot path: one ContextVar read
    if stack:
        name, topology = stack[-1]
        if name == backend:
            return topology
    return None


def override() -> Provider | None:
    """The innermost provider installed in this task or thread, ``(backend name, topology)``;
    ``None`` when none is."""
    stack = _PROVIDERS.get()
    return stack[-1] if stack else None


def providers() -> tuple[Provider, ...]:
    """This task's or thread's providers, innermost last: what a helper thread working for it
    installs (``installed``) to see the same topology."""
    return _PROVIDERS.get()


@contextlib.contextmanager
def installed(lent: tuple[Provider, ...]) -> Iterator[None]:
    """Makes ``lent`` (another thread's ``providers()``) this thread's providers for the
    block, then restores its own."""
    mine = _PROVIDERS.get()
    _PROVIDERS.set(lent)
    try:
        yield
    finally:
        _PROVIDERS.set(mine)


@contextlib.contextmanager
def override_topology(topology: Topology, *, backend: str = "xla") -> Iterator[Topology]:
    """Installs ``topology`` in this task or thread, for meshes of ``backend``, for the
    duration of the block (nests)."""
    entry = (backend, topology)
    _PROVIDERS.set((*_PROVIDERS.get(), entry))
    try:
        yield topology
    finally:
        # Remove this very entry (the innermost occurrence), not the first equal one: Topology
        # is a value type, and equal providers may be nested.
        stack = _PROVIDERS.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is entry:
                _PROVIDERS.set(stack[:i] + stack[i + 1 :])
                break
