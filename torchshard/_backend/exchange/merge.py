"""What an exchange's values are and how two subtrees' values merge into one.

Every value that travels up the tree is already a merge (a leaf's own value is the merge of
one process), so a node merges its own value with its children's, children in rank order, and
passes the result up; the root's merge is the result every process receives. A merge costs what
the *distinct* values cost, not what the processes do: ranks are ``RankSet`` ranges.

Kinds (``"K"``):

- ``"agree"``: each process's call name and the digest of its description, and a vector of ints
  (``"s"``/``"lo"``/``"hi"``: sum, min and max over the processes, e.g. a loader's real rows and
  ended sources). Merged: the distinct ``(what, digest)`` groups with their ranks (at most
  ``MAX_GROUPS``, the rest in one overflow group), and the vectors reduced.
- ``"items"``: the second round of an ``"agree"`` that found different digests: one description
  per distinct digest, for the error.
- ``"replicas"``: the value check. Per block (a leaf and the global ranges a process holds), the
  first checksum, the processes seen, how many hold the block (``need``) and the other
  checksums seen. A block whose holders have all been seen with one checksum is *resolved* and
  dropped where that happens (replicas of a tensor-parallel group meet low in the tree), so what
  goes up is what is still open or differs.

Two values of different kinds or calls at one exchange are processes out of step: the merge
keeps each call's name and ranks (``"mixed"``), and every process raises naming them.
"""

from __future__ import annotations

from typing import Any

from torchshard._core.ranks import MAX_RANGES, RankSet

MAX_GROUPS = 32  # distinct values a merge keeps; the rest are counted in one overflow group
OTHER = "(other values)"  # the overflow group's name and digest


def agree_value(what: str, digest: str, stats: list[int], rank: int) -> dict[str, Any]:
    """One process's value of an ``"agree"`` exchange."""
    return {
        "K": "agree",
        "g": [[what, digest, [rank, rank, 0]]],
        "s": list(stats),
        "lo": list(stats),
        "hi": list(stats),
    }


def items_value(what: str, digest: str, items: list[str], rank: int) -> dict[str, Any]:
    """One process's value of the ``"items"`` round."""
    return {"K": "items", "g": [[what, digest, [rank, rank, 0], items]]}


def replicas_value(what: str, blocks: dict[str, tuple[str, int]], rank: int) -> dict[str, Any]:
    """One process's value of the value check: ``blocks`` maps a block's key (its leaf and
    global ranges) to ``(checksum, how many processes hold that block)``."""
    me = [rank, rank, 0]
    return {
        "K": "replicas",
        "w": [[what, me]],
        "b": {k: [c, 1, need, me, {}] for k, (c, need) in blocks.items()},
    }


def whats(value: dict[str, Any]) -> list[tuple[str, RankSet]]:
    """The calls in ``value`` and the ranks in each."""
    kind = value["K"]
    if kind in ("agree", "items", "mixed"):
        rows = [(g[0], RankSet.from_wire(g[2])) for g in value["g"]]
    else:
        rows = [(w, RankSet.from_wire(r)) for w, r in value["w"]]
    out: dict[str, RankSet] = {}
    for w, ranks in rows:
        out[w] = out[w] | ranks if w in out else ranks
    return sorted(out.items(), key=lambda wr: wr[1].first if wr[1].ranges else 1 << 62)


def _mixed(values: list[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, RankSet] = {}
    for v in values:
        for w, ranks in whats(v):
            rows[w] = rows[w] | ranks if w in rows else ranks
    return {"K": "mixed", "g": [[w, "", r.to_wire()] for w, r in rows.items()]}


def _union(wires: list[list[int]]) -> list[int]:
    """The union of ``RankSet`` wire forms, as a wire form."""
    if len(wires) == 1:
        return wires[0]
    if all(len(w) == 3 and not w[2] for w in wires):  # one range each: the usual case
        spans = sorted((w[0], w[1]) for w in wires)
        out = [spans[0][0], spans[0][1]]
        for lo, hi in spans[1:]:
            if lo <= out[-1] + 1:
                out[-1] = max(out[-1], hi)
            else:
                out += [lo, hi]
        if len(out) <= 2 * MAX_RANGES:
            return [*out, 0]
    pairs = [(w[i], w[i + 1]) for w in wires for i in range(0, len(w) - 1, 2)]
    return RankSet(pairs, sum(w[-1] for w in wires)).to_wire()


def _agree_alike(values: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The merge of ``"agree"`` values of one group each, all the same call and digest, with
    counts of one length (what nearly every exchange is); ``None`` otherwise."""
    g0 = values[0]["g"]
    if len(g0) != 1:
        return None
    what, code, _ = g0[0]
    n = len(values[0]["s"])
    wires = []
    for v in values:
        g = v["g"]
        if len(g) != 1 or g[0][1] != code or g[0][0] != what or len(v["s"]) != n:
            return None
        wires.append(g[0][2])
    if n:
        sums = [sum(c) for c in zip(*(v["s"] for v in values), strict=True)]
        lo = [min(c) for c in zip(*(v["lo"] for v in values), strict=True)]
        hi = [max(c) for c in zip(*(v["hi"] for v in values), strict=True)]
    else:
        sums, lo, hi = [], [], []
    return {"K": "agree", "g": [[what, code, _union(wires)]], "s": sums, "lo": lo, "hi": hi}


def merge(values: list[dict[str, Any]]) -> dict[str, Any]:
    """The merge of ``values`` (lowest ranks first)."""
    first = values[0]
    kind = first["K"]
    if kind == "mixed" or any(v["K"] != kind for v in values):
        return _mixed(values)
    if kind == "replicas":
        return _merge_replicas(values)
    if kind == "agree":
        fast = _agree_alike(values)
        if fast is not None:
            return fast
    what = first["g"][0][0]
    ranks: dict[tuple[str, str], list[list[int]]] = {}
    items: dict[tuple[str, str], list[Any]] = {}
    for v in values:
        for g in v["g"]:
            w = g[0]
            if w != what and w != OTHER:
                return _mixed(values)
            key = (w, g[1])
            if key in ranks:
                ranks[key].append(g[2])
            else:
                ranks[key] = [g[2]]
                items[key] = g[3:]
    if len(ranks) > MAX_GROUPS:  # the rest in one overflow group
        keys = list(ranks)
        extra = [w for k in keys[MAX_GROUPS:] for w in ranks.pop(k)]
        for k in keys[MAX_GROUPS:]:
            items.pop(k)
        ranks.setdefault((OTHER, OTHER), []).extend(extra)
        items.setdefault((OTHER, OTHER), [])
    out: dict[str, Any] = {
        "K": kind,
        "g": [[w, d, _union(rs), *items[(w, d)]] for (w, d), rs in ranks.items()],
    }
    if kind == "agree":
        n = max(len(v["s"]) for v in values)
        pad = [0] * n  # processes that count different things are in other groups already

        def column(k: str) -> list[list[int]]:
            return [v[k] if len(v[k]) == n else (v[k] + pad)[:n] for v in values]

        out["s"] = [sum(c) for c in zip(*column("s"), strict=True)]
        out["lo"] = [min(c) for c in zip(*column("lo"), strict=True)]
        out["hi"] = [max(c) for c in zip(*column("hi"), strict=True)]
    return out


def _merge_replicas(values: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {w for v in values for w, _ in v["w"]}
    if len(rows) > 1:
        return _mixed(values)
    ranks = RankSet()
    blocks: dict[str, list[Any]] = {}
    for v in values:
        ranks = ranks | RankSet.from_wire(v["w"][0][1])
        for key, (checksum, seen, need, holders, others) in v["b"].items():
            mine = blocks.get(key)
            if mine is None:
                blocks[key] = [checksum, seen, need, holders, dict(others)]
                continue
            mine[1] += seen
            if checksum == mine[0]:
                mine[3] = (RankSet.from_wire(mine[3]) | RankSet.from_wire(holders)).to_wire()
            else:
                _add_other(mine[4], checksum, holders)
            for c, r in others.items():
                if c == mine[0]:
                    mine[3] = (RankSet.from_wire(mine[3]) | RankSet.from_wire(r)).to_wire()
                else:
                    _add_other(mine[4], c, r)
    open_ = {k: b for k, b in blocks.items() if b[4] or b[1] < b[2]}
    return {"K": "replicas", "w": [[values[0]["w"][0][0], ranks.to_wire()]], "b": open_}


def _add_other(others: dict[str, list[int]], checksum: str, holders: list[int]) -> None:
    if checksum in others:
        both = RankSet.from_wire(others[checksum]) | RankSet.from_wire(holders)
        others[checksum] = both.to_wire()
    elif len(others) < MAX_GROUPS:
        others[checksum] = holders
