"""Placing: a planned call's host tensors handed to the backend as one view per device.

``place`` binds a cached plan to its backend once, at its first reuse (``bind``: per leaf the
backend's ``make_global`` with all but the shards bound, and, on one host, the views cut and
handed to it in one step), then per call only cuts views and calls the bound makers. The call
that made a plan, and any call whose plan is not cached, goes through
``Placement.make_global``. ``background``: the caller
is a loader's thread, and the backend may pick a transfer that releases the GIL.
``to_global`` is the plan (``cache.plan_call``), then ``place``: what every caller does once
it holds a ``HostCall``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeGuard

import torch

from torchshard._backend.protocols import Backend, MakeGlobal, Refused
from torchshard._core.blocks import HostPlan
from torchshard._core.errors import at
from torchshard._core.mesh import Mesh
from torchshard._core.topology import Topology
from torchshard._core.tree import unflatten
from torchshard._place.cache import plan_call
from torchshard._place.call import CallPlan, HostCall
from torchshard._place.host_data import as_host_tensor, host_tensors
from torchshard._place.replicas import check_shared_values
from torchshard._place.views import device_shards, one_host_placer


class Bound(NamedTuple):
    """A cached plan bound to its backend."""

    makers: list[MakeGlobal]
    """Per leaf, ``make_global`` (foreground) with everything but the shards bound."""
    placers: list[Callable[[torch.Tensor], torch.Tensor]] | None
    """On one host: per leaf, the host tensor -> its global tensor (views and maker)."""


def bind(backend: Backend, mesh: Mesh, planned: CallPlan) -> Bound:
    """``planned`` (a cached plan with no already-global leaf) bound to ``backend``."""
    makers = [
        backend.place.global_maker(mesh, p.axes, p.global_shape)
        for p in planned.plans
        if p is not None
    ]
    placers = None
    if len(planned.slot) == 1:
        placers = [one_host_placer(p, m) for p, m in zip(planned.plans, makers, strict=True) if p]
    return Bound(makers, placers)


def _all_planned(plans: list[HostPlan | None]) -> TypeGuard[list[HostPlan]]:
    """Whether every leaf has its plan (none is already global)."""
    return all(p is not None for p in plans)


def place(
    backend: Backend, mesh: Mesh, planned: CallPlan, call: HostCall, *, background: bool = False
) -> Any:
    """The output tree: each leaf's global tensor, from one view per planned device.

    ``background``: the caller is a loader's thread (see ``Placement.make_global``). A leaf
    whose values the backend refuses (``Refused``: torchax's 64-bit values) raises the
    backend's error with the leaf's path.
    """
    i = 0
    try:
        hosts = call.tensors  # set by validation: this call made the plan, and goes unbound
        bound = None
        if hosts is None:  # a cached plan's later call (never holding already-global leaves)
            bound = planned.bound
            if bound is None:
                bound = planned.bound = bind(backend, mesh, planned)
        if bound is not None and bound.placers is not None and not background:
            # The hot path (a training loop's repeated call): a cached plan, one host. The key
            # says the leaves need no checks: numpy leaves are converted, tensors used as they
            # are. (Every frame counts here: after a transfer the caches are cold; design.md.)
            out = []
            placers = bound.placers
            for i, x in enumerate(call.leaves[0]):
                if type(x) is not torch.Tensor:
                    x = as_host_tensor(x, call.paths[0].at(i))
                out.append(placers[i](x))
            return call.treespecs[0].unflatten(out)
        if hosts is None:  # a cached plan: the key says these leaves need no checks
            hosts = host_tensors(call)
        if planned.shared:
            check_shared_values(call, planned, hosts)
        slot = planned.slot
        per_leaf = [list(t) for t in zip(*hosts, strict=True)]
        make_global = backend.place.make_global
        plans = planned.plans
        out = []
        if not _all_planned(plans):  # leaves already global (never cached)
            for i, (per, p) in enumerate(zip(per_leaf, plans, strict=True)):  # noqa: B007 -- the except names leaf i
                out.append(
                    per[0]
                    if p is None
                    else make_global(
                        mesh,
                        p.axes,
                        p.global_shape,
                        device_shards(p, per, slot),
                        background=background,
                    )
                )
            return unflatten(call.treespec, out)
        if bound is not None and not background:
            makers = bound.makers
            for i, (per, p) in enumerate(zip(per_leaf, plans, strict=True)):
                out.append(makers[i](device_shards(p, per, slot)))
        else:
            if background:
                make_global = functools.partial(make_global, background=True)
            for i, (per, p) in enumerate(zip(per_leaf, plans, strict=True)):  # noqa: B007 -- the except names leaf i
                out.append(make_global(mesh, p.axes, p.global_shape, device_shards(p, per, slot)))
        return unflatten(call.treespec, out)
    except Refused as e:
        raise type(e.error)(at(call.paths[0].at(i), str(e.error))) from None


def to_global(
    mesh: Mesh, backend: Backend, topology: Topology, call: HostCall, *, background: bool = False
) -> Any:
    """``call``'s global tensors: its plans (validated, or the cached ones), then ``place``."""
    return place(
        backend, mesh, plan_call(mesh, backend, topology, call), call, background=background
    )
