"""The DTensor backend's checks across processes: the agreement step's exchange, the opt-in
value check, and the size check before a gather. Each is one bounded, named exchange
(``collective.py``), so every process raises the same error instead of one hanging."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchshard._backend.dtensor import collective
from torchshard._backend.dtensor._torch_private import local_offset
from torchshard._core.errors import ProcessDisagreementError, at
from torchshard._core.ranks import RankSet
from torchshard._core.tree import LazyPaths, flatten
from torchshard._core.verdict import Group, Verdict, ranks_text


def exchange_in_step(
    what: str, items: Sequence[str], channel: str | None = None, counts: Sequence[int] = ()
) -> Verdict:
    """Every process's ``items`` compared and ``counts`` reduced (the exchange of
    ``collective`` on ``channel``, default the caller's stream; bounded by the default group's
    timeout), without the call names. Processes that are in different calls (``what`` differs:
    one skipped a call) all raise ``ProcessDisagreementError``."""
    return in_step(what, collective.exchange(what, items, channel, counts))


def in_step(what: str, verdict: Verdict) -> Verdict:
    """``verdict`` without the call names; raises when the processes are in different calls."""
    if not verdict.agreed:
        whats: dict[str, RankSet] = {}
        for g in verdict.groups:
            w = g.items[0] if g.items else ""
            whats[w] = whats[w] | g.ranks if w in whats else g.ranks
        if len(whats) > 1:
            seen = "; ".join(f"{ranks_text(r)}: {w}" for w, r in whats.items())
            raise ProcessDisagreementError(
                at(
                    what,
                    f"the processes are out of step, each in another torchshard call ({seen}). "
                    "Every process must make the same torchshard calls in the same order (the "
                    "same host_to_global_array calls, the same loader batches, the same "
                    "read-backs).",
                )
            )
    return verdict.without_first()


def check_sizes(x: DTensor, what: str) -> None:
    """Before a gather: every process must hold a DTensor of the same global shape, dtype,
    placements and mesh, and its local block must be the one DTensor expects. Otherwise gloo's
    all-gather would abort one process and leave another with uninitialised memory (processes
    that passed different shapes with the agreement check off). Checked through one exchange,
    so every process raises the same error."""
    expected = tuple(local_offset(x)[0])
    local = tuple(x.to_local().shape)
    dtype = str(x.dtype).removeprefix("torch.")
    layout = f"placements {list(x.placements)} on ranks {x.device_mesh.mesh.tolist()}"
    item = f"a DTensor of global shape {tuple(x.shape)}, {dtype}, {layout}"
    if local != expected:
        item += f", whose local block is {local} where DTensor expects {expected}"
    verdict = exchange_in_step(f"{what}: checking sizes before the gather", [item])
    if verdict.agreed:
        return
    seen = "; ".join(f"{g.items[0]} on rank(s) [{g.ranks}]" for g in verdict.groups)
    raise ProcessDisagreementError(
        at(
            what,
            f"every process must gather the same tensor, but found {seen}. The "
            "processes passed different shapes or dtypes when it was made (with the agreement "
            "check off, see set_agreement_check, or DTensor.from_local with a wrong shape); "
            "nothing was gathered.",
        )
    )


def _checksum(t: torch.Tensor) -> str:
    """A 16-hex-digit blake2b of ``t``'s bytes (any dtype; bit patterns, so -0.0 != 0.0): its
    values' bytes, a lazy conjugate or negative view resolved (``x.conj()`` of a DTensor)."""
    flat = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().data if flat.numel() else b""  # a view, no copy
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def check_values(tree: Any, argname: str, what: str) -> None:
    """Processes whose blocks of a DTensor in ``tree`` cover the same global ranges must hold
    the same values (``set_value_check``): one exchange in which each process passes a checksum
    per block it holds, merged per block up the tree (a block is settled where all its holders
    have met: ``_backend/exchange/merge.py``)."""
    leaves, treespec = flatten(tree)
    blocks: dict[str, tuple[str, int]] = {}
    for i, x in enumerate(leaves):
        if not isinstance(x, DTensor):
            continue
        shape, offset = local_offset(x)
        held = tuple((o, o + n) for o, n in zip(offset, shape, strict=True))
        holders = 1
        for size, p in zip(x.device_mesh.mesh.shape, x.placements, strict=True):
            if p.is_replicate():
                holders *= int(size)
        blocks[f"{i} {held}"] = (_checksum(x.to_local()), holders)
    conflicts = collective.replicas(f"{what}: the value check", blocks)
    if not conflicts:
        return
    where = LazyPaths(treespec, argname)
    key, rows = conflicts[0]
    if not key:  # processes in different calls
        in_step(what, Verdict(tuple(Group(r, (w,)) for w, r in rows), len(rows)))
    leaf, _, ranges = key.partition(" ")
    seen = "; ".join(f"checksum {c} on rank(s) [{r}]" for c, r in rows)
    holders = functools.reduce(lambda a, b: a | b, (r for _, r in rows))

    def ranks_of(other: list[Any]) -> RankSet:
        return functools.reduce(lambda a, b: a | b, (r for _, r in other))

    also = "".join(  # every block whose holders differ is named, not only the first
        f" The ranks [{ranks_of(other)}] (global ranges {k.partition(' ')[2]}) differ too."
        if k.partition(" ")[0] == leaf
        else f" {where[int(k.partition(' ')[0])]}: the ranks [{ranks_of(other)}] (global "
        f"ranges {k.partition(' ')[2]}) differ too."
        for k, other in conflicts[1:8]
    )
    raise ProcessDisagreementError(
        at(
            where[int(leaf)],
            f"{what}: the ranks [{holders}] hold the same block (global ranges {ranges}, "
            "one (start, stop) per dimension) and must pass the same values, but "
            f"found {seen}.{also} A replicated leaf (P()) or a mesh axis the spec leaves "
            "free gives several processes the same block: give them equal values, or "
            "shard the leaf over that axis. A loader's feed that reads one shard per "
            "process gives them different examples: read the shard of the mesh's "
            "data axes, torchshard.feed_read_config(spec) (or "
            "torchshard.host_sampler(dataset, spec)), which gives the processes "
            "that share a block the same one.",
        )
    )
