"""Virtual hosts: one real process plays every host of a multi-host run.

Inside ``virtual_hosts(n)`` the devices are split into ``n`` equal, contiguous groups of ids
(device ``d`` belongs to host ``d // (devices / n)``), ``process_count()`` is ``n`` and
``process_index()`` the given index. The per-host functions go through the same assembly code
as the real path; the emulation only supplies every host's data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torchshard._assemble import DEFAULT_PARTITION, _assemble, _host_blocks
from torchshard._backend import backend_by_name, get_backend
from torchshard._errors import ShardingError
from torchshard._mesh import current_mesh
from torchshard._topology import Topology, current_topology, is_virtual, override_topology


def make_virtual_topology(num_devices: int, num_hosts: int, process_index: int = 0) -> Topology:
    """The topology of ``num_hosts`` hosts with contiguous, equal groups of device ids."""
    if num_hosts < 1 or num_devices % num_hosts:
        raise ValueError(
            f"virtual_hosts: num_hosts must be a positive divisor of the device count "
            f"{num_devices}, but got {num_hosts}."
        )
    per = num_devices // num_hosts
    return Topology(
        process_index, num_hosts, tuple(d // per for d in range(num_devices)), virtual=True
    )


@contextlib.contextmanager
def virtual_hosts(num_hosts: int, *, process_index: int = 0) -> Iterator[Topology]:
    """Emulates ``num_hosts`` hosts in this process (process-wide, nests).

    Example:
        >>> with virtual_hosts(2), mesh:
        ...     g = host_to_global_array_per_host([{"x": a0}, {"x": a1}])
        ...     blocks = global_to_host_array_per_host(g)  # [{"x": a0}, {"x": a1}]
    """
    if is_virtual():
        count = current_topology().device_count
    else:
        # The emulation is of torch_xla hosts: without a mesh, torch_xla's devices.
        mesh = current_mesh()
        count = (get_backend(mesh) if mesh else backend_by_name("xla")).topology().device_count
    topo = make_virtual_topology(count, num_hosts, process_index)
    with override_topology(topo):
        yield topo


def _require_virtual(caller: str) -> None:
    if not is_virtual():
        raise ShardingError(f"{caller} must be called inside torchshard.testing.virtual_hosts().")


def host_to_global_array_per_host(
    per_host_arrays: Sequence[Any], /, *, partition: Any = DEFAULT_PARTITION
) -> Any:
    """``host_to_global_array`` with every host's tree given: ``per_host_arrays[h]`` is host
    ``h``'s block. Same validation and assembly as the real path."""
    _check_per_host(per_host_arrays)
    return _assemble(  # directly: the deprecation warning's stack level counts the frames
        per_host_arrays,
        None,
        partition,
        caller="host_to_global_array_per_host",
        argname="per_host_arrays",
    )


def assemble_per_host(per_host_arrays: Sequence[Any], *, partition: Any, background: bool) -> Any:
    """``host_to_global_array_per_host`` for the per-host loader (``background``: on its
    thread, see ``Backend.make_global``)."""
    _check_per_host(per_host_arrays)
    return _assemble(
        per_host_arrays,
        None,
        partition,
        caller="host_to_global_array_per_host",
        argname="per_host_arrays",
        background=background,
    )


def _check_per_host(per_host_arrays: Any) -> None:
    _require_virtual("host_to_global_array_per_host")
    if not isinstance(per_host_arrays, (list, tuple)):
        raise TypeError(
            "per_host_arrays: expected a list with one tree per host, but got "
            f"{type(per_host_arrays).__name__}."
        )


def global_to_host_array_per_host(global_arrays: Any, /) -> list[Any]:
    """Every host's ``global_to_host_array`` result, as a list indexed by host."""
    _require_virtual("global_to_host_array_per_host")
    topo = current_topology()
    return _host_blocks(global_arrays, list(range(topo.process_count)), "global_arrays")
