"""What a runtime implements for torchshard: a ``Backend`` is a record of a few protocols.

Every backend implements the four that every runtime has:

- ``Placement``: the devices and their owners, and global tensors made from one CPU block per
  local device;
- ``ReadBack``: a global tensor's local blocks with their global ranges, or its whole value;
- ``InStep``: in-step annotations and the two primitives of in-step dispatch;
- ``Meshes``: the runtime's own mesh objects, and the runtime's current mesh.

A backend implements the other four only when its runtime has what they describe; the
record holds ``None`` otherwise, and the callers skip the step (nothing is a no-op member):

- ``LayoutLimits``: shardings the runtime cannot express (DTensor's; torch_xla's: a sharded
  leaf of rank above 5);
- ``ProcessChecks``: cheap collectives outside a step, which compare what the processes pass
  (DTensor; torch_xla has none);
- ``DeviceThreads``: a current device per thread and copy streams to fence (DTensor on an
  accelerator; torch_xla places through its runtime);
- ``LocalViews``: global tensors as per-process tensors, for steps that compute per process
  (DTensor's local blocks, and re-homing on a sub-mesh; torch_xla's SPMD step takes the global
  tensors themselves, so ``torchshard.to_local`` leaves them as they are).

Everything above this boundary (specs, meshes, index maths, tree handling, validation, global
shape inference, which host slice goes to which device) is backend-independent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from torchshard._core.mesh import Mesh
    from torchshard._core.sharding import DimAxes
    from torchshard._core.topology import Topology
    from torchshard._core.verdict import Verdict

MakeGlobal = Callable[[Sequence["torch.Tensor"]], "torch.Tensor"]


class LocalShard(NamedTuple):
    """One device's block of a global tensor, as read back on its host."""

    device: int
    ranges: tuple[tuple[int, int], ...]  # the global [start, stop) per dimension
    data: torch.Tensor  # exactly the block (padding removed), on the CPU


class Refused(Exception):
    """Raised by ``make_global`` (or a ``global_maker``'s maker) for a leaf whose values the
    runtime cannot hold (torchax: a 64-bit value JAX would change); placement raises
    ``error`` (a ``ShardingError`` or ``TypeError`` without a path) with the leaf's path."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class AgreementCall(Protocol):
    """What ``ProcessChecks.agree_begin`` compares between the processes: a call, described
    on demand."""

    leaves: list[list[Any]]
    """Each host's tree's leaves, flat (what the call was given)."""

    def describe(self) -> list[str]:
        """One line for the structure and partition, then one ``"(shape) dtype"`` per leaf."""
        ...

    def path(self, i: int) -> str:
        """Leaf ``i``'s path (for the error)."""
        ...


class Placement(Protocol):
    """The devices of a run, and global tensors made from host blocks."""

    def topology(self) -> Topology:
        """The devices of the run, their owning processes, and this process's index."""
        ...

    def local_devices(self, mesh: Mesh | None) -> Sequence[int]:
        """This process's device ids, in the order ``make_global`` takes their shards (on
        ``mesh``; ``None``: outside any mesh, as ``visualize_sharding`` asks for a tensor the
        runtime holds unsharded)."""
        ...

    def devices_in_host_memory(self) -> bool:
        """Whether this process's devices keep their buffers in its own memory (torch_xla's
        CPU devices: the emulation), so that a call's device copies are checked against the
        host's free memory before anything moves (an overrun aborted inside XLA)."""
        ...

    def is_global(self, x: Any) -> bool:
        """Whether ``x`` is a global tensor of this backend."""
        ...

    def local_ranges(self, x: torch.Tensor) -> dict[int, tuple[tuple[int, int], ...]] | None:
        """Each local device's global ``[start, stop)`` per dimension of the global tensor
        ``x``, without copying data (``None``: ``x`` holds no value layout, e.g. DTensor's
        partial sums). ``host_to_global_array`` compares it with a spec's."""
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

    def global_maker(self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]) -> MakeGlobal:
        """``make_global`` (foreground) with everything but the shards bound, for a call that
        is repeated (placement keeps it with the call's plan)."""
        ...


class ReadBack(Protocol):
    """Global tensors back on the host."""

    def is_sharded(self, x: torch.Tensor) -> bool:
        """Whether the global tensor ``x`` carries a sharding (False: the runtime holds it
        whole on every device, e.g. an XLA tensor moved with ``.to()`` and never annotated;
        ``local_shards`` then has nothing to report). Runs ``x``'s pending computation."""
        ...

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[list[LocalShard]]:
        """For each global tensor, the blocks held by this process's devices (one that carries
        no sharding, see ``is_sharded``, is whole on every local device)."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full value of a global tensor on the host (may run a collective)."""
        ...


class InStep(Protocol):
    """What a step does with global tensors: annotations and dispatch's two primitives."""

    keeps_unconstrained_dims: bool
    """Whether ``annotate`` can leave single dimensions as they are (``keep``): DTensor keeps
    their placements; torch_xla's OpSharding has no unspecified dimensions."""

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
        ``full_local`` (the same on every process). The result is sharded like ``x``. Floats
        move as bits where the backend can (-0.0 and NaN payloads kept)."""
        ...

    splits_unevenly: bool
    """Whether a step's result can be split along a dimension that the mesh axes do not
    divide: DTensor's ``Shard`` can; torch_xla 2.9 returns such a result replicated (a graph's
    output), resharded through a sum of floats. Dispatch asks for ``P()`` where it cannot."""

    def move_rows(
        self,
        x: torch.Tensor,
        targets: torch.Tensor,
        logical: int,
        mesh: Mesh,
        axes: tuple[str, ...],
    ) -> torch.Tensor | None:
        """``out[targets[p]] = x[p]`` for the rows ``p`` of a global ``x`` whose row target
        (``targets``, ``[P]``, a global tensor) is ``>= 0``: the ``logical`` rows, dim 0 split
        over the mesh axes ``axes`` (which divide ``logical``). ``None`` where the backend has
        no direct route for ``x``: the caller gathers with ``full_local`` and ``take_rows``."""
        ...


class Meshes(Protocol):
    """The runtime's own mesh objects, and its current mesh."""

    #: Whether the runtime has one current mesh per process (torch_xla's global mesh), which
    #: ``make_current`` sets for every thread; ``False`` when it keeps none (DTensor) or one
    #: per thread (JAX's ``jax.set_mesh``).
    process_wide: bool

    def from_native(self, native: Any) -> Mesh:
        """The ``Mesh`` value of the runtime's own mesh object (``xs.Mesh``, ``DeviceMesh``,
        ``jax.sharding.Mesh``)."""
        ...

    def native(self, mesh: Mesh) -> Any:
        """``mesh`` as the runtime's own mesh object."""
        ...

    def create(self, grid: Any, axis_names: tuple[str, ...]) -> Mesh:
        """A mesh value of this backend over the device-id ``grid`` (``create_device_mesh``);
        may be collective (DTensor builds its ``DeviceMesh``: every process must call it)."""
        ...

    def make_current(self, mesh: Mesh | None) -> None:
        """``mesh`` became the current mesh of the program (``with mesh:``; ``None``: no mesh
        of this backend is current any more). torch_xla sets its global mesh; DTensor builds
        the mesh's ``DeviceMesh`` (collective) on the program's thread; torchax sets JAX's
        mesh of the thread (``jax.set_mesh``). It is also called when a mesh is left: where
        the runtime's mesh is ``process_wide``, with the mesh of the entry made last among
        those still open in the process; else on the leaving thread, with the innermost mesh of
        this backend still entered in its task or thread (``None``: none)."""
        ...


class LayoutLimits(Protocol):
    """Shardings a runtime cannot express."""

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        """Raises ``ShardingError`` (without a tree path) when this backend cannot express the
        sharding ``axes`` on ``mesh``. Called while planning, before anything moves."""
        ...


class ProcessChecks(Protocol):
    """Cheap, bounded collectives outside a step, comparing what the processes pass."""

    def prepare(self, mesh: Mesh) -> None:
        """Runs, on the calling thread, the set-up collectives later calls on ``mesh`` need
        (DTensor: its ``DeviceMesh`` and the agreement group), so that a helper thread (a
        loader's) never runs one. Called by a loader's ``iter()``."""
        ...

    def compares(self, mesh: Mesh) -> bool:
        """Whether the processes are compared now (more than one process, the check on)."""
        ...

    def agree_begin(self, mesh: Mesh, call: AgreementCall, *, what: str) -> Callable[[], None]:
        """The agreement step in two halves: starts comparing the processes'
        ``call.describe()`` and returns its end, which raises ``ProcessDisagreementError`` (on
        every process) when they differ. Between them the caller may run only work that
        issues no collective and whose failure is local (``host_to_global_array``'s plan and
        DTensor's ``from_local``), so that it overlaps the wait for the other processes; the
        end must be called also when that work failed (its error is raised after the end's).

        A collective: every process calls it the same number of times, in the same order, on
        the thread that runs the program (never a helper thread, whose progress differs from
        process to process). ``what`` names the call in the error (``host_arrays``,
        ``GlobalBatchLoader: batch 7``). A no-op end unless ``compares``."""
        ...

    def agree_after(
        self, mesh: Mesh, end: Callable[[], None], call: AgreementCall, out: Any, *, what: str
    ) -> Any:
        """The end of ``agree_begin``'s check after the call made ``out``: judged now, or
        deferred off the step's path (``set_agreement_deferred``; DTensor on torch >= 2.13):
        then ``out``'s tensors that the call made wait for it at their first use, and the next
        call on the caller's stream, ``settle`` or interpreter exit judge it first. Returns
        ``out``. Called on the thread that called ``agree_begin``, only when the call
        succeeded (a failed one calls ``end`` itself)."""
        ...

    def settle(self, mesh: Mesh, where: str) -> None:
        """Judges the caller's stream's deferred check now (raising what it found, saying it
        was raised ``where``, e.g. ``"on leaving the mesh"``): the mesh's ``with`` exit."""
        ...

    def exchange(
        self,
        mesh: Mesh,
        items: Sequence[str],
        *,
        what: str = "torchshard",
        channel: str | None = None,
        force: bool = False,
        counts: Sequence[int] = (),
    ) -> Verdict | None:
        """The processes' ``items`` compared and their ``counts`` reduced: a ``Verdict`` (its
        groups of processes by the items they passed, one when they agree; the sum, min and max
        of each count), or ``None`` when ``compares`` is False: the collective behind
        ``agree_begin``, for callers that describe more than a call (a loader's batch outcome,
        its real rows). ``what`` names the call: it is compared too (processes in different
        calls are out of step), and a process that does not answer within the default group's
        timeout makes a ``CollectiveError`` naming it. ``force``: exchange also with the
        agreement check off (on several processes), for a caller that needs the others' items
        or counts (a loader's end of data, its length).

        ``channel``: a sequence of exchanges from ``open_channel`` (then any one thread at a
        time may run its exchanges, a loader's background thread included); default: the
        calling thread's."""
        ...

    def begin_exchange(
        self,
        mesh: Mesh,
        items: Sequence[str],
        *,
        what: str = "torchshard",
        channel: str | None = None,
    ) -> Callable[[], Verdict | None]:
        """``exchange`` in two halves: starts it (this process's items written, no waiting) and
        returns its end, which waits for the others and returns what ``exchange`` returns (a
        no-op end unless ``compares``). Between the two the thread may do other work and
        begin the channel's next exchange (at most one outstanding: the ends are called in
        order, on the thread that began them), so that a loader's thread makes its next batch
        while the other processes catch up with this one."""
        ...

    def open_channel(self, mesh: Mesh, *, what: str, force: bool = False) -> str | None:
        """A new channel (a sequence of exchanges) for a loader's epoch, named alike on every
        process (``None`` unless ``compares``, or ``force`` on several processes). Called in program
        order on the thread that runs the program (a loader's ``iter()``): one exchange there,
        which names the channel, so that processes that are in different calls all raise
        ``ProcessDisagreementError`` at once."""
        ...

    def close_channel(self, mesh: Mesh, channel: str, *, finished: bool, taken: int) -> None:
        """Ends ``channel`` once no thread runs its exchanges any more. ``finished``: its last
        exchange ended it on every process (the end of the source); its keys are deleted. Else
        (an epoch ended early, ``taken`` batches taken) the processes still waiting in, or yet
        to reach, its next exchange raise ``CollectiveError`` naming this process at once."""
        ...

    def check_values(
        self, mesh: Mesh, tree: Any, *, argname: str, what: str, force: bool = False
    ) -> None:
        """The value check (``set_value_check``): raises ``ProcessDisagreementError`` on
        every process when processes whose blocks of a global tensor in ``tree`` cover the same
        ranges passed different values. A collective like ``agree_begin``. Runs when the check
        is on for every call, or with ``force`` (a loader's first batch of an epoch, which the
        caller checks unless the check was turned off); a no-op on one process."""
        ...


class DeviceThreads(Protocol):
    """A current device per thread, and copies to fence."""

    def bind_thread(self, mesh: Mesh) -> None:
        """Called first on a helper thread that will place data on ``mesh`` (a loader's): makes
        this process's device of ``mesh`` current there (the current device is per thread;
        torch's pin-memory thread does the same)."""
        ...

    def fence(self) -> Callable[[], None] | None:
        """Ends the batch of copies the calling thread started (``make_global(background=
        True)``) and returns its hand-off: called on the consumer's thread, it makes that
        thread's stream wait for these copies only. ``None`` when there is nothing to wait for
        (a CPU mesh)."""
        ...


class LocalViews(Protocol):
    """Global tensors as the per-process tensors of a step that computes per process."""

    def to_local(self, x: torch.Tensor) -> torch.Tensor:
        """This process's block of the global tensor ``x`` as a plain tensor of its device,
        without copying (DTensor: ``to_local()``, differentiable). Raises ``ShardingError``
        (without a tree path) when the block is not one of ``x``'s value (partial sums)."""
        ...

    def to_submesh(self, x: torch.Tensor, submesh: Mesh) -> torch.Tensor:
        """The global tensor ``x`` re-homed on ``submesh``, a sub-mesh of ``x``'s own mesh that
        holds this process (``submesh.native`` may be the runtime's sub-mesh object): the block
        of ``x`` that this process's peers along ``submesh``'s axes hold together, with
        ``x``'s placements on those axes; this process's local block is unchanged (no copy).
        Raises ``ShardingError`` (without a tree path) when ``submesh`` is not such a sub-mesh
        or the block cannot be expressed on it."""
        ...


@dataclasses.dataclass(frozen=True, eq=False)
class Backend:
    """A runtime, as torchshard sees it: its name and the protocols it implements.

    ``limits``, ``processes``, ``threads`` and ``views`` are ``None`` when the runtime has
    nothing they describe (torch_xla: all four).
    """

    name: str
    place: Placement
    read: ReadBack
    step: InStep
    meshes: Meshes
    limits: LayoutLimits | None = None
    processes: ProcessChecks | None = None
    threads: DeviceThreads | None = None
    views: LocalViews | None = None
