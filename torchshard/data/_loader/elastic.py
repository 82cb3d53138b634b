"""Positions that resume on any number of processes: the *elastic* sources' protocol, and the
job's position gathered from every process into the state's common entry.

A source's own state is per process (what *its* shard has read). An elastic source can also say
what that state means for the whole job, and restart its share of the job from there on any
layout. It has three members:

- ``elastic_part(state)``: this process's part of the job's position, as JSON-able values,
  from one of the source's own states (a snapshot the loader took after a batch: never the live
  source, which has read ahead);
- ``merge_elastic_parts(parts)`` (a ``classmethod``/``staticmethod``): the job's position from
  the distinct parts of every process (the processes of one feed pass equal parts); the same
  on every process, whatever the order of ``parts``; raises ``ValueError`` for parts that
  contradict each other;
- ``load_elastic_state(position)``: the next pass restarts this process's share of the job at
  ``position``, on the current layout (its feed, from the mesh, may differ from the saving
  process's).

grain's ``ElasticIterator`` (a global index, the same on every process: through
``torchshard.integrations.grain.elastic_iterator``), ``torchshard.sharded_stream`` (every
shard's position: the unfinished shards split again) and torchtitan's grain loader are
elastic. ``gather`` exchanges the parts between the processes when the state is saved (through
the backend's ``ProcessChecks.exchange``, a collective bounded by the default group's timeout),
so that the common entry holds the job's position and ``torch.distributed.checkpoint`` (which
keeps one common value) or Lightning (which keeps rank 0's state) resume from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from torchshard._core.mesh import Mesh

METHODS = ("elastic_part", "merge_elastic_parts", "load_elastic_state")


def elastic(source: Any) -> bool:
    """Whether ``source`` resumes from the job's position on any number of processes."""
    return all(callable(getattr(source, m, None)) for m in METHODS)


def kind(source: Any) -> str:
    """The type a position was saved by (a later load checks it)."""
    t = type(source)
    return f"{t.__module__}.{t.__qualname__}"


def _distinct(result: Any, mine: Sequence[str]) -> list[tuple[str, ...]]:
    """The distinct item lists of an exchange's result: ``None`` (one process, or all agreed on
    a backend that says so by ``None``), a list of each process's items, or a ``Verdict``
    (groups of processes by their items)."""
    if result is None:
        return [tuple(mine)]
    groups = getattr(result, "groups", None)
    if groups is not None:
        return [tuple(g.items) for g in groups]
    return list(dict.fromkeys(tuple(items) for items in result))


def gather(
    sources: Sequence[Any],
    states: Sequence[Any],
    *,
    mesh: Mesh | None,
    processes: Any,
    count: int,
) -> dict[str, Any] | None:
    """The job's position (``{"kind", "position"}``) from every process's elastic parts, or
    ``None`` unless every source is elastic and has a state. ``states``: this process's
    sources' snapshots; ``processes``: the backend's ``ProcessChecks`` (``None``: nothing to
    exchange with; ``count`` processes then must be 1, else ``None``: the parts stay in each
    process's entry). A collective on several processes: every process saves its state."""
    if not sources or not all(elastic(s) for s in sources) or any(s is None for s in states):
        return None
    parts = [
        json.dumps(s.elastic_part(st), sort_keys=True)
        for s, st in zip(sources, states, strict=True)
    ]
    if count > 1:
        if processes is None or mesh is None:
            return None
        item = json.dumps(sorted(set(parts)))
        result = processes.exchange(
            mesh, [item], what="GlobalBatchLoader.state_dict: the job's position", force=True
        )
        every = sorted({p for items in _distinct(result, [item]) for p in json.loads(items[-1])})
    else:
        every = sorted(set(parts))
    merged = type(sources[0]).merge_elastic_parts([json.loads(p) for p in every])
    return {"kind": kind(sources[0]), "position": merged}


def parts_of(sources: Sequence[Any], states: Sequence[Any]) -> list[Any] | None:
    """This process's parts (for its own entry), or ``None`` unless every source is elastic."""
    if not sources or not all(elastic(s) for s in sources) or any(s is None for s in states):
        return None
    return [s.elastic_part(st) for s, st in zip(sources, states, strict=True)]


def check(saved: Any, sources: Sequence[Any], where: str) -> dict[str, Any]:
    """A saved ``{"kind", "position"}``, checked against this loader's sources."""
    if not isinstance(saved, dict) or set(saved) != {"kind", "position"}:
        raise ValueError(
            f"{where}: expected the job's position of elastic sources ({{'kind', 'position'}}), "
            f"but got {saved!r:.80}."
        )
    mine = {kind(s) for s in sources}
    if not all(elastic(s) for s in sources) or mine != {saved["kind"]}:
        raise ValueError(
            f"{where}: saved by sources of type {saved['kind']}, but this loader's are "
            f"{sorted(mine)}; a position means something only to a source of its kind. Load "
            "it into a loader over the same kind of source."
        )
    return saved
