"""A stream made of shards, resumed on any number of processes: ``sharded_stream``.

Most streams are a list of shards: files, an HF stream's data shards, a webdataset's tars.
``stream_shard`` splits such a stream over the processes' feeds, but a position in it is per
process (what *its* shards have read), so a job saved on ``N`` processes could not resume on
``M``. ``ShardedStream`` reads its feed's shards one after the other in batches, and records
each shard's position (examples consumed, and whether it is finished): its state, and an
elastic part of the job's position (``data/_loader/elastic.py``), which ``GlobalBatchLoader``
gathers from every process into its common entry. On ``M`` processes the unfinished shards are
split again over the new feeds, each resuming where it stopped: every example once. A stream
with fewer shards than feeds cannot be split so (a feed would read nothing): refused with the
fix.

Feed ``i`` of ``k`` (``feed_read_config``: processes that hold one block read one feed) reads
``shards[i::k]`` in order; resumed, the unfinished shards (in the order of ``shards``) are
dealt the same way. Batches cross shard boundaries; a pass's last batch may be short
(``GlobalBatchLoader(..., last_batch="pad" | "drop")``; the feeds end unevenly too).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch.utils.data

from torchshard._core.checks import positive_int
from torchshard._core.errors import ShardingError
from torchshard._core.feed import feed_read_config, resolve_mesh, resolve_spec
from torchshard._core.spec import PartitionSpec
from torchshard._mesh.mesh import Mesh

STATE_KEYS = ("feed", "feeds", "positions", "shards")


def _key(shard: Any) -> str:
    """A shard's name as the state keeps it (JSON object keys are text)."""
    return json.dumps(shard)


class ShardedStream:
    """This process's part of a stream of shards, in batches (made by ``sharded_stream``):
    iterable (each ``iter()`` a pass over its feed's shards, or the rest of a resumed one),
    with ``state_dict``/``load_state_dict`` (every shard of its feed: examples consumed, and
    finished) and the elastic members a ``GlobalBatchLoader`` resumes from on another number
    of processes. ``batch_size``, ``feed``, ``num_feeds`` and ``shards`` (this feed's, in
    reading order) are attributes."""

    def __init__(
        self,
        shards: Sequence[Any],
        read: Callable[[Any, int], Iterable[Any]],
        *,
        batch_size: int,
        feed: int,
        feeds: int,
        collate: Callable[[list[Any]], Any],
    ) -> None:
        self.all_shards = list(shards)
        self.read = read
        self.batch_size = batch_size
        self.feed = feed
        self.num_feeds = feeds
        self.collate = collate
        self._fresh()
        self._resumed = False  # the next iter() continues a loaded pass (even an empty one)

    def _fresh(self) -> None:
        """A new pass: this feed's shards ``shards[feed::feeds]``, none read, none inherited."""
        self.shards = self.all_shards[self.feed :: self.num_feeds]
        self._positions = {_key(s): [0, False] for s in self.shards}
        self._inherited: dict[str, list[Any]] = {}  # other feeds' finished shards (resumed)

    # -- reading -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if not self._resumed:
            self._fresh()  # a new pass from every shard's start, as a DataLoader's iter()
        self._resumed = False
        return self._batches()

    def _examples(self) -> Iterator[tuple[str, Any]]:
        for shard in self.shards:
            key = _key(shard)
            start, done = self._positions[key]
            if done:
                continue
            for example in self.read(shard, start):
                yield key, example
            yield key, _SHARD_END

    def _batches(self) -> Iterator[Any]:
        rows: list[Any] = []
        for key, example in self._examples():
            if example is _SHARD_END:
                self._positions[key][1] = True
                continue
            rows.append(example)
            self._positions[key][0] += 1
            if len(rows) == self.batch_size:
                yield self.collate(rows)
                rows = []
        if rows:
            yield self.collate(rows)

    # -- per-process state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This feed's shards (in reading order), each one's position ``[examples consumed,
        finished]`` (and the other feeds' shards it knows finished, after a resume on another
        layout), with the feed and feed count it means something in."""
        return {
            "feed": self.feed,
            "feeds": self.num_feeds,
            "shards": [_key(s) for s in self.shards],
            "positions": {k: list(v) for k, v in {**self._inherited, **self._positions}.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The next ``iter()`` continues the saved pass, each shard where it stopped.

        Raises:
            ValueError: not a ``ShardedStream`` state, or one saved by another feed or feed
                count (another layout resumes through ``GlobalBatchLoader.load_state_dict``,
                from the job's position), or naming shards this stream does not have.
        """
        where = "ShardedStream.load_state_dict: state_dict"
        if not isinstance(state_dict, dict) or set(state_dict) != set(STATE_KEYS):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"{where}: expected a dict with keys {list(STATE_KEYS)} (from "
                f"ShardedStream.state_dict()), but got {got}."
            )
        if (state_dict["feed"], state_dict["feeds"]) != (self.feed, self.num_feeds):
            raise ValueError(
                f"{where}: saved by feed {state_dict['feed']} of {state_dict['feeds']}, but this "
                f"stream is feed {self.feed} of {self.num_feeds}; resuming on another layout "
                "goes through GlobalBatchLoader.load_state_dict (the job's position: the "
                "unfinished shards split again)."
            )
        positions = self._checked(state_dict["positions"], f"{where}['positions']")
        by_key = {_key(s): s for s in self.all_shards}
        order = state_dict["shards"]
        if not isinstance(order, list) or any(k not in positions for k in order):
            raise ValueError(f"{where}['shards']: expected this feed's shards, named in positions.")
        self.shards = [by_key[k] for k in order]
        self._positions = {k: positions[k] for k in order}
        self._inherited = {k: v for k, v in positions.items() if k not in self._positions}
        self._resumed = True

    def _checked(self, positions: Any, where: str) -> dict[str, list[Any]]:
        known = {_key(s) for s in self.all_shards}
        if not isinstance(positions, dict):
            raise ValueError(  # noqa: TRY004 - a corrupt state, as every other check here
                f"{where}: expected a dict of shard -> [consumed, finished]."
            )
        out = {}
        for k, v in positions.items():
            if k not in known:
                raise ValueError(
                    f"{where}: names shard {k}, which this stream does not have (its shards: "
                    f"{sorted(known)[:8]}...); it was saved over another list of shards."
                )
            ok = (
                isinstance(v, (list, tuple))
                and len(v) == 2
                and isinstance(v[0], int)
                and not isinstance(v[0], bool)
                and v[0] >= 0
                and isinstance(v[1], bool)
            )
            if not ok:
                raise ValueError(f"{where}[{k!r}]: expected [consumed >= 0, finished], got {v!r}.")
            out[k] = [v[0], v[1]]
        return out

    # -- the job's position (elastic) ----------------------------------------------------------
    def elastic_part(self, state: dict[str, Any]) -> dict[str, Any]:
        """This process's shards' positions (and the finished ones it knows of)."""
        return {"shards": len(self.all_shards), "positions": state["positions"]}

    @staticmethod
    def merge_elastic_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Every shard's position: the union of the feeds' parts (the processes of one feed
        pass equal ones); a shard two processes place differently is refused."""
        merged: dict[str, list[Any]] = {}
        counts = {p["shards"] for p in parts}
        if len(counts) != 1:
            raise ValueError(
                f"ShardedStream: the processes' streams have {sorted(counts)} shards; every "
                "process must read the same list of shards."
            )
        for part in parts:
            for key, position in part["positions"].items():
                seen = merged.get(key)
                if seen is not None and seen != position:
                    raise ValueError(
                        f"ShardedStream: shard {key} is at {seen} on one process and at "
                        f"{position} on another; two feeds read it, or the states were saved "
                        "after different batches. Save every process's state after the same "
                        "batch."
                    )
                merged[key] = list(position)
        return {"shards": counts.pop(), "positions": merged}

    def load_elastic_state(self, position: dict[str, Any]) -> None:
        """The next ``iter()`` reads this feed's deal of the unfinished shards (in the order of
        the stream's shards), each from where it stopped; the finished ones are kept as such.

        Raises:
            ValueError: a position over another number of shards, or one that leaves out shards
                of the stream (not every process's part was gathered).
        """
        where = "ShardedStream.load_elastic_state"
        if position.get("shards") != len(self.all_shards):
            raise ValueError(
                f"{where}: the position is over {position.get('shards')} shards, this stream has "
                f"{len(self.all_shards)}; resume over the same list of shards."
            )
        positions = self._checked(position.get("positions"), f"{where}: position")
        missing = [_key(s) for s in self.all_shards if _key(s) not in positions]
        if missing:
            raise ValueError(
                f"{where}: the position leaves out shards {missing[:8]}: it was not gathered from "
                "every process (save the loader's state on every process)."
            )
        unfinished = [s for s in self.all_shards if not positions[_key(s)][1]]
        self.shards = unfinished[self.feed :: self.num_feeds]
        mine = {_key(s) for s in self.shards}
        self._positions = {k: v for k, v in positions.items() if k in mine}
        self._inherited = {k: v for k, v in positions.items() if k not in mine and v[1]}
        # unfinished shards dealt to other feeds are theirs now: not this feed's to report
        self._resumed = True


_SHARD_END = object()


def sharded_stream(
    shards: Sequence[Any],
    read: Callable[[Any, int], Iterable[Any]],
    /,
    partition: Any = None,
    *,
    batch_size: int,
    mesh: Mesh | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
) -> ShardedStream:
    """This process's source over a stream of shards, resumable on any number of processes.

    Args:
        shards: the stream's shards, the same list on every process (file names, tar URLs, an
            HF stream's shard indices: JSON-able values, which the state names).
        read: ``read(shard, start)`` -> the shard's examples from example ``start`` on (skipping
            the ones a resumed job consumed). HF datasets: ``lambda i, start:
            stream.shard(num_shards=stream.num_shards, index=i).skip(start)``.
        partition: the batch's ``PartitionSpec`` (only dim 0 matters; default: dim 0 over every
            mesh axis, the loader's default): processes whose devices hold the same block read
            the same feed.
        batch_size: examples per batch of this feed.
        mesh: a ``torchshard.Mesh`` (default: the current mesh).
        collate: a batch from a list of examples (default: ``torch.utils.data.default_collate``).

    Raises:
        ShardingError: fewer shards than feeds (a feed would read nothing; the fix: more
            shards). ValueError: ``batch_size`` not a positive int. TypeError: a shard that is
            not JSON-able. NoMeshError and others: as ``feed_read_config``.

    Example (one process, 4 shards of 3 examples):
        >>> shards = [[10 * s + j for j in range(3)] for s in range(4)]
        >>> with torchshard.Mesh(np.arange(8), ("data",)):
        ...     stream = torchshard.data.sharded_stream(
        ...         range(4), lambda s, start: shards[s][start:], batch_size=5
        ...     )
        >>> [b.tolist() for b in stream]
        [[0, 1, 2, 10, 11], [12, 20, 21, 22, 30], [31, 32]]
    """
    batch_size = positive_int(batch_size, "batch_size")
    m = resolve_mesh(mesh, "sharded_stream")
    spec = (
        PartitionSpec(tuple(m.axis_names))
        if partition is None
        else resolve_spec(partition, m, "sharded_stream")
    )
    feed = feed_read_config(spec, mesh=m)
    index, count = feed["shard_index"], feed["num_shards"]
    shards = list(shards)
    if len(shards) < count:
        raise ShardingError(
            f"sharded_stream: {len(shards)} shard(s) over {count} feeds of {spec!r}: feed "
            f"{len(shards)} and later would read nothing, and a stream resumes on another "
            "number of processes only by its shards. Split the stream into at least as many "
            "shards as feeds (more files or tars; HF datasets: load more data files, or "
            "stream.reshard()), or read map-style data through torchshard.host_sampler."
        )
    for s in shards:
        try:
            json.dumps(s)
        except TypeError:
            raise TypeError(
                f"sharded_stream: shards must be JSON-able names (str, int), but got "
                f"{type(s).__name__} {s!r:.60}; pass names and open them in read()."
            ) from None
    return ShardedStream(
        shards,
        read,
        batch_size=batch_size,
        feed=index,
        feeds=count,
        collate=collate or torch.utils.data.default_collate,
    )
