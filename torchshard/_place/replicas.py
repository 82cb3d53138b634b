"""The virtual-host replica check: hosts that supply the same block of a leaf must pass equal
values for it, or the block's replicas would hold different hosts' values. Only under
``virtual_hosts``, where one process supplies every host's tree (on real hosts each process
passes its own data; ``set_value_check`` compares them on DTensor)."""

from __future__ import annotations

import torch

from torchshard._core.errors import ShardingError, at
from torchshard._place.call import CallPlan, HostCall
from torchshard._place.views import narrowed


def check_shared_values(call: HostCall, planned: CallPlan, hosts: list[list[torch.Tensor]]) -> None:
    """Raises ``ShardingError`` naming the leaf's path when hosts that supply the same block
    (``CallPlan.shared``) pass different values for it: each replica of the block would hold
    another host's values. Compares only the blocks hosts share."""
    slot = planned.slot
    for i, spec, blocks in planned.shared:
        for block in blocks:
            (first, first_cuts, first_devices), *others = block.owners
            ref = narrowed(hosts[slot[first]][i], first_cuts)
            for owner, cuts, devices in others:
                got = narrowed(hosts[slot[owner]][i], cuts)
                diff = _differ(ref, got)
                if diff is None:
                    continue
                at_ = tuple(r[0] + j for r, j in zip(block.ranges, diff, strict=True))
                rng = ", ".join(f"{a}:{b}" for a, b in block.ranges)
                raise ShardingError(
                    at(
                        call.paths[slot[owner]][i],
                        f"hosts {first} and {owner} supply the same "
                        f"block [{rng}] of this leaf under {spec!r} (devices {list(first_devices)} "
                        f"take host {first}'s values, devices {list(devices)} host {owner}'s), so "
                        "they must pass equal values for it, but they differ: at global index "
                        f"{at_} host {first} has {ref[diff].item()!r} and host {owner} has "
                        f"{got[diff].item()!r}. Pass the same values on every host that shares a "
                        "block (every host, for a replicated leaf), or use a spec under which each "
                        "host feeds its own rows (e.g. torchshard.input_partition_spec()).",
                    )
                )


def _differ(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...] | None:
    """The first index at which ``a`` and ``b`` differ (NaN equals NaN), or ``None``."""
    if torch.equal(a, b):
        return None
    unequal = a != b
    if a.is_floating_point():
        unequal &= ~(a.isnan() & b.isnan())
    where = unequal.nonzero()
    if where.shape[0] == 0:
        return None
    return tuple(int(j) for j in where[0])
