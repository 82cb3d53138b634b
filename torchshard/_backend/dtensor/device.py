"""The device of a DTensor mesh on this process, and the rank grid TorchTPU lays out.

A ``DeviceMesh`` names a device *type* (``"cuda"``, ``"xpu"``, TorchTPU's ``"tpu"``,
``"cpu"``); the *index* is this process's current device of that type, which ``DeviceMesh``
itself sets when it is built (``LOCAL_RANK``, or ``rank % devices per host``) unless the program
set it first. torchshard reads it once, when a mesh is entered on the program's thread
(``Backend.prepare``), and a loader's thread makes it current before any copy (``bind_thread``),
as torch's own pin-memory thread does: the current device is per thread.

When torchshard builds the ``DeviceMesh`` itself (``create_device_mesh(backend="dtensor")``, a
mesh entered without one), the device type is the process's accelerator
(``torch.accelerator.current_accelerator()``) when the default process group serves it, else
``"cpu"`` (``device_type_for``). A device type's module (``torch.cuda``, ``torch.tpu``) is
``getattr(torch, type)``, as ``DeviceMesh`` finds it.

Only torch; no ``torch.distributed`` (the caller passes the backend's name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchshard._core.errors import ShardingError

CPU = "cpu"
# Process-group backends that serve only host memory: a mesh over them is a CPU mesh even on a
# machine with an accelerator.
_HOST_ONLY = frozenset({"gloo", "mpi"})


@dataclasses.dataclass(frozen=True, slots=True)
class MeshDevice:
    """This process's device of a mesh: its type and (for an accelerator) its index (a value:
    equal and hashed by both; not a tuple, whose ``index`` method the field would shadow)."""

    type: str
    index: int | None

    @property
    def is_cpu(self) -> bool:
        return self.type == CPU

    def as_torch(self) -> torch.device:
        """As a ``torch.device`` (only for a type torch knows, i.e. when data moves)."""
        if self.index is None:
            return torch.device(self.type)
        return torch.device(self.type, self.index)

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def accelerator_type() -> str | None:
    """The type of this process's accelerator (``torch.accelerator``), ``None`` without one."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    dev = acc.current_accelerator()
    return None if dev is None else dev.type


def device_type_for(backend: str, accelerator: str | None) -> str:
    """The device type of a ``DeviceMesh`` torchshard builds over a default process group
    whose backend is ``backend`` (``dist.get_backend()``), on a process whose accelerator is
    ``accelerator`` (``None``: none).

    - no accelerator: ``"cpu"``;
    - a per-device backend string (``"cpu:gloo,cuda:nccl"``): the accelerator when the string
      names a backend for it, else ``"cpu"``;
    - a host-only backend (``gloo``, ``mpi``): ``"cpu"`` (its collectives take host tensors);
    - any other backend (``nccl``, ``xccl``, ``hccl``, TorchTPU's ``tpu``, a registered
      third-party one): the accelerator.

    Example:
        >>> device_type_for("nccl", "cuda"), device_type_for("gloo", "cuda")
        ('cuda', 'cpu')
        >>> device_type_for("cpu:gloo,tpu:tpu", "tpu"), device_type_for("nccl", None)
        ('tpu', 'cpu')
    """
    if accelerator is None:
        return CPU
    name = str(backend).lower()
    if ":" in name:
        served = {part.split(":", 1)[0].strip() for part in name.split(",")}
        return accelerator if accelerator in served else CPU
    return CPU if name in _HOST_ONLY else accelerator


def device_module(device_type: str) -> Any:
    """The module of an accelerator type (``torch.cuda``, ``torch.xpu``, TorchTPU's
    ``torch.tpu``): what ``DeviceMesh`` uses to set the device."""
    module = getattr(torch, device_type, None)
    if module is None or not callable(getattr(module, "current_device", None)):
        raise RuntimeError(
            f"the mesh's device type is {device_type!r}, but torch has no module "
            f"torch.{device_type} with current_device()/set_device(); import the package that "
            "provides the device (e.g. TorchTPU) before entering the mesh."
        )
    return module


def current_device(device_type: str) -> MeshDevice:
    """This thread's current device of ``device_type`` (read at mesh entry)."""
    if device_type == CPU:
        return MeshDevice(CPU, None)
    return MeshDevice(device_type, int(device_module(device_type).current_device()))


def bind_thread(device: MeshDevice) -> None:
    """Makes ``device`` the calling thread's current device (nothing for the CPU): a helper
    thread's current device is otherwise the type's default (index 0), whatever the program's
    thread set."""
    if device.is_cpu or device.index is None:
        return
    device_module(device.type).set_device(device.index)


# -- TorchTPU's topology-aware layout ---------------------------------------------------------


def topology_aware(device_type: str) -> Callable[..., Any] | None:
    """TorchTPU's ``torch.tpu.distributed.topology_aware_mesh`` on a ``"tpu"`` mesh, else
    ``None`` (another device type, or TorchTPU absent)."""
    if device_type != "tpu":
        return None
    tpu = getattr(torch, "tpu", None)
    dist = getattr(tpu, "distributed", None)
    fn = getattr(dist, "topology_aware_mesh", None)
    return fn if callable(fn) else None


def ascending_grid(grid: np.ndarray, axis_names: tuple[str, ...], origin: str) -> np.ndarray:
    """``grid`` with the indices along each axis reordered so that the ranks ascend along every
    axis, or a ``ShardingError`` when no such reordering exists.

    Reordering the indices along an axis keeps which ranks share a line of every axis (the
    process groups of the mesh, which is what a topology-aware layout chooses) and changes only
    the mesh positions, which a mesh built here is free to choose. It exists exactly when every
    line along the axis orders its ranks the same way. (``DeviceMesh`` runs an axis's
    collectives in ascending rank order while DTensor places shards by mesh position: see
    ``dtensor._check_rank_order``.)

    Example:
        >>> ascending_grid(np.array([[3, 2], [1, 0]]), ("a", "b"), "layout").tolist()
        [[0, 1], [2, 3]]
    """
    out = np.asarray(grid)
    for k, name in enumerate(axis_names):
        lines = np.moveaxis(out, k, -1).reshape(-1, out.shape[k])
        order = np.argsort(lines[0], kind="stable")
        if not all((np.diff(line[order]) > 0).all() for line in lines):
            raise ShardingError(
                f"{origin} laid the ranks out as {np.asarray(grid).tolist()}: along mesh axis "
                f"{name!r} its lines order their ranks differently "
                f"({[line.tolist() for line in lines]}), so no reordering of the mesh positions "
                "makes them ascend. torch's DeviceMesh runs an axis's collectives in ascending "
                "rank order while DTensor places shards by mesh position, so such a mesh would "
                "misplace blocks. Pass devices= (or a HybridMeshShape) to create_device_mesh to "
                "choose the layout yourself."
            )
        out = np.take(out, order, axis=k)
    return out
