"""The DTensor backend's checks across processes: the agreement step's exchange, the opt-in
value check, and the size check before a gather. Each is one bounded, named exchange
(``collective.py``), so every process raises the same error instead of one hanging."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchshard._backend.dtensor import collective
from torchshard._backend.dtensor._torch_private import local_offset
from torchshard._core.errors import ProcessDisagreementError, at
from torchshard._core.tree import LazyPaths, flatten


def exchange_in_step(
    what: str, items: Sequence[str], channel: str | None = None
) -> list[list[str]] | None:
    """Every process's ``items`` when they differ, ``None`` when they agree (the store-based
    exchange of ``collective`` on ``channel``, default the calling thread's; bounded by the
    default group's timeout). Processes that are in different calls (``what`` differs: one
    skipped a call) all raise ``ProcessDisagreementError``."""
    return in_step(what, collective.exchange(what, items, channel))


def in_step(what: str, every: list[list[str]] | None) -> list[list[str]] | None:
    """``every`` without the call names; raises when the processes are in different calls."""
    if every is None:
        return None
    whats = [e[0] for e in every]
    if len(set(whats)) > 1:
        seen = "; ".join(f"rank {r}: {w}" for r, w in enumerate(whats))
        raise ProcessDisagreementError(
            at(
                what,
                f"the processes are out of step, each in another torchshard call ({seen}). "
                "Every process must make the same torchshard calls in the same order (the same "
                "host_to_global_array calls, the same loader batches, the same read-backs).",
            )
        )
    return [e[1:] for e in every]


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
    every = exchange_in_step(f"{what}: checking sizes before the gather", [item])
    if every is None:
        return
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(every):
        groups.setdefault(e[0], []).append(r)
    seen = "; ".join(f"{d} on rank(s) {rs}" for d, rs in groups.items())
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


def _ranks(by_checksum: dict[str, list[int]]) -> list[int]:
    return sorted(r for ranks in by_checksum.values() for r in ranks)


def check_values(tree: Any, argname: str, what: str) -> None:
    """Processes whose blocks of a DTensor in ``tree`` cover the same global ranges must hold
    the same values (``set_value_check``): one exchange of a checksum per leaf and process."""
    leaves, treespec = flatten(tree)
    mine = []
    for x in leaves:
        if not isinstance(x, DTensor):
            mine.append("-")
            continue
        shape, offset = local_offset(x)
        held = tuple((o, o + n) for o, n in zip(offset, shape, strict=True))
        mine.append(f"{held} {_checksum(x.to_local())}")
    every = collective.gather_all(f"{what}: the value check", mine)
    if every is None:
        return
    where = LazyPaths(treespec, argname)
    for i in range(len(leaves)):
        by_ranges: dict[str, dict[str, list[int]]] = {}
        for r, items in enumerate(every):
            ranges, _, checksum = items[i].rpartition(" ")
            by_ranges.setdefault(ranges, {}).setdefault(checksum, []).append(r)
        bad = [(ranges, sums) for ranges, sums in by_ranges.items() if len(sums) > 1]
        if not bad:
            continue
        ranges, sums = bad[0]
        seen = "; ".join(f"checksum {c} on rank(s) {rs}" for c, rs in sums.items())
        also = "".join(  # every block whose holders differ is named, not only the first
            f" The ranks {_ranks(other)} (global ranges {block}) differ too."
            for block, other in bad[1:]
        )
        raise ProcessDisagreementError(
            at(
                where[i],
                f"{what}: the ranks {_ranks(sums)} hold the same block (global ranges {ranges}, "
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
