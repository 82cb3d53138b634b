"""A loader's checkpoint: snapshots of its sources, and the layout of ``GlobalBatchLoader``'s state.

**Sources.** A source saves its position with ``state_dict()``/``load_state_dict()``
(torchdata's ``StatefulDataLoader`` and ``nodes.Loader``, a dataset of one's own) or with
``get_state()``/``set_state()`` (grain's iterators). A snapshot is a deep copy taken at the call
(``capture``): a source whose state holds live objects (a packing dataset's token buffer) would
otherwise change it as the loader reads ahead. Nothing here asks a source for its state except
to snapshot it after a batch the loader took from it: ``torchdata.nodes.Loader.state_dict()`` on
a fresh loader makes the iterator its next ``iter()`` returns, ignoring a state loaded since.
A source that reads a map-style dataset through ``torchshard.host_sampler`` (``sampler_of``)
can also be resumed from its position in the epoch's global order alone (``Position``), on any
number of hosts.

A grain dataset or ``DataLoader`` (``iterator_stateful``) keeps its state in the iterator each
``iter()`` makes: the loader snapshots that iterator (``holder``) and loads a saved state into
the next one.

**The loader's state** (``build``/``parse``): one entry per process, ``"process_<i>"`` (what
``torch.distributed.checkpoint`` keeps one of per key), holding the sources' states (pickled:
one opaque value per source, so the checkpoint's keys do not depend on what a source's state
holds) and the index of the next batch; and one entry all processes share, ``"common"``: the
loader's kind, how many processes and data hosts saved it, the epoch's global position when
the sources are ``host_sampler``'s (with the samplers' shard count, ``"shards"``: a state saved
over another count resumes from the position, even on as many processes), and the job's
position when they are elastic (``elastic.py``). States saved before ``"shards"`` or
``"elastic"`` was kept load as without them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from collections.abc import Sequence
from typing import Any

from torchshard.data._loader.elastic import check as elastic_check
from torchshard.data._loader.elastic import elastic as is_elastic
from torchshard.data._loader.elastic import kind as elastic_kind
from torchshard.data._sampler import HostSampler

COMMON = "common"
KIND = "GlobalBatchLoader"
COMMON_KEYS = (
    "consumed",
    "elastic",
    "epoch",
    "hosts",
    "loader",
    "num_examples",
    "processes",
    "seed",
    "shards",
    "shuffle",
)
# Keys a state saved by an earlier release may lack (it loads as if they were None: an unknown
# shard count, no job position).
ADDED_COMMON_KEYS = ("elastic", "shards")


def process_key(index: int) -> str:
    """The key of process ``index``'s entry (``"process_3"``)."""
    return f"process_{index}"


# -- sources ------------------------------------------------------------------------------------


def _methods(source: Any) -> tuple[str, str] | None:
    for get, put in (("state_dict", "load_state_dict"), ("get_state", "set_state")):
        if callable(getattr(source, get, None)) and callable(getattr(source, put, None)):
            return get, put
    return None


def stateful(source: Any) -> bool:
    """Whether ``source`` saves and restores its own position."""
    return _methods(source) is not None


# grain's datasets and DataLoader: each iter() makes an iterator that holds the position
# (get_state/set_state), the dataset or loader itself has none.
_ITERATOR_STATE_KINDS = ("MapDataset", "IterDataset", "DataLoader")


def iterator_stateful(source: Any) -> bool:
    """Whether ``source``'s position lives in the iterators it makes (grain's ``MapDataset``,
    ``IterDataset`` and ``DataLoader``), not in itself."""
    if stateful(source):
        return False
    return any(
        k.__module__.split(".")[0] == "grain" and k.__name__ in _ITERATOR_STATE_KINDS
        for k in type(source).__mro__
    )


def holder(source: Any, iterator: Any) -> Any:
    """What holds ``source``'s state while ``iterator`` (its current ``iter()``) runs: the source
    itself, or the iterator of an iterator-stateful source; ``None``: neither."""
    if stateful(source):
        return source
    if iterator_stateful(source) and stateful(iterator):
        return iterator
    return None


def sampler_of(source: Any) -> HostSampler | None:
    """The ``HostSampler`` that orders ``source``'s examples (a DataLoader's ``sampler``, or its
    ``batch_sampler``'s), if any."""
    for s in (
        getattr(source, "sampler", None),
        getattr(getattr(source, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(s, HostSampler):
            return s
    return None


def checkpointable(source: Any) -> bool:
    """Whether a loader over ``source`` can save and restore its position."""
    return stateful(source) or iterator_stateful(source) or sampler_of(source) is not None


def capture(source: Any) -> Any:
    """``source``'s state now, as a deep copy (``None`` for a source resumed by position only)."""
    methods = _methods(source)
    if methods is None:
        return None
    state = getattr(source, methods[0])()
    try:
        return copy.deepcopy(state)
    except Exception as e:
        e.add_note(
            f"(GlobalBatchLoader: copying the state that {type(source).__name__}.{methods[0]}() "
            "returned, so that the snapshot does not change as the source reads on)"
        )
        raise


def restore(source: Any, state: Any) -> None:
    """Loads ``state`` (a ``capture``) into ``source``; ``None``: nothing to load."""
    methods = _methods(source)
    if state is None or methods is None:
        return
    getattr(source, methods[1])(state)


def method_name(source: Any, which: int) -> str:
    """``"StatefulDataLoader.load_state_dict"`` (``which=1``) or its ``state_dict`` (0)."""
    methods = _methods(source)
    return f"{type(source).__name__}.{methods[which] if methods else '?'}"


def _describe(source: Any) -> dict[str, Any]:
    """What a saved state must match in the source it is loaded into."""
    kind = type(source)
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "num_workers": getattr(source, "num_workers", None),
    }


def encode(source: Any, state: Any) -> bytes | None:
    """A source's snapshot as one opaque value of the checkpoint (with the source's type and
    worker count, which a later load checks)."""
    if state is None:
        return None
    return pickle.dumps({**_describe(source), "state": state}, protocol=pickle.HIGHEST_PROTOCOL)


def decode(blob: Any, where: str, source: Any) -> Any:
    """The state in ``blob`` (``encode``'s), checked against ``source``."""
    if blob is None:
        return None
    if not isinstance(blob, (bytes, bytearray)):
        raise TypeError(
            f"{where}: expected a source's state as GlobalBatchLoader.state_dict() saved it "
            f"(bytes, or None), but got {type(blob).__name__} {blob!r:.60}."
        )
    try:
        saved = pickle.loads(blob)  # the user's own checkpoint
    except Exception as e:  # truncated, garbage, or a class that no longer imports
        raise ValueError(
            f"{where}: expected a source's state as GlobalBatchLoader.state_dict() saved it, but "
            f"its {len(blob)} bytes do not unpickle ({type(e).__name__}: {e}); the checkpoint is "
            "truncated or corrupt, or its source's classes no longer import. Load a complete "
            "state that this loader's state_dict() saved."
        ) from e
    mine = _describe(source)
    if not isinstance(saved, dict) or set(saved) != {"type", "num_workers", "state"}:
        raise ValueError(f"{where}: not a source's state saved by GlobalBatchLoader.state_dict().")
    kinds = {f"{k.__module__}.{k.__qualname__}" for k in type(source).__mro__}
    if saved["type"] not in kinds or saved["num_workers"] != mine["num_workers"]:

        def show(d: dict[str, Any]) -> str:
            w = d["num_workers"]
            return d["type"] + ("" if w is None else f" with num_workers={w}")

        raise ValueError(
            f"{where}: saved from a {show(saved)}, but this loader's source is a {show(mine)}; "
            "a source's state means something only to a source of its kind and configuration. "
            "Load the state into a loader over the same kind of source, configured alike."
        )
    if not (stateful(source) or iterator_stateful(source)):
        raise TypeError(
            f"{where}: a saved source state, but this loader's source ({type(source).__name__}) "
            "has no state_dict()/load_state_dict() or get_state()/set_state() to load it into."
        )
    return saved["state"]


# -- the epoch's global position ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Position:
    """Where an epoch stands in its global order: ``consumed`` examples of epoch ``epoch`` of
    the order of ``num_examples`` indices shuffled with ``seed`` (if ``shuffle``), read over
    ``shards`` shards (``None``: not known, a state saved before it was kept)."""

    epoch: int
    consumed: int
    num_examples: int
    seed: int
    shuffle: bool
    shards: int | None = None

    def identity(self) -> dict[str, Any]:
        return {"num_examples": self.num_examples, "seed": self.seed, "shuffle": self.shuffle}


def samplers(sources: Sequence[Any]) -> list[HostSampler] | None:
    """Every source's ``HostSampler``, or ``None`` unless each has one."""
    found = [sampler_of(s) for s in sources]
    kept = [s for s in found if s is not None]
    return kept if len(kept) == len(found) else None


# -- the loader's state ----------------------------------------------------------------------------


def build(
    *,
    process: int,
    per_host: bool,
    sources: Sequence[Any],
    states: Sequence[Any],
    next_batch: int,
    processes: int,
    hosts: int,
    position: Position | None,
    job: dict[str, Any] | None = None,
    parts: list[Any] | None = None,
) -> dict[str, Any]:
    """The loader's state: this process's entry and the common one. ``job``: the elastic
    sources' position, gathered from every process (``elastic.gather``); ``parts``: this
    process's parts of it, kept in its entry where the processes could not exchange them."""
    blobs = [encode(src, s) for src, s in zip(sources, states, strict=True)]
    mine: dict[str, Any] = {"sources": blobs} if per_host else {"source": blobs[0]}
    mine["next_batch"] = next_batch
    # JSON text: one opaque value each (torch.distributed.checkpoint loads the keys of a fresh
    # loader's state, whose elastic entries are None, not the saved dicts' keys).
    if job is None and parts is not None:
        mine["elastic"] = json.dumps(parts, sort_keys=True)
    common = {
        "loader": KIND,
        "processes": processes,
        "hosts": hosts,
        "epoch": None if position is None else position.epoch,
        "consumed": None if position is None else position.consumed,
        "num_examples": None if position is None else position.num_examples,
        "seed": None if position is None else position.seed,
        "shuffle": None if position is None else position.shuffle,
        "elastic": None if job is None else json.dumps(job, sort_keys=True),
        "shards": None if position is None else position.shards,
    }
    return {process_key(process): mine, COMMON: common}


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A parsed state: ``states`` per source (``None`` where a source restarts from the
    position), ``next_batch``, the saved ``position``, and whether it was saved on another
    number of hosts (``resized``: every source restarts from ``position``, or from ``job``, the
    elastic sources' position; also when this process's entry is missing from a state whose
    common entry can resume it, as Lightning saves rank 0's alone)."""

    states: list[Any]
    next_batch: int
    position: Position | None
    resized: bool
    saved_processes: int
    saved_hosts: int
    job: dict[str, Any] | None = None


def _kind_error(state_dict: Any) -> Exception:
    if not isinstance(state_dict, dict):
        return TypeError(
            "state_dict: expected a dict from GlobalBatchLoader.state_dict() (keys 'process_<i>' "
            f"and 'common'), but got {type(state_dict).__name__}."
        )
    keys = sorted(str(k) for k in state_dict)
    hint = ""
    if {"source", "next_batch"} & set(state_dict) or {"sources"} & set(state_dict):
        hint = (
            " It holds one process's entry ('source'/'sources', 'next_batch'): pass the whole "
            "dict that state_dict() returned."
        )
    elif not any(k.startswith("process_") for k in keys):
        hint = (
            " It is not a GlobalBatchLoader's state (a source's own state, or another loader's?): "
            "pass what GlobalBatchLoader.state_dict() returned."
        )
    return ValueError(
        "state_dict: expected a dict from GlobalBatchLoader.state_dict() (keys 'process_<i>' and "
        f"'common', with common['loader'] == {KIND!r}), but got keys {keys}.{hint}"
    )


def _int(value: Any, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where}: expected an int ({what}, >= 0), but got {value!r} of type "
            f"{type(value).__name__}."
        )
    if value < 0:
        raise ValueError(f"{where}: expected {what}, >= 0, but got {value}.")
    return value


def parse(
    state_dict: Any,
    *,
    process: int,
    per_host: bool,
    sources: Sequence[Any],
    processes: int,
    hosts: int,
    resizable: bool,
    fix: str,
    shards: int | None = None,
) -> Loaded:
    """Checks ``state_dict`` and returns what to load; raises ``TypeError``/``ValueError``
    naming the key, what was expected and what was found. ``fix``: what would make a state of
    another number of hosts loadable, for the error of one that is not. ``shards``: the
    samplers' shard count now (``None``: no samplers); a state saved over another count
    resumes from its position alone, like one saved on another number of hosts."""
    num_sources = len(sources)
    common = state_dict.get(COMMON) if isinstance(state_dict, dict) else None
    if not isinstance(common, dict) or common.get("loader") != KIND:
        raise _kind_error(state_dict)
    if not set(COMMON_KEYS) - set(ADDED_COMMON_KEYS) <= set(common) <= set(COMMON_KEYS):
        raise ValueError(
            f"state_dict['common']: expected the keys {list(COMMON_KEYS)}, but got "
            f"{sorted(common)}."
        )
    saved_processes = _int(common["processes"], "state_dict['common']['processes']", "a count")
    saved_hosts = _int(common["hosts"], "state_dict['common']['hosts']", "a count")
    position = None
    if common["consumed"] is not None:
        position = Position(
            epoch=_int(common["epoch"], "state_dict['common']['epoch']", "an epoch"),
            consumed=_int(common["consumed"], "state_dict['common']['consumed']", "a count"),
            num_examples=_int(
                common["num_examples"], "state_dict['common']['num_examples']", "a count"
            ),
            seed=int(common["seed"]),
            shuffle=bool(common["shuffle"]),
            shards=(
                None
                if common.get("shards") is None
                else _int(common["shards"], "state_dict['common']['shards']", "a count")
            ),
        )
        if position.consumed > position.num_examples:
            raise ValueError(
                f"state_dict['common']['consumed']: expected at most the epoch's "
                f"{position.num_examples} examples (num_examples) consumed, but got "
                f"{position.consumed}; the position lies beyond the dataset, so the state is "
                "corrupt or was edited. Load the state that GlobalBatchLoader.state_dict() saved."
            )
    relaid = (
        position is not None
        and position.shards is not None
        and shards is not None
        and position.shards != shards
    )
    resized = saved_hosts != hosts or saved_processes != processes or relaid
    key = process_key(process)
    entry = state_dict.get(key)
    job = _json(common.get("elastic"), "state_dict['common']['elastic']")
    if job is not None:
        job = elastic_check(job, sources, "state_dict['common']['elastic']")
    elif resized or not isinstance(entry, dict):
        job = _job_from_entries(state_dict, sources, saved_processes)
    can_job = job is not None and all(is_elastic(s) for s in sources)
    can_position = position is not None and resizable
    missing = not isinstance(entry, dict)
    if resized or (missing and (can_job or can_position)):
        if not (can_job or can_position):
            what = (
                "its sources' state is per process and has no global position"
                if position is None
                else "this loader's sources do not read through torchshard.host_sampler"
            )
            raise ValueError(
                f"state_dict: saved by {saved_processes} process(es) feeding {saved_hosts} data "
                f"host(s), but this loader runs on {processes} process(es) feeding {hosts}; "
                f"{what}, so it cannot be split over another number of hosts. {fix}"
            )
        # Batches are numbered from 0 again after a resize (the saved numbers counted batches
        # of another size); a missing entry on the same layout takes the number of the entries
        # present (every process takes the same batches).
        numbers = {
            v.get("next_batch")
            for k, v in state_dict.items()
            if str(k).startswith("process_") and isinstance(v, dict)
        }
        next_batch = 0
        if not resized and len(numbers) == 1:
            (only,) = numbers
            next_batch = only if isinstance(only, int) and not isinstance(only, bool) else 0
        return Loaded(
            [None] * num_sources,
            max(next_batch, 0),
            None if can_job else position,
            True,
            saved_processes,
            saved_hosts,
            job if can_job else None,
        )
    if not isinstance(entry, dict):
        present = sorted(k for k in state_dict if str(k).startswith("process_"))
        raise ValueError(  # noqa: TRY004 - a missing key, not a wrong type
            f"state_dict: expected this process's entry {key!r}, but the state holds {present}; "
            "pass the state this process saved (or the union of every process's)."
        )
    name = "sources" if per_host else "source"
    other = "source" if per_host else "sources"
    expected = {name, "next_batch"}
    if set(entry) - {"elastic"} != expected:
        hint = ""
        if set(entry) == {other, "next_batch"}:
            kind = "one source per host" if other == "sources" else "one source"
            hint = f" It is the state of a loader with {kind}; this loader has {num_sources}."
        raise ValueError(
            f"state_dict[{key!r}]: expected the keys {sorted(expected)}, but got "
            f"{sorted(entry)}.{hint}"
        )
    next_batch = _next_batch(entry, key)
    value = entry[name]
    if per_host and not isinstance(value, (list, tuple)):
        raise TypeError(
            f"state_dict[{key!r}]['sources']: expected a list with one state per source "
            f"({num_sources}), but got {type(value).__name__}."
        )
    blobs = list(value) if per_host else [value]
    if len(blobs) != num_sources:
        raise ValueError(
            f"state_dict[{key!r}]['sources']: expected one state per source ({num_sources}), "
            f"but got {len(blobs)}."
        )
    states = [
        decode(b, f"state_dict[{key!r}][{name!r}]" + (f"[{h}]" if per_host else ""), src)
        for h, (b, src) in enumerate(zip(blobs, sources, strict=True))
    ]
    return Loaded(states, next_batch, position, False, saved_processes, saved_hosts)


def _json(value: Any, where: str) -> Any:
    """A JSON entry of the state, decoded (``None`` stays ``None``)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{where}: expected JSON text (as GlobalBatchLoader.state_dict() saves it) or None, "
            f"but got {type(value).__name__} {value!r:.60}."
        )
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(
            f"{where}: expected JSON text as GlobalBatchLoader.state_dict() saves it, but it does "
            f"not parse ({e}); the checkpoint is truncated or was edited."
        ) from None


def _job_from_entries(
    state_dict: dict[str, Any], sources: Sequence[Any], saved_processes: int
) -> dict[str, Any] | None:
    """The elastic sources' position merged from the parts in every process's entry (kept there
    where the processes could not exchange them when saving), or ``None`` when there are none,
    or not every saving process's."""
    entries = [
        _json(v.get("elastic"), f"state_dict[{k!r}]['elastic']")
        for k, v in state_dict.items()
        if str(k).startswith("process_") and isinstance(v, dict)
    ]
    found = [e for e in entries if isinstance(e, list)]
    if not sources or not all(is_elastic(s) for s in sources) or len(found) != len(entries):
        return None
    if len(found) != saved_processes:
        return None
    parts = sorted({json.dumps(p, sort_keys=True) for e in found for p in e})
    merged = type(sources[0]).merge_elastic_parts([json.loads(p) for p in parts])
    return {"kind": elastic_kind(sources[0]), "position": merged}


def _next_batch(entry: dict[str, Any], key: str) -> int:
    value = entry.get("next_batch")
    where = f"state_dict[{key!r}]['next_batch']"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where}: expected an int (the index of the next batch of the epoch, >= 0), but got "
            f"{value!r} of type {type(value).__name__}."
        )
    if value < 0:
        raise ValueError(
            f"{where}: expected the index of the next batch of the epoch, >= 0, but got {value}."
        )
    return value
