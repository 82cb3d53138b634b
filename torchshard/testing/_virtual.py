"""Virtual hosts: one real process plays every host of a multi-host run.

``virtual_hosts(n)`` is a topology provider (``torchshard._core.topology.override_topology``):
the devices are split into ``n`` equal, contiguous groups of ids (device ``d`` belongs to host
``d // (devices / n)``), ``process_count()`` is ``n``, ``process_index()`` the given index, and
the topology's ``data_hosts`` lists every host, because this process supplies every host's
data. The per-host functions call the same engine as the real path (``read``/``plan``/``place``
and the read-back), with one tree per host; nothing in the production path branches on the
emulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from torchshard._backend.registry import lookup
from torchshard._core.checks import contiguous_hosts
from torchshard._core.context import current_mesh, require_mesh
from torchshard._core.errors import ShardingError
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.topology import Topology, override, override_topology
from torchshard._mesh.context import current_topology
from torchshard._place.call import read
from torchshard._place.host_to_global import warn_partition_type
from torchshard._place.place import to_global
from torchshard._place.readback import host_blocks

EMULATED_BACKEND = "xla"  # virtual hosts split torch_xla's devices, unless a mesh says otherwise


def make_virtual_topology(num_devices: int, num_hosts: int, process_index: int = 0) -> Topology:
    """The topology of ``num_hosts`` hosts with contiguous, equal groups of device ids, played
    by this one process (it supplies every host's data).

    Example:
        >>> from torchshard.testing import make_virtual_topology
        >>> make_virtual_topology(8, 2, 1).devices_of(1)
        (4, 5, 6, 7)
    """
    for name, value in (("num_hosts", num_hosts), ("process_index", process_index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"virtual_hosts: {name} must be an int, but got {value!r} of type "
                f"{type(value).__name__}; pass {name}={_as_int_hint(value)}."
            )
    num_hosts, process_index = int(num_hosts), int(process_index)
    owners = contiguous_hosts(num_devices, num_hosts, where="virtual_hosts")
    return Topology(
        process_index,
        num_hosts,
        owners,
        virtual=True,
        data_hosts=tuple(range(num_hosts)),
    )


def _as_int_hint(value: Any) -> str:
    """``value`` written as an int for the error's fix (``"2"`` -> ``2``), else ``"<int>"``."""
    try:
        return str(int(value))
    except (TypeError, ValueError):
        return "<int>"


def is_virtual() -> bool:
    """Whether a ``virtual_hosts`` emulation (any topology provider) is installed."""
    return override() is not None


@contextlib.contextmanager
def virtual_hosts(num_hosts: int, *, process_index: int = 0) -> Iterator[Topology]:
    """Emulates ``num_hosts`` hosts in this thread or asyncio task (nests).

    Per thread and per task, like ``with mesh:``: another thread sees its own topology (the
    runtime's, or its own ``virtual_hosts``), so threads may emulate different host counts at
    once, and a task sees the emulation of the code that created it. A ``GlobalBatchLoader``'s
    thread sees the emulation of the thread that started its epoch (``iter()``), as it sees
    its mesh.

    Inside, ``torchshard.host_to_global_array`` refuses a single tree (this process holds every
    host's devices, so it needs every host's data): use ``host_to_global_array_per_host`` and
    ``global_to_host_array_per_host``. The emulated devices are the current mesh's backend's
    (torch_xla's outside a mesh).

    Example:
        >>> from torchshard.testing import (
        ...     global_to_host_array_per_host, host_to_global_array_per_host, virtual_hosts
        ... )
        >>> mesh = torchshard.Mesh(np.arange(8), ("data",))
        >>> with virtual_hosts(2), mesh:
        ...     g = host_to_global_array_per_host([np.zeros((4, 2)), np.ones((4, 2))])
        ...     blocks = global_to_host_array_per_host(g)
        >>> g.shape, blocks[1].tolist()[0]
        (torch.Size([8, 2]), [1.0, 1.0])
    """
    installed = override()
    if installed is not None:  # nested: the outer emulation's devices
        backend, count = installed[0], installed[1].device_count
    else:
        mesh = current_mesh()
        backend = mesh.backend if mesh is not None else EMULATED_BACKEND
        count = current_topology(backend=backend).device_count
    topo = make_virtual_topology(count, num_hosts, process_index)
    with override_topology(topo, backend=backend):
        yield topo


def _require_virtual(caller: str) -> None:
    if not is_virtual():
        raise ShardingError(f"{caller} must be called inside torchshard.testing.virtual_hosts().")


def host_to_global_array_per_host(
    per_host_arrays: Sequence[Any],
    /,
    *,
    partition: Any = DEFAULT_PARTITION,
    global_shape: Any = None,
) -> Any:
    """``host_to_global_array`` with every host's tree given: ``per_host_arrays[h]`` is host
    ``h``'s block. Same validation and engine as the real path (``global_shape`` as there).

    Example:
        >>> from torchshard.testing import host_to_global_array_per_host, virtual_hosts
        >>> with virtual_hosts(2), torchshard.Mesh(np.arange(8), ("data",)):
        ...     g = host_to_global_array_per_host([np.arange(4), np.arange(4, 8)])
        ...     torchshard.replicate_to_local_data(g).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    _require_virtual("host_to_global_array_per_host")
    if not isinstance(per_host_arrays, (list, tuple)):
        raise TypeError(
            "per_host_arrays: expected a list with one tree per host, but got "
            f"{type(per_host_arrays).__name__}."
        )
    mesh = require_mesh("host_to_global_array_per_host")
    backend = lookup(mesh)
    topology = current_topology(mesh)
    warn_partition_type(partition, stacklevel=1)
    call = read(per_host_arrays, topology, partition, per_host=True, global_shape=global_shape)
    if backend.processes is not None:
        backend.processes.agree_begin(mesh, call, what=call.argname)()
    return to_global(mesh, backend, topology, call)


def global_to_host_array_per_host(global_arrays: Any, /) -> list[Any]:
    """Every host's ``global_to_host_array`` result, as a list indexed by host.

    Example:
        >>> from torchshard.testing import (
        ...     global_to_host_array_per_host, host_to_global_array_per_host, virtual_hosts
        ... )
        >>> with virtual_hosts(2), torchshard.Mesh(np.arange(8), ("data",)):
        ...     g = host_to_global_array_per_host([np.arange(4), np.arange(4, 8)])
        ...     [b.tolist() for b in global_to_host_array_per_host(g)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    _require_virtual("global_to_host_array_per_host")
    topo = current_topology(current_mesh())
    return host_blocks(global_arrays, list(range(topo.process_count)))
