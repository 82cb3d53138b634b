"""torch_xla itself: its import (in SPMD mode), this process's devices and the run's topology,
and the one private call that builds a global tensor from CPU shards.

With ``env.py`` (the CPU emulation), the only modules that import torch_xla; torch_xla is
imported on first use, not with this module. Each call into torch_xla's private ``_XLAC`` API
sits in one small function, with the version it was checked on (torch_xla 2.9.0).
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend.xla.env import import_error, require_xla
from torchshard._core.topology import Topology

_INIT_LOCK = threading.Lock()

_DEVICE_RE = re.compile(r"^[A-Za-z_]+:(\d+)$")


@functools.cache
def xla() -> Any:
    """Imports torch_xla and switches it to SPMD mode (idempotent)."""
    require_xla("the xla backend (torch_xla SPMD)")
    try:
        import torch_xla
        import torch_xla.runtime as xr
    except ImportError as e:
        raise import_error("the xla backend (torch_xla SPMD)", e) from e

    with _INIT_LOCK:
        if not xr.is_spmd():
            xr.use_spmd()
    return torch_xla


def xs() -> Any:
    xla()
    import torch_xla.distributed.spmd as xs

    return xs


def xr() -> Any:
    xla()
    import torch_xla.runtime as xr

    return xr


def replace_get_global_mesh(reader: Callable[[], Any]) -> Callable[[], Any]:
    """Makes ``reader`` torch_xla's ``get_global_mesh``, where torch_xla's own calls and the
    program look it up when they run; returns torch_xla's own.

    torch_xla 2.9: ``xla_sharding.get_global_mesh()`` returns the module global
    ``_GLOBAL_MESH``; ``torch_xla.distributed.spmd`` re-exports it (``xs.get_global_mesh()``,
    FSDPv2, the Pallas kernels read it there), and ``enable_manual_sharding`` and
    ``disable_manual_sharding`` call it by its name in ``xla_sharding``."""
    spmd = xs()
    import torch_xla.distributed.spmd.xla_sharding as sharding

    original: Callable[[], Any] = sharding.get_global_mesh
    sharding.get_global_mesh = reader
    spmd.get_global_mesh = reader
    return original


def device_id(name: str) -> int:
    m = _DEVICE_RE.match(name)
    if m is None:
        raise RuntimeError(f"unexpected torch_xla device name {name!r}")
    return int(m.group(1))


@functools.cache
def cpu_devices() -> bool:
    """Whether this process's devices are torch_xla's CPU devices (buffers in host memory)."""
    return all(n.startswith("CPU:") for n in xla()._XLAC._xla_get_runtime_devices())


@functools.cache
def local_devices() -> tuple[int, ...]:
    # torch_xla 2.9: `_xla_get_runtime_devices()` lists this process's devices ("CPU:3",
    # "TPU:5"), in the order `_global_tensor_from_cpu_shards` takes their shards; the number is
    # the global ordinal that mesh device ids refer to.
    return tuple(device_id(n) for n in xla()._XLAC._xla_get_runtime_devices())


_TOPOLOGY_LOCK = threading.Lock()

_TOPOLOGY: list[Topology] = []  # computed once per process


def topology() -> Topology:
    """The run's topology, computed once per process (under a lock: with several processes
    it runs a collective, which must not run twice)."""
    if not _TOPOLOGY:
        with _TOPOLOGY_LOCK:
            if not _TOPOLOGY:
                _TOPOLOGY.append(_compute_topology())
    return _TOPOLOGY[0]


def _compute_topology() -> Topology:
    """One process: it owns every device. Several processes (multi-host TPU): torch_xla does
    not report which process owns a device (PJRT's device attributes carry no process index,
    and global ordinals need not be contiguous per host), so it is learnt with one collective
    (``_gather_device_owners``). That collective runs on the first call that needs the
    topology (entering a mesh, ``process_index()``, ...), which in an SPMD program every
    process makes. Not testable on one CPU host; kept deliberately small."""
    rt = xr()
    count = rt.global_runtime_device_count()
    nproc = rt.process_count()
    index = rt.process_index()
    if nproc == 1:
        return Topology(index, 1, (0,) * count)
    return Topology(index, nproc, _gather_device_owners(count))


def _gather_device_owners(count: int) -> tuple[int, ...]:
    """Every device's owning process, learnt with one tiny global tensor.

    Each process gives each of its local devices the row ``[process_index]`` of a
    ``[devices, 1]`` tensor split over all devices (row ``d`` lives on device ``d``), and reads
    the assembled value back (one all-gather, once per process).
    """
    spmd, rt = xs(), xr()
    local = local_devices()
    shard = torch.tensor([[rt.process_index()]], dtype=torch.int64)
    op = spmd.Mesh(np.arange(count), (count, 1)).get_op_sharding((0, 1))
    owners = global_tensor_from_cpu_shards([shard] * len(local), op, [count, 1])
    return tuple(int(v) for v in owners.cpu().reshape(-1).tolist())


def global_tensor_from_cpu_shards(
    shards: Sequence[torch.Tensor], op_sharding: Any, global_shape: list[int]
) -> torch.Tensor:
    """torch_xla 2.9: one CPU tensor per local device (a list or tuple; views are fine;
    ``local_devices`` order), the OpSharding and the global shape (a list); each device
    receives exactly its shard. The binding holds the GIL for the whole call: one host copy per
    shard (``AtenSource``: ``tensor.to(..., copy=True)``) and the PJRT transfer
    (``init_python_bindings.cpp``)."""
    return xla()._XLAC._global_tensor_from_cpu_shards(shards, op_sharding, global_shape)


def cpu_shards_binding() -> Callable[..., torch.Tensor]:
    """torch_xla 2.9's raw binding ``_XLAC._global_tensor_from_cpu_shards(shards, op_sharding,
    global_shape)`` itself (lists only), for a baseline that calls it by hand (the benchmarks)."""
    return xla()._XLAC._global_tensor_from_cpu_shards


def annotate_custom_sharding(x: torch.Tensor, op_sharding: Any) -> None:
    """Wraps ``x``'s IR value in a custom-sharding node (in place on ``x``).

    torch_xla 2.9: ``_xla_annotate_custom_sharding(tensor, op_sharding)`` sets the tensor's IR
    to ``custom_sharding(current IR)`` and its sharding spec, for device data and lazy IR alike,
    without the existing-annotation check of ``_xla_mark_sharding``. (``_xla_clear_sharding`` on
    device data only drops the spec: the data stays sharded, ``_get_local_shards`` then fails
    with "Tensor is not sharded", and a later ``_xla_mark_sharding`` downloads the whole value
    and uploads it again.)
    """
    xla()._XLAC._xla_annotate_custom_sharding(x, op_sharding)


# torch dtypes -> the type names of torch_xla's builder (xla_builder.Type), for bitcast.
_XLA_TYPES = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int16: "s16",
    torch.int32: "s32",
    torch.int64: "s64",
}


@functools.cache
def _bitcast_op() -> Any:
    """torch_xla 2.9: an op whose lowering is one XLA ``BitcastConvert``, registered once
    through ``xla_op_registry`` (each input shape's computation is built once and cached)."""
    xla()
    import torch_xla.core.xla_op_registry as xor

    return xor.register("torchshard_bitcast", lambda x, to: x.bitcast(to))


def bitcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x``'s bits as ``dtype`` (of the same width), traced into the step's graph.

    ``Tensor.view(dtype)`` does the same, but torch_xla 2.9 lowers it as a CPU fallback
    (``aten::view_copy.dtype``): the pending graph runs, the tensor goes to the host and back,
    and the step compiles again on every call."""
    return _bitcast_op()(x, to=_XLA_TYPES[dtype])
