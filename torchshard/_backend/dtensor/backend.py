"""The torch.distributed DTensor backend (registered as ``"dtensor"`` when imported): one
process per device; global tensors are DTensors.

Device ids are ranks: device ``r`` belongs to rank ``r`` (one device per process), so a
process's block of a leaf is exactly its device's shard. ``make_global`` wraps a copy of that
block with ``DTensor.from_local`` and an explicit global ``shape`` and contiguous ``stride``;
no collective runs. Placements come from the spec: ``Shard(d)`` on every mesh axis that splits
dim ``d``, ``Replicate()`` on the others. Reading back uses ``to_local()`` with DTensor's own
offsets; ``gather`` is ``full_tensor()`` and ``annotate`` is ``redistribute``. In-step
dispatch gets the key's whole value with ``full_tensor()`` and gathers rows with a masked local
copy summed over the ranks (``take_rows``). It contributes the cross-process checks
(``DTensorChecks``): each process's block decides the global shape, so processes that pass
different shapes must all fail, not hang.

This module is imported only when a mesh names the ``"dtensor"`` backend, the default process
group makes it the default backend, or the dispatch code meets a DTensor. Its meshes are in
``mesh.py``, its checks in ``checks.py``, its bounded collectives in ``collective.py`` and the
private torch names it uses in ``_torch_private.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torchshard._backend.dtensor import collective, deferred, staging
from torchshard._backend.dtensor import device as devices
from torchshard._backend.dtensor import mesh as meshes
from torchshard._backend.dtensor._torch_private import StridedShard, is_strided_shard, local_offset
from torchshard._backend.dtensor.checks import check_sizes, check_values, exchange_in_step, in_step
from torchshard._backend.dtensor.collective import guarded
from torchshard._backend.dtensor.mesh import (
    DTensorMeshes,
    device_mesh,
    require_process_group,
    topology,
)
from torchshard._backend.dtensor.views import DTensorViews, contiguous_stride
from torchshard._backend.protocols import AgreementCall, Backend, LocalShard, MakeGlobal
from torchshard._backend.registry import register
from torchshard._core.agreement import (
    agreement_check_enabled,
    disagreement,
    value_check_enabled,
    with_mesh,
)
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes
from torchshard._core.topology import Topology
from torchshard._core.verdict import Verdict

# gloo's all_gather rejects int16 ("Invalid scalar type", torch 2.9.0); collectives that only
# move bytes (gather, redistribute without Partial) reinterpret it as a same-sized dtype.
_BYTE_VIEWS = {torch.int16: torch.float16}


@functools.lru_cache(maxsize=4096)
def placements(mesh: Mesh, axes: DimAxes) -> tuple[Placement, ...]:
    """One placement per mesh axis: ``Shard(d)`` when the axis splits dim ``d``, else
    ``Replicate()``. Refuses a tuple of axes that is not in mesh order (see below)."""
    dim_of: dict[str, int] = {}
    for d, dim in enumerate(axes):
        # DTensor splits a dim over several mesh axes in mesh order (earlier mesh axis major),
        # which is torchshard's order when the tuple lists them in mesh order. Axes of size 1
        # do not change the order of the shards.
        split = [a for a in dim if mesh.shape[a] > 1]
        ordered = sorted(split, key=mesh.axis_names.index)
        if split != ordered:
            raise ShardingError(
                f"dim {d} is split over the mesh axes {dim!r} (major to minor), but DTensor "
                f"splits a dimension over several mesh axes in mesh order ({tuple(ordered)!r} "
                f"on mesh {dict(mesh.shape)}); its only other order, the private _StridedShard, "
                "is lost by elementwise ops and redistribute in torch 2.9. Write the tuple in "
                f"mesh order, {tuple(ordered)!r}, or build the mesh with its axes in the order "
                f"{tuple(split)!r}."
            )
        for a in dim:
            dim_of[a] = d
    return tuple(Shard(dim_of[a]) if a in dim_of else Replicate() for a in mesh.axis_names)


def _is_strided(p: Placement) -> TypeGuard[StridedShard]:
    # By type: `_StridedShard` is a `Shard` (equal to `Shard(dim)`) up to torch 2.13 and a
    # separate placement from torch 2.14 on (see _torch_private).
    return is_strided_shard(p)


def _without_partial(x: DTensor) -> DTensor:
    """``x`` with its Partial placements reduced (a collective), others unchanged."""
    if not any(p.is_partial() for p in x.placements):
        return x
    target = [Replicate() if p.is_partial() else p for p in x.placements]
    return x.redistribute(x.device_mesh, target)


def _redistribute(x: DTensor, dm: DeviceMesh, target: Sequence[Placement]) -> DTensor:
    if any(_is_strided(p) for p in x.placements):
        # torch 2.9.0 redistributes _StridedShard to Shard wrongly; through Replicate is right.
        x = x.redistribute(dm, [Replicate()] * dm.ndim)
    view = _BYTE_VIEWS.get(x.dtype)
    if view is None or any(p.is_partial() for p in x.placements):
        return x.redistribute(dm, target)
    moved = _reinterpret(x, view).redistribute(dm, target)
    return _reinterpret(moved, x.dtype)


def _reinterpret(x: DTensor, dtype: torch.dtype) -> DTensor:
    local = x.to_local().view(dtype)
    return DTensor.from_local(
        local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


def _keeping(
    mesh: Mesh,
    axes: DimAxes,
    keep: frozenset[int],
    current: tuple[Placement, ...],
    target: tuple[Placement, ...],
) -> tuple[Placement, ...]:
    """``target`` where every mesh axis that the spec leaves free and that splits a kept
    (``UNCONSTRAINED``) dimension keeps that split. An axis the spec uses goes to the spec."""
    used = {a for dim in axes for a in dim}
    return tuple(
        c if name not in used and type(c) is Shard and c.dim in keep else t
        for name, c, t in zip(mesh.axis_names, current, target, strict=True)
    )


def _take_rows(x: DTensor, index: torch.Tensor) -> torch.Tensor:
    """``out[l] = x[index[l]]`` along dim 0, sharded like ``x``; ``index`` is the same plain
    tensor on every rank.

    DTensor's own ``index_select`` all-gathers ``x`` (padding rows included) to every rank.
    Here each rank gathers the rows it holds into an ``[L, ...]`` tensor that is zero elsewhere
    and the sum over the ranks that split dim 0 (a ``Partial`` reduced by ``redistribute``:
    reduce-scatter) moves only logical rows, as XLA partitions the same gather. Each row has
    exactly one contributor, so a sum of integers (or of bytes) is exact: floats (and complex
    parts) are summed as the integers of their width (``_summable``), which keeps -0.0, NaN
    payloads (quiet and signalling) and subnormals; a sum of floats would not (``0.0 + -0.0``
    is ``0.0``, an addition quiets a signalling NaN, gloo adds half floats through float32
    and canonicalises their NaNs). A tensor that needs grad is summed as floats, filled with
    ``-0.0`` (``v + -0.0 == v`` for every number and quiet NaN, complex parts too; a
    signalling NaN comes back quiet, and gloo's half floats lose NaN payloads), so it stays
    differentiable.
    """
    dm = x.device_mesh
    x = _without_partial(x)
    if any(_is_strided(p) and p.dim == 0 for p in x.placements):  # rows not contiguous
        rows = [
            Replicate() if p.is_shard(0) or (_is_strided(p) and p.dim == 0) else p
            for p in x.placements
        ]
        x = _redistribute(x, dm, rows)
    split = [i for i, p in enumerate(x.placements) if p.is_shard(0)]
    local = x.to_local()
    index = index.to(device=local.device, dtype=torch.int64)
    shape = (index.shape[0], *x.shape[1:])
    if not split:  # every rank holds all rows: no communication
        return DTensor.from_local(
            local.index_select(0, index),
            dm,
            x.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )
    as_bits = x.dtype in _BITS and not (x.requires_grad and torch.is_grad_enabled())
    start, held = local_offset(x)[1][0], local.shape[0]
    if held:  # no nonzero(): on CUDA it would wait for the device
        mine = (index >= start) & (index < start + held)
        picked = _summable(local.index_select(0, (index - start).clamp(0, held - 1)), as_bits)
        fill = _zero(picked.dtype, as_bits).to(local.device)
        summands = torch.where(mine.view(-1, *[1] * (picked.dim() - 1)), picked, fill)
    else:  # an uneven split left this rank no rows
        empty = _summable(local.new_empty((shape[0], *local.shape[1:])), as_bits)
        summands = _zero(empty.dtype, as_bits).to(local.device).expand_as(empty).clone()
    summed = (*shape, *summands.shape[len(shape) :])  # complex parts, bytes: trailing dims
    partial = [Partial() if i in split else p for i, p in enumerate(x.placements)]
    out = DTensor.from_local(
        summands,
        dm,
        partial,
        run_check=False,
        shape=torch.Size(summed),
        stride=contiguous_stride(summed),
    ).redistribute(dm, x.placements)
    if out.dtype == x.dtype:
        return out
    return DTensor.from_local(
        _from_summable(out.to_local(), x.dtype, as_bits),
        dm,
        x.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_stride(shape),
    )


# take_rows sums floats (complex: their parts) as the integers of their width.
_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.complex64: torch.int32,
    torch.complex128: torch.int64,
}

_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def _summable(t: torch.Tensor, as_bits: bool) -> torch.Tensor:
    """``t`` as what ``take_rows`` sums: floats (``as_bits``) as the integers of their width;
    int16, which gloo does not add, as its two bytes (a last dim of 2); bool as its byte (a
    sum, not gloo's logical or). With one contributor per row every sum is exact."""
    if as_bits:
        if t.is_complex():
            t = torch.view_as_real(t)
        t = t.contiguous().view(_BITS[t.dtype])
    if t.dtype == torch.int16:
        return t.unsqueeze(-1).view(torch.uint8)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


def _from_summable(t: torch.Tensor, dtype: torch.dtype, as_bits: bool) -> torch.Tensor:
    """The inverse of ``_summable`` for a tensor of ``dtype``."""
    if dtype == torch.bool:
        return t.view(torch.bool)
    if t.dtype == torch.uint8:  # the bytes of int16s
        t = t.view(torch.int16).squeeze(-1)
    if not as_bits:
        return t
    if dtype.is_complex:
        return torch.view_as_complex(t.view(_PARTS[dtype]))
    return t.view(dtype)


def _zero(dtype: torch.dtype, as_bits: bool) -> torch.Tensor:
    """What a rank adds for the rows it does not hold: 0, or ``-0.0`` for floats summed as
    floats (``v + -0.0 == v``)."""
    if as_bits or not (dtype.is_floating_point or dtype.is_complex):
        return torch.zeros((), dtype=dtype)
    if dtype.is_complex:  # both parts -0.0 (a complex -0.0 literal has +0.0 imaginary)
        part = torch.tensor(-0.0, dtype=_PARTS[dtype])
        return torch.complex(part, part)
    return torch.full((), -0.0, dtype=dtype)


def _nothing() -> None:
    return None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class DTensorRuntime:
    """torch.distributed DTensor (one process per device, device id = rank): its
    ``Placement``, ``ReadBack``, ``InStep``, ``LayoutLimits`` and ``DeviceThreads``."""

    keeps_unconstrained_dims = True

    def topology(self) -> Topology:
        return topology()

    def local_devices(self, mesh: Mesh | None) -> Sequence[int]:
        require_process_group()
        return (dist.get_rank(),)

    def devices_in_host_memory(self) -> bool:
        return False  # one device per process, holding its own shard: no copies multiply

    def bind_thread(self, mesh: Mesh) -> None:
        devices.bind_thread(meshes.mesh_device(device_mesh(mesh)))

    def fence(self) -> Callable[[], None] | None:
        readies = staging.seal_all()
        if not readies:
            return None
        if len(readies) == 1:
            return readies[0]

        def ready() -> None:
            for r in readies:
                r()

        return ready

    def is_global(self, x: Any) -> bool:
        return isinstance(x, DTensor)

    def make_global(
        self,
        mesh: Mesh,
        axes: DimAxes,
        global_shape: tuple[int, ...],
        shards: Sequence[torch.Tensor],
        *,
        background: bool = False,
    ) -> torch.Tensor:
        # `background` changes nothing here: the clone and from_local run without the GIL.
        if len(shards) != 1:
            raise RuntimeError(
                f"the dtensor backend takes one shard per process, but got {len(shards)}."
            )
        dm = device_mesh(mesh)
        local = shards[0]
        dev = meshes.mesh_device(dm)  # through the module: tests stand a fake device in
        if dev.is_cpu:  # own the memory, as a device copy would
            local = local.clone(memory_format=torch.contiguous_format)
        else:  # pinned staging, a non_blocking copy on the copy stream (staging.py)
            ring = staging.ring(dev)
            local = ring.stage(local)
            if not background:  # this thread uses it next: its stream waits for this copy
                ready = ring.seal()
                if ready is not None:
                    ready()
        return DTensor.from_local(
            local,
            dm,
            placements(mesh, axes),
            run_check=False,
            shape=torch.Size(global_shape),
            stride=contiguous_stride(global_shape),
        )

    def global_maker(self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]) -> MakeGlobal:
        # make_global itself: it looks the DeviceMesh up on every call, since a new default
        # process group (same ranks) needs a new one.
        return functools.partial(self.make_global, mesh, axes, global_shape)

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[list[LocalShard]]:
        if not tensors:
            return []
        rank = dist.get_rank()
        locals_, ranges = [], []
        for x in cast("Sequence[DTensor]", tensors):  # callers pass only is_global ones
            if any(p.is_partial() for p in x.placements):
                with guarded("global_to_host_array: reducing a Partial placement"):
                    x = _without_partial(x)
            if any(_is_strided(p) for p in x.placements):  # a rank's rows are not one block
                flat = [Shard(p.dim) if _is_strided(p) else p for p in x.placements]
                with guarded("global_to_host_array: moving a strided split to a plain one"):
                    x = _redistribute(x, x.device_mesh, flat)
            shape, offset = local_offset(x)
            ranges.append(tuple((o, o + n) for o, n in zip(offset, shape, strict=True)))
            locals_.append(x.to_local())
        # device -> pinned host memory for every leaf, then one synchronisation
        hosts = staging.read_back(locals_)
        return [[LocalShard(rank, r, h)] for r, h in zip(ranges, hosts, strict=True)]

    def local_ranges(self, x: torch.Tensor) -> dict[int, tuple[tuple[int, int], ...]] | None:
        x = cast(DTensor, x)  # callers pass only is_global ones
        if any(p.is_partial() for p in x.placements):
            return None  # partial sums: no layout of a value
        shape, offset = local_offset(x)
        return {dist.get_rank(): tuple((o, o + n) for o, n in zip(offset, shape, strict=True))}

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        what = "replicate_to_local_data"
        x = cast(DTensor, x)  # callers pass only is_global ones
        if not all(p.is_replicate() for p in x.placements):
            check_sizes(x, what)  # before the collective, whatever the agreement switch says
        with guarded(f"{what}: gathering a tensor of shape {tuple(x.shape)}"):
            x = _without_partial(x)
            if all(p.is_replicate() for p in x.placements):
                return _host_copy(x.to_local())
            view = _BYTE_VIEWS.get(x.dtype)
            if view is not None:
                return _reinterpret(x, view).full_tensor().view(x.dtype).cpu()
            return x.full_tensor().detach().cpu()

    def annotate(
        self, x: torch.Tensor, mesh: Mesh, axes: DimAxes, *, keep: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        if not isinstance(x, DTensor):
            raise TypeError(
                f"the dtensor backend constrains DTensors, but got {type(x).__name__}; make "
                "global tensors with host_to_global_array (or DTensor.from_local) on "
                f"{mesh!r}."
            )
        target = placements(mesh, axes)
        ranks = x.device_mesh.mesh.cpu().numpy()
        if not np.array_equal(ranks, mesh.devices):
            raise ShardingError(
                f"the DTensor lives on a DeviceMesh of ranks {ranks.tolist()} (axes "
                f"{x.device_mesh.mesh_dim_names}), not on the current mesh {mesh!r} (ranks "
                f"{mesh.devices.tolist()}); constrain it inside `with "
                "Mesh.from_device_mesh(x.device_mesh):`, or make it on the current mesh."
            )
        current = tuple(x.placements)
        if keep:
            target = _keeping(mesh, axes, keep, current, target)
        if all(type(a) is type(b) and a == b for a, b in zip(current, target, strict=True)):
            return x
        with guarded(f"maybe_shard: redistributing a tensor of shape {tuple(x.shape)}"):
            return _redistribute(x, x.device_mesh, target)

    def full_local(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x
        with guarded(f"dispatch: gathering a key of shape {tuple(x.shape)}"):
            x = _without_partial(x)
            if all(p.is_replicate() for p in x.placements):
                return x.to_local()
            view = _BYTE_VIEWS.get(x.dtype)
            if view is not None:
                return _reinterpret(x, view).full_tensor().view(x.dtype)
            return x.full_tensor()

    def take_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x.index_select(0, index.to(x.device))
        index = self.full_local(index)
        with guarded(f"dispatch: gathering rows of a tensor of shape {tuple(x.shape)}"):
            return _take_rows(x, index)

    splits_unevenly = True  # Shard(d) of a size the mesh axis does not divide

    def move_rows(
        self,
        x: torch.Tensor,
        targets: torch.Tensor,
        logical: int,
        mesh: Mesh,
        axes: tuple[str, ...],
    ) -> torch.Tensor | None:
        return None  # take_rows: the key's all-gather, then one reduce-scatter of the rows

    def check_layout(self, mesh: Mesh, axes: DimAxes) -> None:
        placements(mesh, axes)

    def is_sharded(self, x: torch.Tensor) -> bool:
        return True  # a DTensor always has placements


class DTensorChecks:
    """The agreement step, the value check and the set-up collectives (``ProcessChecks``)."""

    def prepare(self, mesh: Mesh) -> None:
        device_mesh(mesh)

    def compares(self, mesh: Mesh) -> bool:
        return agreement_check_enabled() and dist.get_world_size() > 1

    def agree_begin(self, mesh: Mesh, call: AgreementCall, *, what: str) -> Callable[[], None]:
        if not self.compares(mesh):
            return _nothing
        # The mesh is part of what the processes compare: meshes built with the axes in
        # another order (or over other ranks) place the same spec differently.
        # eager: its end may be deferred (agree_after), so its second round must not wait
        end = collective.begin(what, with_mesh(call.describe(), mesh), eager=True)

        def agree_end() -> None:
            verdict = in_step(what, end())
            if not verdict.agreed:
                raise disagreement(what, verdict.groups, call.path)

        return agree_end

    def agree_after(
        self, mesh: Mesh, end: Callable[[], None], call: AgreementCall, out: Any, *, what: str
    ) -> Any:
        if end is _nothing:
            return out
        if not deferred.deferring(dist.get_world_size()):
            end()
            return out
        return deferred.defer(end, out, call.leaves[0], what)

    def settle(self, mesh: Mesh, where: str) -> None:
        deferred.settle(where)

    def check_values(
        self, mesh: Mesh, tree: Any, *, argname: str, what: str, force: bool = False
    ) -> None:
        if (force or value_check_enabled()) and dist.get_world_size() > 1:
            check_values(tree, argname, what)

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
        if not (self.compares(mesh) or (force and dist.get_world_size() > 1)):
            return None
        return exchange_in_step(what, with_mesh(items, mesh), channel, counts)

    def begin_exchange(
        self,
        mesh: Mesh,
        items: Sequence[str],
        *,
        what: str = "torchshard",
        channel: str | None = None,
    ) -> Callable[[], Verdict | None]:
        if not self.compares(mesh):
            return _agreed
        end = collective.begin(what, with_mesh(items, mesh), channel)
        return lambda: in_step(what, end())

    def open_channel(self, mesh: Mesh, *, what: str, force: bool = False) -> str | None:
        if not (self.compares(mesh) or (force and dist.get_world_size() > 1)):
            return None
        opened = collective.open_channel(what)  # on the calling thread, in program order
        if opened is None:
            return None
        channel, verdict = opened
        in_step(what, verdict)  # the only item is alike: only the calls can differ
        return channel

    def close_channel(self, mesh: Mesh, channel: str, *, finished: bool, taken: int) -> None:
        collective.close_channel(channel, finished=finished, taken=taken)


def _agreed() -> None:
    return None


_DTENSOR = DTensorRuntime()
BACKEND = Backend(
    "dtensor",
    place=_DTENSOR,
    read=_DTENSOR,
    step=_DTENSOR,
    meshes=DTensorMeshes(),
    limits=_DTENSOR,
    processes=DTensorChecks(),
    threads=_DTENSOR,
    views=DTensorViews(),
)
register(BACKEND)
