"""The torchax backend's checks across JAX processes: the agreement step's exchange, the
opt-in value check, and the size check before a gather. Each is one bounded, named exchange
(``collective.py``), so every process raises the same error (the DTensor backend's wording)
instead of one hanging or computing with another's data."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend.protocols import AgreementCall
from torchshard._backend.torchax import collective
from torchshard._backend.torchax.runtime import (
    X64_FIX,
    array_of,
    fetch,
    is_torchax_tensor,
    x64,
)
from torchshard._core.agreement import (
    agreement_check_enabled,
    disagreement,
    value_check_enabled,
    with_mesh,
)
from torchshard._core.errors import ProcessDisagreementError, at
from torchshard._core.mesh import Mesh
from torchshard._core.ranks import RankSet
from torchshard._core.tree import LazyPaths, flatten
from torchshard._core.verdict import Group, Verdict, ranks_text


def in_step(what: str, verdict: Verdict) -> Verdict:
    """``verdict`` without the call names; raises ``ProcessDisagreementError`` when the
    processes are in different calls (one skipped a call)."""
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


def exchange_in_step(
    what: str, items: Sequence[str], channel: str | None = None, counts: Sequence[int] = ()
) -> Verdict:
    """Every process's ``items`` compared and ``counts`` reduced, without the call names."""
    return in_step(what, collective.exchange(what, items, channel, counts))


def _ranges(index: Any, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(index, shape, strict=True))


def describe_array(array: Any) -> str:
    """A global array's shape, dtype and layout, as the processes compare them."""
    sharding = array.sharding
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    where = (
        f"spec {spec} on mesh {dict(mesh.shape)}" if mesh is not None else f"sharding {sharding}"
    )
    return f"an array of global shape {tuple(array.shape)}, {array.dtype}, {where}"


def check_sizes(array: Any, what: str) -> None:
    """Before a gather: every process must hold an array of the same global shape, dtype and
    layout; otherwise the gather would compile a different program per process (a hang, or
    another process's data). One exchange, so every process raises the same error."""
    verdict = exchange_in_step(f"{what}: checking sizes before the gather", [describe_array(array)])
    if verdict.agreed:
        return
    seen = "; ".join(f"{g.items[0]} on {ranks_text(g.ranks)}" for g in verdict.groups)
    raise ProcessDisagreementError(
        at(
            what,
            f"every process must gather the same array, but found {seen}. The processes "
            "passed different shapes or dtypes when it was made (with the agreement check off, "
            "see set_agreement_check); nothing was gathered.",
        )
    )


def _checksum(a: np.ndarray) -> str:
    """A 16-hex-digit blake2b of ``a``'s bytes (bit patterns: -0.0 != 0.0)."""
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return hashlib.blake2b(flat.data if flat.size else b"", digest_size=8).hexdigest()


def _holders(array: Any) -> dict[tuple[tuple[int, int], ...], int]:
    """Per block of ``array`` (its global ranges), the number of processes holding it."""
    shape = tuple(array.shape)
    owners: dict[tuple[tuple[int, int], ...], set[int]] = {}
    for device, index in array.sharding.devices_indices_map(shape).items():
        owners.setdefault(_ranges(index, shape), set()).add(int(device.process_index))
    return {k: len(v) for k, v in owners.items()}


def check_values(tree: Any, argname: str, what: str) -> None:
    """Processes whose blocks of a global array in ``tree`` cover the same global ranges must
    hold the same values (``set_value_check``): one exchange in which each process passes a
    checksum per block it holds, merged per block up the tree."""
    leaves, treespec = flatten(tree)
    blocks: dict[str, tuple[str, int]] = {}
    for i, x in enumerate(leaves):
        if not is_torchax_tensor(x):
            continue
        array = array_of(x)
        shape = tuple(array.shape)
        holders = _holders(array)
        mine: dict[tuple[tuple[int, int], ...], Any] = {}
        for shard in array.addressable_shards:
            mine.setdefault(_ranges(shard.index, shape), shard.data)
        datas = fetch(list(mine.values()))
        for held, data in zip(mine, datas, strict=True):
            blocks[f"{i} {held}"] = (_checksum(data), holders[held])
    conflicts = collective.replicas(f"{what}: the value check", blocks)
    if not conflicts:
        return
    where = LazyPaths(treespec, argname)
    key, rows = conflicts[0]
    if not key:  # processes in different calls
        in_step(what, Verdict(tuple(Group(r, (w,)) for w, r in rows), len(rows)))
    leaf, _, ranges = key.partition(" ")
    seen = "; ".join(f"checksum {c} on rank(s) [{r}]" for c, r in rows)
    holders_ = functools.reduce(lambda a, b: a | b, (r for _, r in rows))

    def ranks_of(other: list[Any]) -> RankSet:
        return functools.reduce(lambda a, b: a | b, (r for _, r in other))

    also = "".join(
        f" The ranks [{ranks_of(other)}] (global ranges {k.partition(' ')[2]}) differ too."
        if k.partition(" ")[0] == leaf
        else f" {where[int(k.partition(' ')[0])]}: the ranks [{ranks_of(other)}] (global "
        f"ranges {k.partition(' ')[2]}) differ too."
        for k, other in conflicts[1:8]
    )
    raise ProcessDisagreementError(
        at(
            where[int(leaf)],
            f"{what}: the ranks [{holders_}] hold the same block (global ranges {ranges}, "
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


_BEYOND = ", a value beyond "


def beyond_32_bits(leaves: Sequence[Any], items: list[str]) -> list[int] | None:
    """While ``jax_enable_x64`` is off, marks in ``items`` (a call's description: its structure,
    then one line per leaf) each 64-bit integer leaf holding a value that does not fit in 32
    bits, so that the processes compare it: one process's value would fail its placement
    alone. The leaves marked (``None``: no 64-bit integer leaf to look at)."""
    if x64():
        return None
    found: list[int] | None = None
    for i, leaf in enumerate(leaves):
        dtype = getattr(leaf, "dtype", None)
        if dtype not in (torch.int64, np.int64):
            continue
        found = [] if found is None else found
        values = leaf.numpy() if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
        if values.size:
            lo, hi = values.min(), values.max()
            info = np.iinfo(np.int32)
            if lo < info.min or hi > info.max:
                bad = int(lo if lo < info.min else hi)
                items[1 + i] += f"{_BEYOND}int32 ({bad})"
                found.append(i)
    return found


def beyond_32_bits_error(
    what: str, groups: Sequence[Group], path: Callable[[int], str]
) -> ProcessDisagreementError | None:
    """The error of processes whose only difference is a 64-bit value beyond 32 bits."""
    lines = [g.items for g in groups]
    if len({len(items) for items in lines}) != 1:
        return None
    for i in range(1, len(lines[0])):
        seen = [items[i] for items in lines]
        if len(set(seen)) == 1:
            continue
        if len({s.partition(_BEYOND)[0] for s in seen}) != 1:
            return None  # the shapes or dtypes differ too: the general error
        wide = [(s.partition(_BEYOND)[2], g.ranks) for s, g in zip(seen, groups, strict=True)]
        named = "; ".join(f"{v} on {ranks_text(r)}" for v, r in wide if v)
        return ProcessDisagreementError(
            at(
                path(i - 1),
                f"{what}: a 64-bit integer leaf holds a value beyond {named}, but JAX holds no "
                "64-bit integers while jax_enable_x64 is off (its default): torchshard places "
                "such a leaf as int32 only when every process's values fit (JAX itself would "
                f"wrap them silently). Turn 64-bit values on: {X64_FIX}; or keep the values "
                "within int32 on the host.",
            )
        )
    return None


def _nothing() -> None:
    return None


def _agreed() -> None:
    return None


class TorchaxChecks:
    """The agreement step, the value check and the set-up (``ProcessChecks``) between JAX
    processes."""

    def prepare(self, mesh: Mesh) -> None:
        collective.session()  # the tree is joined on the program's thread, never a loader's

    def compares(self, mesh: Mesh) -> bool:
        return agreement_check_enabled() and collective.world() > 1

    def agree_begin(self, mesh: Mesh, call: AgreementCall, *, what: str) -> Callable[[], None]:
        if not self.compares(mesh):
            return _nothing
        items = with_mesh(call.describe(), mesh)
        marked = beyond_32_bits(call.leaves[0], items)
        end = collective.begin(what, items)

        def agree_end() -> None:
            verdict = in_step(what, end())
            if not verdict.agreed:
                if marked is not None:
                    wide = beyond_32_bits_error(what, verdict.groups, call.path)
                    if wide is not None:
                        raise wide
                raise disagreement(what, verdict.groups, call.path)

        return agree_end

    def agree_after(
        self, mesh: Mesh, end: Callable[[], None], call: AgreementCall, out: Any, *, what: str
    ) -> Any:
        end()  # judged now: nothing is deferred on this backend
        return out

    def settle(self, mesh: Mesh, where: str) -> None:
        return None  # no deferred check to judge

    def check_values(
        self, mesh: Mesh, tree: Any, *, argname: str, what: str, force: bool = False
    ) -> None:
        if (force or value_check_enabled()) and collective.world() > 1:
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
        if not (self.compares(mesh) or (force and collective.world() > 1)):
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
        if not (self.compares(mesh) or (force and collective.world() > 1)):
            return None
        opened = collective.open_channel(what)  # on the calling thread, in program order
        if opened is None:
            return None
        channel, verdict = opened
        in_step(what, verdict)
        return channel

    def close_channel(self, mesh: Mesh, channel: str, *, finished: bool, taken: int) -> None:
        collective.close_channel(channel, finished=finished, taken=taken)
