"""The backend boundary: what a runtime must supply to place and read sharded arrays.

Everything above this boundary (specs, meshes, index maths, tree handling, validation, global
shape inference, which host slice goes to which device) is backend-independent. A backend
supplies the runtime's devices and their owners, builds a global tensor from one host slice per
local device, reads local shards back with their global index ranges, and annotates in-step
sharding. ``get_backend(mesh)`` picks the backend named by the mesh (``"xla"`` by default).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from torchshard._index import DimAxes
    from torchshard._mesh import Mesh
    from torchshard._topology import Topology


class LocalShard(NamedTuple):
    """One device's block of a global tensor, as read back on its host."""

    device: int
    ranges: tuple[tuple[int, int], ...]  # the global [start, stop) per dimension
    data: torch.Tensor  # exactly the block (padding removed), on the CPU


class Backend(Protocol):
    """What torchshard needs from a runtime (torch_xla SPMD, torch.distributed DTensor)."""

    name: str

    def topology(self) -> Topology:
        """The devices of the run, their owning processes, and this process's index."""
        ...

    def local_devices(self, mesh: Mesh) -> Sequence[int]:
        """This process's device ids, in the order ``make_global`` takes their shards."""
        ...

    def activate(self, mesh: Mesh) -> None:
        """Called when ``mesh`` becomes the current mesh of a thread (``with mesh:``)."""
        ...

    def deactivate(self, mesh: Mesh, outer: Mesh | None) -> None:
        """Called when ``mesh``'s context exits; ``outer`` is the mesh that is current again."""
        ...

    def is_global(self, x: Any) -> bool:
        """Whether ``x`` is a global tensor of this backend."""
        ...

    def make_global(
        self,
        mesh: Mesh,
        axes: DimAxes,
        global_shape: tuple[int, ...],
        shards: Sequence[torch.Tensor],
        *,
        background: bool = False,
    ) -> torch.Tensor:
        """A global tensor from one CPU block per local device (``local_devices`` order).

        ``background``: the caller is a helper thread (``GlobalBatchLoader``'s) running next to
        the training step's Python; prefer a transfer that lets other Python threads run (for
        torch_xla: one that releases the GIL) over the fastest single-threaded one.
        """
        ...

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[list[LocalShard]]:
        """For each tensor, the blocks held by this process's devices."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full value of a global tensor on the host (may run a collective)."""
        ...

    def annotate(self, x: torch.Tensor, mesh: Mesh, axes: DimAxes) -> torch.Tensor:
        """``x`` constrained to the sharding ``axes`` on ``mesh`` inside a step.

        Returns a new tensor with ``x``'s value; ``x`` itself (its data, its annotation) is
        left as it was, whatever sharding it already carries. ``axes`` has one entry per
        dimension of ``x`` and has been validated against ``mesh`` by the caller. Callers must
        use the result (DTensor redistributes into a new tensor).
        """
        ...

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        """Raises ``ShardingError`` (without a tree path) when this backend cannot express the
        sharding ``axes`` on ``mesh``. Called while planning, before anything moves."""
        ...

    def check_agreement(
        self,
        mesh: Mesh,
        argname: str,
        treespec: Any,
        leaves: Sequence[Any],
        partition: Any,
        where: Callable[[int], str],
    ) -> None:
        """Raises the same ``ProcessDisagreementError`` on every process when the processes
        passed different structures, partitions, shapes or dtypes to ``host_to_global_array``
        (``where(i)`` is leaf ``i``'s path). Called before validation, so that no process
        fails alone and leaves the others waiting in a collective. May be a no-op."""
        ...


_MODULES = {"xla": "torchshard._backend.xla", "dtensor": "torchshard._backend.dtensor"}
_INSTANCES: dict[str, Backend] = {}
_LOCK = threading.Lock()


def backend_by_name(name: str) -> Backend:
    """The (process-wide) backend instance called ``name``."""
    with _LOCK:
        inst = _INSTANCES.get(name)
        if inst is None:
            if name not in _MODULES:
                raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_MODULES)}.")
            inst = importlib.import_module(_MODULES[name]).BACKEND
            _INSTANCES[name] = inst
        return inst


def get_backend(mesh: Mesh | None = None) -> Backend:
    """The backend of ``mesh`` (torch_xla when ``mesh`` is None)."""
    return backend_by_name(mesh.backend if mesh is not None else "xla")
