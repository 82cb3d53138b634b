"""The views each device receives: one view of its owner's host tensor per planned device,
cut as the leaf's ``HostPlan`` says (one ``tensor_split`` when a single dimension is cut, else
``narrow``s). Nothing is copied on the host."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from torchshard._backend.protocols import MakeGlobal
from torchshard._core.blocks import HostPlan


def one_host_placer(plan: HostPlan, make: MakeGlobal) -> Callable[[torch.Tensor], torch.Tensor]:
    """The host tensor -> its global tensor, for a plan whose pieces all come from one host,
    specialised once: one ``tensor_split`` when it gives the pieces in order (dim 0 split over
    the devices in their order, the common case), else ``device_shards``; then ``make``. A
    maker with ``from_whole`` (torchax's: JAX cuts its blocks by index, as
    ``make_array_from_process_local_data`` does) takes a host tensor that is the whole global
    array as it is."""
    whole = getattr(make, "from_whole", None)
    if whole is not None and plan.local_shape == plan.global_shape:
        return cast(Callable[[torch.Tensor], torch.Tensor], whole)  # the backend cuts the blocks
    split = plan.single_split
    if split is not None and plan.split_parts == tuple(range(len(plan.pieces))):
        dim, chunk = split
        parts = plan.local_shape[dim] // chunk
        if parts == len(plan.pieces):
            return lambda t: make(t.tensor_split(parts, dim))
    slot = {plan.pieces[0].owner: 0} if plan.pieces else {}
    return lambda t: make(device_shards(plan, [t], slot))


def device_shards(plan: HostPlan, per: list[torch.Tensor], slot: dict[int, int]) -> list[Any]:
    """The view of its owner's tensor that each planned device receives (``per[slot[h]]`` is
    host ``h``'s tensor)."""
    split = plan.single_split
    if split is not None:  # one C++ call per owner instead of one narrow per device
        dim, chunk = split
        if len(slot) == 1:  # one host (the real path): no per-owner lookups
            t = per[0]
            parts = t.tensor_split(t.shape[dim] // chunk, dim)
            return [parts[i] for i in plan.split_parts]
        by_owner = {
            o: per[s].tensor_split(per[s].shape[dim] // chunk, dim) for o, s in slot.items()
        }
        return [by_owner[p.owner][i] for p, i in zip(plan.pieces, plan.split_parts, strict=True)]
    out = []
    for p in plan.pieces:
        t = per[slot[p.owner]]
        for dim, start, length in p.cuts:
            t = t.narrow(dim, start, length)
        out.append(t)
    return out


def narrowed(t: torch.Tensor, cuts: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """``t`` narrowed by ``cuts`` (a piece of a ``HostPlan``, in order)."""
    for dim, start, length in cuts:
        t = t.narrow(dim, start, length)
    return t
