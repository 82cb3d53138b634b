"""The backend registry and the boundary every runtime implements (``Backend``).

Everything above this boundary (specs, meshes, index maths, tree handling, validation, global
shape inference, which host slice goes to which device) is backend-independent. A backend
supplies the runtime's devices and their owners, builds a global tensor from one host slice per
local device, reads local shards back with their global index ranges, annotates in-step
sharding, supplies the two primitives of in-step dispatch (``full_local``, ``take_rows``), and
may contribute a cross-process agreement step (``agree``).

Registration: a backend module calls ``register_backend(name, instance)`` when it is imported.
``KNOWN`` names the module of each backend torchshard ships, so that ``backend_by_name`` can
import it the first time a mesh names it (torch_xla and torch.distributed load only when used);
a third backend is one new module and one line in ``KNOWN``. Importing this package installs
the registry into the pure core's runtime slot (``torchshard._core.runtime``), which is how
``with mesh:``, ``Mesh.from_xla`` and ``current_topology`` reach a backend without the core
importing one.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from torchshard._core import runtime

if TYPE_CHECKING:
    import torch

    from torchshard._core.mesh import Mesh
    from torchshard._core.sharding import DimAxes
    from torchshard._core.topology import Topology

# The backends torchshard ships: name -> the module that registers it when imported.
KNOWN: dict[str, str] = {
    "xla": "torchshard._backend.xla",
    "dtensor": "torchshard._backend.dtensor",
}


class LocalShard(NamedTuple):
    """One device's block of a global tensor, as read back on its host."""

    device: int
    ranges: tuple[tuple[int, int], ...]  # the global [start, stop) per dimension
    data: torch.Tensor  # exactly the block (padding removed), on the CPU


class AgreementCall(Protocol):
    """What ``Backend.agree`` compares between the processes: a call, described on demand."""

    def describe(self) -> list[str]:
        """One line for the structure and partition, then one ``"(shape) dtype"`` per leaf."""
        ...

    def path(self, i: int) -> str:
        """Leaf ``i``'s path (for the error)."""
        ...


class Backend(Protocol):
    """What torchshard needs from a runtime (torch_xla SPMD, torch.distributed DTensor)."""

    name: str
    keeps_unconstrained_dims: bool
    """Whether ``annotate`` can leave single dimensions as they are (``keep``): DTensor keeps
    their placements; torch_xla's OpSharding has no unspecified dimensions."""

    def topology(self) -> Topology:
        """The devices of the run, their owning processes, and this process's index."""
        ...

    def local_devices(self, mesh: Mesh) -> Sequence[int]:
        """This process's device ids, in the order ``make_global`` takes their shards."""
        ...

    def activate(self, mesh: Mesh) -> None:
        """Called when ``mesh`` becomes the current mesh of a thread (``with mesh:``)."""
        ...

    def prepare(self, mesh: Mesh) -> None:
        """Runs, on the calling thread, the set-up collectives later calls on ``mesh`` need
        (DTensor: its ``DeviceMesh`` and the agreement group), so that a helper thread (a
        loader's) never runs one. Called by ``activate`` and by a loader's ``iter()``."""
        ...

    def deactivate(self, mesh: Mesh, outer: Mesh | None) -> None:
        """Called when ``mesh``'s context exits; ``outer`` is the mesh that is current again."""
        ...

    def bind_thread(self, mesh: Mesh) -> None:
        """Called first on a helper thread that will place data on ``mesh`` (a loader's): makes
        this process's device of ``mesh`` current there (the current device is per thread;
        torch's pin-memory thread does the same). Nothing for a CPU mesh or torch_xla."""
        ...

    def fence(self) -> Callable[[], None] | None:
        """Ends the batch of copies the calling thread started (``make_global(background=
        True)``) and returns its hand-off: called on the consumer's thread, it makes that
        thread's stream wait for these copies only. ``None`` when there is nothing to wait for
        (a CPU mesh, torch_xla)."""
        ...

    def mesh_from_native(self, native: Any) -> Mesh:
        """The ``Mesh`` of the runtime's own mesh object (``xs.Mesh``, ``DeviceMesh``)."""
        ...

    def native_mesh(self, mesh: Mesh) -> Any:
        """``mesh`` as the runtime's own mesh object."""
        ...

    def create_mesh(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        """A mesh of this backend over the device-id ``grid`` (``create_device_mesh``); may be
        collective (DTensor builds its ``DeviceMesh``: every process must call it)."""
        ...

    def is_global(self, x: Any) -> bool:
        """Whether ``x`` is a global tensor of this backend."""
        ...

    def is_sharded(self, x: torch.Tensor) -> bool:
        """Whether the global tensor ``x`` carries a sharding (False: the runtime holds it
        whole on every device, e.g. an XLA tensor moved with ``.to()`` and never annotated;
        ``local_shards`` then has nothing to report). Runs ``x``'s pending computation."""
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

    def global_maker(
        self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]
    ) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        """``make_global`` (foreground) with everything but the shards bound, for a call that
        is repeated (the engine's plan cache keeps it with the plan)."""
        ...

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[list[LocalShard]]:
        """For each global tensor, the blocks held by this process's devices (one that carries
        no sharding, see ``is_sharded``, is whole on every local device)."""
        ...

    def local_ranges(self, x: torch.Tensor) -> dict[int, tuple[tuple[int, int], ...]] | None:
        """Each local device's global ``[start, stop)`` per dimension of the global tensor
        ``x``, without copying data (``None``: ``x`` holds no value layout, e.g. DTensor's
        partial sums). ``host_to_global_array`` compares it with a spec's."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full value of a global tensor on the host (may run a collective)."""
        ...

    def annotate(
        self, x: torch.Tensor, mesh: Mesh, axes: DimAxes, *, keep: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        """``x`` constrained to the sharding ``axes`` on ``mesh`` inside a step.

        Returns a new tensor with ``x``'s value; ``x`` itself (its data, its annotation) is
        left as it was, whatever sharding it already carries. ``axes`` has one entry per
        dimension of ``x`` and has been validated against ``mesh`` by the caller. Callers must
        use the result (DTensor redistributes into a new tensor). The dimensions in ``keep``
        (``maybe_shard``'s ``UNCONSTRAINED`` entries; their ``axes`` are ``()``) keep the
        sharding ``x`` has, where the backend can say so (``keeps_unconstrained_dims``).
        Raises ``ShardingError`` for a sharding the backend cannot apply to ``x``.
        """
        ...

    def full_local(self, x: torch.Tensor) -> torch.Tensor:
        """The whole value of a small global tensor (a dispatch key), as a tensor that index
        maths in the step can combine with tensors made by ``torch.arange``/``zeros``.

        torch_xla: ``x`` itself (the maths is traced into the step; the compiler moves what it
        needs). DTensor: ``full_tensor()``, a plain tensor equal on every rank (an all-gather of
        the key only). A tensor of no backend is returned as it is.
        """
        ...

    def take_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``out[l] = x[index[l]]`` along dim 0, for a global ``x`` and an ``index`` from
        ``full_local`` (the same on every process). The result is sharded like ``x``."""
        ...

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        """Raises ``ShardingError`` (without a tree path) when this backend cannot express the
        sharding ``axes`` on ``mesh``. Called while planning, before anything moves."""
        ...

    def compares_processes(self, mesh: Mesh) -> bool:
        """Whether ``agree`` compares the processes' calls (a collective): ``False`` on one
        process, when the check is off, or when the runtime has no cheap collective outside a
        step (torch_xla)."""
        ...

    def agree(self, mesh: Mesh, call: AgreementCall, *, what: str) -> None:
        """The agreement step: raises ``ProcessDisagreementError`` (on every process) when the
        processes' ``call.describe()`` differ; a no-op unless ``compares_processes``.

        A collective: every process calls it the same number of times, in the same order, on
        the thread that runs the program (never a helper thread, whose progress differs from
        process to process). ``what`` names the call in the error (``host_arrays``,
        ``GlobalBatchLoader: batch 7``). Run before anything that could fail on one process
        only, so that no process fails alone and leaves the others waiting in a collective."""
        ...

    def check_values(self, mesh: Mesh, tree: Any, *, argname: str, what: str) -> None:
        """The opt-in value check (``set_value_check``): raises ``ProcessDisagreementError`` on
        every process when processes whose blocks of a global tensor in ``tree`` cover the same
        ranges passed different values. A collective like ``agree``; a no-op where the
        processes are not compared (one process, torch_xla)."""
        ...

    def agree_begin(self, mesh: Mesh, call: AgreementCall, *, what: str) -> Callable[[], None]:
        """``agree`` in two halves: starts the comparison and returns its end, which raises as
        ``agree`` would. Between them the caller may run only work that issues no collective
        and whose failure is local (``host_to_global_array``'s plan and DTensor's
        ``from_local``), so that it overlaps the wait for the other processes; the end must be
        called also when that work failed (its error is raised after the end's)."""
        ...

    def exchange(
        self, mesh: Mesh, items: Sequence[str], *, what: str = "torchshard"
    ) -> list[list[str]] | None:
        """Every process's ``items`` when they differ, ``None`` when they agree (or when
        ``compares_processes`` is False): the collective behind ``agree``, for callers that
        describe more than a call (a loader's batch outcome). ``what`` names the call: it is
        compared too (processes in different calls are out of step), and a process that does
        not answer within the default group's timeout makes a ``CollectiveError`` naming it."""
        ...


_INSTANCES: dict[str, Backend] = {}
_LOCK = threading.Lock()


def register_backend(name: str, backend: Backend) -> None:
    """Registers ``backend`` under ``name`` (its module calls this when imported)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_backend: name must be a non-empty str, but got {name!r}.")
    with _LOCK:
        if name in _INSTANCES and _INSTANCES[name] is not backend:
            raise ValueError(f"register_backend: a backend called {name!r} is registered already.")
        _INSTANCES[name] = backend


def backend_names() -> tuple[str, ...]:
    """Every backend a mesh may name: the shipped ones, then any registered later."""
    return tuple(KNOWN) + tuple(n for n in _INSTANCES if n not in KNOWN)


def backend_by_name(name: str) -> Backend:
    """The (process-wide) backend instance called ``name``, importing its module on first use."""
    inst = _INSTANCES.get(name)  # the hot path: no lock once the backend exists
    if inst is not None:
        return inst
    module = KNOWN.get(name)
    if module is None:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(backend_names())}.")
    importlib.import_module(module)  # registers it
    inst = _INSTANCES.get(name)
    if inst is None:
        raise RuntimeError(f"{module} was imported but did not register the backend {name!r}.")
    return inst


def default_backend_name() -> str:
    """The backend of a process when no mesh says otherwise (``process_index()`` outside any
    mesh, ``InputDispatcher``'s defaults, ``infer_mesh_shape``).

    ``"xla"`` when torch_xla is imported (the program runs on it); else ``"dtensor"`` when
    torch.distributed's default process group is initialised (one process per device); else
    ``"xla"`` when torch_xla is installed (it is then imported on first use), ``"dtensor"``
    when it is not (a plain install). Decided on every call, so it follows
    ``init_process_group``; the checks are dictionary lookups (whether torch_xla is installed
    is looked up once per process).
    """
    if sys.modules.get("torch_xla") is not None:
        return "xla"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "dtensor"
    from torchshard._backend.xla_env import xla_installed

    return "xla" if xla_installed() else "dtensor"


def get_backend(mesh: Mesh | None = None) -> Backend:
    """The backend of ``mesh``; without a mesh, the process's default backend."""
    return backend_by_name(mesh.backend if mesh is not None else default_backend_name())


def _resolve(name: str | None) -> Backend:
    inst = _INSTANCES.get(name)  # type: ignore[arg-type]  # the hot path: no further call
    if inst is not None:
        return inst
    return backend_by_name(default_backend_name() if name is None else name)


def backend_of(x: Any) -> Backend:
    """The backend that computes with tensor ``x`` in a step: dtensor for a ``DTensor``, else
    xla, whose in-step primitives are plain torch ops, right for any other tensor too. Never
    imports a backend's runtime (a ``DTensor`` exists only once its module is loaded)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(x, dtensor.DTensor):
        return backend_by_name("dtensor")
    return backend_by_name("xla")


runtime.install(_resolve, backend_names)
