"""The device and staging machinery of the DTensor backend without an accelerator: a stub
device module and a CPU driver for the staging ring, and the gloo cases that use them (run on
every rank by ``_multiproc.py``; pure torch, no torch_xla).

``FakeDeviceModule`` plays ``torch.<type>`` (``current_device``/``set_device``, per thread, as
CUDA's current device is). ``FakeDriver`` plays ``staging.Driver`` on the CPU: pinned buffers
are plain tensors (counted), the "device" copy is a clone that records which thread made it,
that thread's current device and the buffer it read, and events are numbered.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class FakeDeviceModule:
    """``torch.<type>`` for a device type that does not exist: a per-thread current device."""

    def __init__(self, default: int | None = None) -> None:
        self._local = threading.local()
        self.default = default
        self.calls: list[tuple[str, int]] = []  # (thread name, index) of every set_device

    def current_device(self) -> int | None:
        return getattr(self._local, "index", self.default)

    def set_device(self, index: int) -> None:
        self.calls.append((threading.current_thread().name, int(index)))
        self._local.index = int(index)


class FakeEvent:
    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"FakeEvent({self.n})"


class FakeDriver:
    """``staging.Driver`` on the CPU; ``log`` records every operation in order."""

    def __init__(self, device: Any = None, module: FakeDeviceModule | None = None) -> None:
        self.device = device
        self.module = module
        self.log: list[tuple[Any, ...]] = []
        self.events = 0
        self.copies: list[dict[str, Any]] = []

    def pinned(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.log.append(("pinned", nbytes, t.data_ptr()))
        return t

    def to_device(self, pinned: torch.Tensor) -> torch.Tensor:
        self.copies.append(
            {
                "thread": threading.current_thread().name,
                "current": None if self.module is None else self.module.current_device(),
                "src": pinned.data_ptr() if pinned.numel() else None,
            }
        )
        self.log.append(("copy", pinned.data_ptr() if pinned.numel() else None))
        return pinned.clone()

    def record(self) -> FakeEvent:
        self.events += 1
        self.log.append(("record", self.events))
        return FakeEvent(self.events)

    def wait(self, event: FakeEvent) -> None:
        self.log.append(("wait", event.n))

    def consume(self, event: FakeEvent, tensors: Sequence[torch.Tensor]) -> None:
        self.log.append(("consume", event.n, threading.current_thread().name, len(tensors)))


# -- gloo cases ----------------------------------------------------------------------------


def loader_device_setup(prefetch: int, batches: int = 4) -> dict[str, Any]:
    """A ``GlobalBatchLoader`` on a mesh whose device is a stubbed accelerator ``fakeacc``,
    index ``10 + rank`` (the program's thread has it current, as ``DeviceMesh`` leaves it):
    the loader's thread must make that index current before its first copy; every copy goes
    through the staging ring; the consumer waits on each batch's own event."""
    import torch.distributed as dist

    import torchshard as ts
    from torchshard._backend.dtensor import device as devices
    from torchshard._backend.dtensor import mesh as dtensor
    from torchshard._backend.dtensor import staging

    rank, world = dist.get_rank(), dist.get_world_size()
    index = 10 + rank
    module = FakeDeviceModule()
    drivers: list[FakeDriver] = []

    def make_driver(device: Any) -> FakeDriver:
        drivers.append(FakeDriver(device, module))
        return drivers[-1]

    saved = (getattr(torch, "fakeacc", None), dtensor.mesh_device, staging.DRIVER)
    torch.fakeacc = module  # type: ignore[attr-defined]
    dtensor.mesh_device = lambda dm: devices.MeshDevice("fakeacc", index)
    staging.DRIVER = make_driver
    module.set_device(index)  # the program's thread: DeviceMesh set it
    module.calls.clear()
    try:
        mesh = ts.create_device_mesh((world,), ("data",), backend="dtensor")
        source = [np.full((2, 3), 100 * rank + b, dtype=np.float32) for b in range(batches)]
        values = []
        with mesh:
            loader = ts.GlobalBatchLoader(source, prefetch=prefetch)
            for batch in loader:
                values.append(ts.global_to_host_array(batch).tolist())
            loader.close()
    finally:
        staging.forget_rings()
        if saved[0] is None:
            del torch.fakeacc  # type: ignore[attr-defined]
        else:
            torch.fakeacc = saved[0]  # type: ignore[attr-defined]
        dtensor.mesh_device, staging.DRIVER = saved[1], saved[2]
    return {
        "set_device": module.calls,
        "copies": [c for d in drivers for c in d.copies],
        "logs": [d.log for d in drivers],
        "values": values,
        "main": threading.current_thread().name,
    }


def permuted_mesh() -> dict[str, Any]:
    """Meshes whose ranks do not ascend along an axis, on 4 ranks: what raw DTensor does with
    them (its collectives misplace blocks), and torchshard's answer (a clear error; a
    topology-aware layout whose axes can be reordered is reordered)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    import torchshard as ts
    from torchshard._backend.dtensor import device as devices
    from torchshard._backend.dtensor import mesh as dtensor

    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def catch(fn: Any) -> str:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- the message is the result
            return f"{type(e).__name__}: {e}"
        return "no error"

    # Raw DTensor on a permuted 1-D mesh: each rank holds the block of its mesh position.
    perm = [2, 0, 3, 1]
    dm = DeviceMesh("cpu", torch.tensor(perm), mesh_dim_names=("data",))
    local = torch.full((1, 2), float(perm.index(rank)))  # block i = value i, at position i
    raw = DTensor.from_local(local, dm, [Shard(0)], run_check=False)
    out["raw_full"] = raw.full_tensor()[:, 0].tolist()
    out["from_device_mesh"] = catch(lambda: ts.Mesh.from_device_mesh(dm))
    out["create"] = catch(
        lambda: ts.create_device_mesh((4,), ("data",), devices=perm, backend="dtensor")
    )
    grid = DeviceMesh("cpu", torch.tensor([[0, 3], [1, 2]]), mesh_dim_names=("a", "b"))
    out["from_device_mesh_2d"] = catch(lambda: ts.Mesh.from_device_mesh(grid))

    # A topology-aware layout: reordered when its lines order their ranks alike.
    def layout(rows: list[list[int]]) -> Any:
        def build(shape: tuple[int, ...], *, mesh_dim_names: tuple[str, ...]) -> Any:
            assert tuple(shape) == (2, 2) and mesh_dim_names == ("data", "model")
            return DeviceMesh("cpu", torch.tensor(rows), mesh_dim_names=mesh_dim_names)

        return build

    saved = devices.topology_aware
    devices.topology_aware = lambda device_type: layout([[3, 2], [1, 0]])
    try:
        mesh = ts.create_device_mesh((2, 2), ("data", "model"), backend="dtensor")
        x = torch.arange(6.0).reshape(2, 3) + 10 * rank
        with mesh:
            g = ts.host_to_global_array(x, partition=ts.P(("data", "model")))
            out["aware_devices"] = mesh.devices.tolist()
            out["aware_back"] = bool(torch.equal(ts.global_to_host_array(g), x))
            out["aware_full"] = g.full_tensor().tolist()
        devices.topology_aware = lambda device_type: layout([[0, 3], [1, 2]])
        out["aware_refused"] = catch(
            lambda: ts.create_device_mesh((2, 2), ("data", "model"), backend="dtensor")
        )
    finally:
        devices.topology_aware = saved
    out["direct"] = dtensor._topology_aware_mesh(
        lambda shape, mesh_dim_names: np.array([[2, 0], [3, 1]]), "cpu", (2, 2), ("x", "y")
    ).mesh.tolist()
    return out


def mesh_devices() -> dict[str, Any]:
    """The device of each kind of mesh on a gloo process: the DeviceMesh's type, and the index
    current when the mesh is entered (a stubbed accelerator ``fakeacc`` for a user mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import torchshard as ts
    from torchshard._backend.dtensor import device as devices
    from torchshard._backend.dtensor import mesh as dtensor

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"backend": str(dist.get_backend())}
    built = ts.create_device_mesh((world,), ("data",), backend="dtensor")
    out["built"] = (built.native.device_type, str(dtensor.mesh_device(built.native)))
    hand = ts.Mesh(np.arange(world), ("data",), backend="dtensor")
    with hand:
        out["hand"] = str(dtensor.mesh_device(dtensor.device_mesh(hand)))
    # gloo on a machine with an accelerator: still a CPU mesh
    saved = devices.accelerator_type
    devices.accelerator_type = lambda: "cuda"
    try:
        out["gloo_with_gpu"] = dtensor._device_type()
    finally:
        devices.accelerator_type = saved
    # a user's DeviceMesh of an accelerator type: its type, and the index current at entry
    module = FakeDeviceModule()
    torch.fakeacc = module  # type: ignore[attr-defined]
    try:
        module.set_device(5 + rank)
        dm = DeviceMesh(
            "fakeacc", torch.arange(world), mesh_dim_names=("data",), _init_backend=False
        )
        first = str(dtensor.mesh_device(dm))
        module.set_device(0)  # later changes do not move the mesh's device
        out["user"] = (first, str(dtensor.mesh_device(dm)))
    finally:
        del torch.fakeacc  # type: ignore[attr-defined]
    return out
