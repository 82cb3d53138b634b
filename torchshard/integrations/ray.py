"""torchshard over Ray Data: ``feed_split(dataset, partition=None, *, mesh=None, batch_size)``.

Ray Data preprocesses on CPU nodes and hands each trainer worker a split of the stream
(``Dataset.streaming_split(n, equal=True)``). A split has exactly one consumer, its iterator
cannot be restored (ray#37633), and its end is ragged; the processes that hold one block of the
batch (the tp or cp peers of a dp row) cannot share a split. ``feed_split`` makes this
process's source for ``GlobalBatchLoader`` from a Ray ``Dataset``:

- **one split per feed, not per rank**: ``feed_read_config(partition, mesh=mesh)`` numbers the
  feeds; the dataset is split once (``streaming_split(num_feeds, equal=...)``) inside a *hub*, a
  Ray actor that every process of the job shares (named from the job, made by whichever process
  comes first); the hub is each split's one consumer;
- **peers fed alike**: the hub keeps batch ``k`` of a feed until every process of that feed
  took it, so the peers that hold one block get the same rows;
- **a position**: the source's ``state_dict()`` is the batches of its feed consumed in the
  current pass (``GlobalBatchLoader`` snapshots it after each batch it hands over); after a
  restart the new hub runs the dataset again and each feed skips what it consumed. Ray executes
  a dataset whose ``DataContext`` has ``execution_options.preserve_order`` deterministically,
  block order and split assignment included (its output splitter then ignores locality hints),
  so the hub sets it: the skipped batches are the ones consumed before;
- **the ragged end**: ``GlobalBatchLoader(..., last_batch="pad" | "drop")`` ends every process
  together (with ``equal=False`` the splits differ in length; with ``equal=True`` Ray drops up to
  ``num_feeds - 1`` rows so that they do not).

Every wait for the hub is bounded (``timeout``). Ray is imported on first use; every process
must have joined the cluster first (``ray.init(address=...)``).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

from torchshard._core.feed import feed_processes, feed_read_config, resolve_mesh, resolve_spec
from torchshard._core.mesh import Mesh as MeshValue
from torchshard._core.optional import require
from torchshard._core.spec import PartitionSpec
from torchshard._mesh.mesh import Mesh

# Source states: what a saved position means something in.
STATE_KEYS = ("batch_size", "batches", "feed", "feeds", "pass")
_END = "__torchshard_ray_end__"
_calls = itertools.count()  # feed_split calls of this process: the n-th names the n-th hub


class _Hub:
    """The actor behind ``feed_split`` (one per dataset and job): splits the dataset once
    (``streaming_split``) and serves batch ``k`` of feed ``f`` of pass ``p`` to each of the
    feed's ``peers`` processes, keeping it until all took it. Runs in its own process; every
    method is a Ray actor method, called concurrently (one thread per waiting process)."""

    def __init__(
        self, dataset: Any, feeds: int, peers: list[int], batch_size: int, equal: bool
    ) -> None:
        dataset.context.execution_options.preserve_order = True
        self._splits = dataset.streaming_split(feeds, equal=equal)
        self._peers = peers  # per feed, the processes that read it
        self._batch_size = batch_size
        self._lock = threading.Lock()
        self._feed_locks = [threading.Lock() for _ in range(feeds)]
        self._iters: dict[tuple[int, int], Iterator[Any]] = {}  # (feed, pass) -> batches
        self._made: dict[tuple[int, int], int] = {}  # (feed, pass) -> batches made
        self._kept: dict[tuple[int, int, int], list[Any]] = {}  # (f, p, k) -> [batch, left]

    def describe(self) -> dict[str, Any]:
        return {"feeds": len(self._splits), "peers": list(self._peers), "batch": self._batch_size}

    def get(self, feed: int, pass_: int, k: int) -> Any:
        """Batch ``k`` of ``feed``'s pass ``pass_`` (``_END`` past its end)."""
        key = (feed, pass_, k)
        with self._feed_locks[feed]:  # one split iterator advances on one thread at a time
            with self._lock:
                kept = self._kept.get(key)
            if kept is None:
                batch = self._advance(feed, pass_, k)
                with self._lock:
                    kept = self._kept.setdefault(key, [batch, self._peers[feed]])
            with self._lock:
                kept[1] -= 1
                if kept[1] <= 0:
                    del self._kept[key]
                return kept[0]

    def _advance(self, feed: int, pass_: int, k: int) -> Any:
        it = self._iters.get((feed, pass_))
        if it is None:  # a new pass of this feed: the passes before it are over
            for done in [key for key in self._iters if key[0] == feed]:
                del self._iters[done]
            with self._lock:
                for kept in [key for key in self._kept if key[0] == feed and key[1] != pass_]:
                    del self._kept[kept]
            it = self._splits[feed].iter_batches(
                batch_size=self._batch_size, batch_format="numpy", drop_last=False
            )
            it = iter(it)
            self._iters[(feed, pass_)] = it
            self._made[(feed, pass_)] = 0
        batch: Any = _END
        while self._made[(feed, pass_)] <= k:  # a resumed pass skips what was consumed
            batch = next(it, _END)
            self._made[(feed, pass_)] += 1
            if batch is _END:
                self._made[(feed, pass_)] = k + 1
                break
        return batch


def _ray() -> Any:
    return require("ray", "torchshard.integrations.ray", extra="ray", package="ray[data]")


@functools.cache
def _hub_class() -> Any:
    return _ray().remote(num_cpus=0)(_Hub)


class FeedSplit:
    """This process's source: the batches of its feed's split of a Ray ``Dataset`` (made by
    ``feed_split``). Iterable (each ``iter()`` is one pass over the dataset, all processes
    together), with ``state_dict``/``load_state_dict`` (the batches of the current pass
    consumed), ``batch_size``, ``feed`` and ``num_feeds``."""

    def __init__(
        self,
        hub: Any,
        *,
        feed: int,
        feeds: int,
        batch_size: int,
        timeout: float,
        name: str,
    ) -> None:
        self._hub = hub
        self.feed = feed
        self.num_feeds = feeds
        self.batch_size = batch_size
        self.name = name
        self._timeout = timeout
        self._pass = -1  # passes started (the next iter() starts pass + 1)
        self._batches = 0  # batches of the current pass this source yielded
        self._resume: tuple[int, int] | None = None  # (pass, batches) set by load_state_dict

    def __iter__(self) -> Iterator[Any]:
        if self._resume is not None:
            self._pass, start = self._resume
            self._resume = None
        else:
            self._pass, start = self._pass + 1, 0
        self._batches = start
        return self._read(self._pass, start)

    def _read(self, pass_: int, start: int) -> Iterator[Any]:
        ray = _ray()
        for k in itertools.count(start):
            ref = self._hub.get.remote(self.feed, pass_, k)
            try:
                batch = ray.get(ref, timeout=self._timeout)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"feed_split({self.name!r}): batch {k} of feed {self.feed} of "
                    f"{self.num_feeds} did not come within {self._timeout} s: the hub waits for "
                    "Ray Data to make it (busy or lost data nodes), or for the other feeds' "
                    "processes to start the pass (every process iterates the loader together). "
                    "Pass feed_split(..., timeout=...) for a longer wait."
                ) from None
            if isinstance(batch, str) and batch == _END:
                return
            self._batches = k + 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{"feeds", "feed", "batch_size", "pass", "batches"}``: the batches of this feed's
        current pass yielded (``GlobalBatchLoader`` snapshots it after the batch its consumer
        took)."""
        return {
            "feeds": self.num_feeds,
            "feed": self.feed,
            "batch_size": self.batch_size,
            "pass": max(self._pass, 0),
            "batches": self._batches,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The next ``iter()`` resumes the saved pass after its ``batches`` batches (the hub
        skips them: Ray runs the dataset again, in the same order).

        Raises:
            ValueError: not a ``FeedSplit`` state, or one saved over another number of feeds,
                feed or batch size (a split's batches mean something only in the same split).
        """
        where = "FeedSplit.load_state_dict: state_dict"
        if not isinstance(state_dict, dict) or set(state_dict) != set(STATE_KEYS):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"{where}: expected a dict with keys {list(STATE_KEYS)} (from "
                f"FeedSplit.state_dict()), but got {got}."
            )
        mine = {"feeds": self.num_feeds, "feed": self.feed, "batch_size": self.batch_size}
        saved = {k: state_dict[k] for k in mine}
        if saved != mine:
            raise ValueError(
                f"{where}: saved by feed {saved['feed']} of {saved['feeds']} with batch_size="
                f"{saved['batch_size']}, but this source is feed {self.feed} of {self.num_feeds} "
                f"with batch_size={self.batch_size}; a split's position means something only in "
                "the same split (Ray splits the stream dynamically, so another feed count splits "
                "it otherwise). Resume on the same layout of feeds and the same batch_size."
            )
        for key in ("pass", "batches"):
            value = state_dict[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}[{key!r}]: expected an int >= 0, but got {value!r}.")
        self._resume = (state_dict["pass"], state_dict["batches"])
        self._pass, self._batches = state_dict["pass"], state_dict["batches"]


def _job_name() -> str:
    """What tells this job's hubs from another job's on a shared cluster: torchrun's run id,
    else the rendezvous address (the same in every process of a job)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return run
    return f"{os.environ.get('MASTER_ADDR', 'local')}:{os.environ.get('MASTER_PORT', '0')}"


def feed_split(
    dataset: Any,
    partition: Any = None,
    /,
    *,
    mesh: Mesh | None = None,
    batch_size: int,
    equal: bool = True,
    timeout: float = 600.0,
    name: str | None = None,
) -> FeedSplit:
    """This process's source for ``GlobalBatchLoader``: the batches of its feed's split of the
    Ray ``dataset`` (``streaming_split(num_feeds, equal=equal)``, made once for the job).

    Every process of the job calls it, in the same order as its other ``feed_split`` calls,
    after ``ray.init(address=...)``.

    Args:
        dataset: a ``ray.data.Dataset`` (each row a dict of columns; batches come as dicts of
            numpy arrays, ``batch_format="numpy"``).
        partition: the batch's ``PartitionSpec`` (only dim 0 matters; default: dim 0 over every
            mesh axis, the loader's default). Processes whose devices hold the same block read
            the same feed.
        mesh: a ``torchshard.Mesh`` (default: the current mesh).
        batch_size: rows per batch of this feed (the global batch is ``batch_size *
            num_feeds``).
        equal: ``streaming_split``'s ``equal``: every split the same number of rows (up to
            ``num_feeds - 1`` rows dropped); ``False``: every row once, the splits ragged (feed
            them with ``GlobalBatchLoader(..., last_batch="pad")``).
        timeout: seconds to wait for one batch, or for the hub, at most.
        name: the hub's name (default: from the job, torchrun's run id, and the call's number).

    Returns:
        A ``FeedSplit``: iterable, with ``state_dict``/``load_state_dict``.

    Raises:
        MissingDependencyError: Ray is not installed. RuntimeError: this process has not joined
        a Ray cluster. TypeError: ``batch_size`` not a positive int, ``dataset`` not a Ray
        ``Dataset``. NoMeshError, ShardingError: as ``feed_read_config``.

    Example::

        ray.init(address="127.0.0.1:6379")
        with mesh:  # (dp=2, tp=2): the two tp peers of a dp row read one split
            source = feed_split(ray.data.read_parquet(path).map_batches(tokenize),
                                P("dp"), batch_size=8)
        for batch, mask in GlobalBatchLoader(source, partition=P("dp"), mesh=mesh,
                                             last_batch="pad", local=True):
            ...
    """
    ray = _ray()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise TypeError(f"feed_split: batch_size must be an int >= 1, but got {batch_size!r}.")
    if not isinstance(dataset, ray.data.Dataset):
        raise TypeError(
            f"feed_split: dataset must be a ray.data.Dataset, but got {type(dataset).__name__}."
        )
    if not ray.is_initialized():
        raise RuntimeError(
            "feed_split: this process has not joined a Ray cluster; call "
            "ray.init(address=<the head's address>) first in every process (a local cluster: "
            "`ray start --head` on the data node)."
        )
    m = resolve_mesh(mesh, "feed_split")
    spec = (
        PartitionSpec(tuple(m.axis_names))
        if partition is None
        else resolve_spec(partition, m, "feed_split")
    )
    config = feed_read_config(spec, mesh=m)
    feeds, feed = config["num_shards"], config["shard_index"]
    peers = _peers_per_feed(spec, m, feeds)
    number = next(_calls)
    if name is None:
        name = f"torchshard-feed-split-{_job_name()}-{number}"
    hub = (
        _hub_class()
        .options(name=name, namespace="torchshard", get_if_exists=True, max_concurrency=64)
        .remote(dataset, feeds, peers, batch_size, equal)
    )
    try:
        seen = ray.get(hub.describe.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"feed_split({name!r}): the hub did not start within {timeout} s (Ray could not "
            "place it, or the cluster is busy)."
        ) from None
    mine = {"feeds": feeds, "peers": peers, "batch": batch_size}
    if seen != mine:
        raise ValueError(
            f"feed_split({name!r}): the job's hub was made by another process with {seen}, but "
            f"this process asks for {mine}: every process must call feed_split with the same "
            "partition, mesh and batch_size, in the same order."
        )
    return FeedSplit(hub, feed=feed, feeds=feeds, batch_size=batch_size, timeout=timeout, name=name)


def _peers_per_feed(spec: PartitionSpec, mesh: MeshValue, feeds: int) -> list[int]:
    """How many processes read each feed (the hub keeps a batch until all took it)."""
    mine = feed_processes(spec, mesh=mesh, caller="feed_split")
    # A uniform layout: every feed is read by as many processes as this one.
    return [len(mine)] * feeds
