"""torchshard in torchtitan: ``dataloader(source, *, parallel_dims=None, mesh=None, ...)``.

torchtitan's ``train_step`` takes per-rank tensors (``(input_dict, labels)``) and its
checkpointer (torch.distributed.checkpoint) keeps one value per state key, which is why
torchtitan's own loader keys its state by dp rank. The loader made here is a torchtitan
``BaseDataLoader``: it wraps the stock loader (or any per-rank source of host batches) in a
``GlobalBatchLoader`` on torchtitan's data-loading mesh (``("pp", "batch", "cp", "tp")`` from
``ParallelDims``, ranks in torchtitan's order), yields local tensors (``local=True``: the
checks and the agreement between processes run on the global batch), and keys its state by dp
rank (``{"dp_rank_<r>": ..., "world_size": dp}``, where ``r`` is this process's shard of the
batch: the processes that share a block share its state). torch.distributed.checkpoint keeps one
value per key, the state of one of the processes of each dp rank (its tp and cp peers read the
same examples): each peer resumes from it.

**Two torchtitan loaders.** torchtitan 0.3.0 feeds through ``ParallelAwareDataloader`` (a
``StatefulDataLoader`` per dp rank, state ``{"dp_rank_<r>": pickled, "world_size": dp}``):
``dataloader`` wraps it. torchtitan's main branch (pytorch/torchtitan#4088) replaced it with a
grain pipeline (``GrainDataLoader``, state ``{"version": 1, "dp_world_size": dp,
"dp_rank_<r>": ...}``) that refuses ``repeat=False`` with more than one dp rank ("ranks can
exhaust at different steps and hang collectives") and resumes only on the same dp degree:
``grain_dataloader`` is its loader protocol (``__iter__``, ``state_dict``/``load_state_dict`` in
that layout, ``close``) with torchshard as the distributed layer: grain's ``ElasticIterator``
over this process's feed, a ``GlobalBatchLoader`` whose ``last_batch`` ends every rank at the
same step, and the job's position (a global index) in every entry, so a checkpoint resumes on
another dp degree. Neither needs the other; only ``dataloader`` imports torchtitan (0.3.0's
``BaseDataLoader``), ``grain_dataloader`` imports grain alone.

torchtitan and grain are imported on first use.
"""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np

from torchshard._core.feed import feed_read_config
from torchshard._core.optional import require
from torchshard._core.spec import PartitionSpec
from torchshard._mesh.mesh import Mesh
from torchshard.data._loader.loader import GlobalBatchLoader

DATALOADING_AXES = ("pp", "batch", "cp", "tp")
GRAIN_STATE_VERSION = 1  # torchtitan main's GrainDataLoader state version

logger = logging.getLogger(__name__)


def dataloading_mesh(parallel_dims: Any) -> Mesh:
    """torchtitan's data-loading mesh as a ``torchshard.Mesh`` (dtensor backend): axes
    ``("pp", "batch", "cp", "tp")`` of sizes ``pp``, ``dp_replicate * dp_shard``, ``cp``,
    ``tp``, over the ranks in torchtitan's row-major order."""
    try:
        pp, cp, tp = int(parallel_dims.pp), int(parallel_dims.cp), int(parallel_dims.tp)
        batch = int(parallel_dims.dp_replicate) * int(parallel_dims.dp_shard)
        world = int(parallel_dims.world_size)
    except AttributeError as e:
        raise TypeError(
            "parallel_dims: expected torchtitan's ParallelDims (with pp, dp_replicate, "
            f"dp_shard, cp, tp, world_size), but got {type(parallel_dims).__name__} ({e})."
        ) from None
    if pp * batch * cp * tp != world:
        raise ValueError(
            f"parallel_dims: pp * dp_replicate * dp_shard * cp * tp = {pp * batch * cp * tp} "
            f"is not world_size {world}; call parallel_dims.build_mesh() (or torchtitan's "
            "trainer) first, which resolves dp_shard=-1."
        )
    grid = np.arange(world).reshape(pp, batch, cp, tp)
    return Mesh(grid, DATALOADING_AXES, backend="dtensor")


@functools.cache
def _loader_class() -> type:
    components = require(
        "torchtitan.components.dataloader", "torchshard.integrations.torchtitan", extra="stacks"
    )

    base: Any = components.BaseDataLoader

    class TorchshardDataLoader(base):
        """A torchtitan ``BaseDataLoader`` over a ``GlobalBatchLoader`` (``local=True``)."""

        def __init__(
            self, loader: GlobalBatchLoader, dp_rank: int, dp_world_size: int, source: Any = None
        ) -> None:
            self.loader = loader
            self.dp_rank = dp_rank
            self.dp_world_size = dp_world_size
            self._rank_id = f"dp_rank_{dp_rank}"
            self._source = source

        @property
        def batch_size(self) -> Any:
            """The source's ``batch_size`` (torchtitan's stock loader: its local batch size),
            ``None`` where the source has none."""
            return getattr(self._source, "batch_size", None)

        @property
        def num_workers(self) -> Any:
            """The source's ``num_workers`` (``None`` where the source has none)."""
            return getattr(self._source, "num_workers", None)

        def __iter__(self) -> Iterator[Any]:
            return iter(self.loader)

        def __len__(self) -> int:
            return len(self.loader)

        def set_epoch(self, epoch: int) -> None:
            self.loader.set_epoch(epoch)

        def state_dict(self) -> dict[str, Any]:
            # torchtitan's own layout: one key per dp rank (DCP keeps every rank's), pickled.
            return {
                self._rank_id: pickle.dumps(self.loader.state_dict()),
                "world_size": self.dp_world_size,
            }

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            """Loads this dp rank's entry. As torchtitan's own loader: an empty state is none
            (nothing changes), and a state without this rank's key saved on the same dp degree
            logs a warning and leaves this rank at the start of its feed. Saved on another dp
            degree, this rank resumes from any rank's entry where the feed has a global
            position (``host_sampler``'s), which ``GlobalBatchLoader.load_state_dict`` reads
            (and refuses, naming why, for a feed whose position is per rank, such as the stock
            loader's ``DistributedSampler``)."""
            if not state_dict:  # torchtitan loads an empty state when there is none
                return
            key = _dp_key(state_dict, self._rank_id, state_dict.get("world_size"), self)
            if key is None:
                return
            where = f"TorchshardDataLoader.load_state_dict: state_dict[{key!r}]"
            state = _unpickle(state_dict[key], where)
            self.loader.load_state_dict(_peers_entry(state, self.loader._where()[0]))

    return TorchshardDataLoader


def _dp_entries(state_dict: dict[str, Any]) -> list[str]:
    return sorted(k for k in state_dict if isinstance(k, str) and k.startswith("dp_rank_"))


def _dp_key(state_dict: dict[str, Any], rank_id: str, saved_world: Any, loader: Any) -> str | None:
    """The key of ``state_dict`` this dp rank loads: its own; where it is missing, on the same
    dp degree ``None`` (torchtitan's behaviour: a warning, and the rank starts afresh), on
    another the first rank's entry (the loader resumes from the position every entry holds)."""
    if rank_id in state_dict:
        return rank_id
    others = _dp_entries(state_dict)
    if saved_world == loader.dp_world_size or not others:
        logger.warning(
            "DataLoader state is empty for dp rank %d, expected key %s (the state has %s); "
            "this rank starts from the beginning of its feed, as torchtitan's own loader does",
            loader.dp_rank,
            rank_id,
            sorted(map(str, state_dict)),
        )
        return None
    return others[0]


def _unpickle(blob: Any, where: str) -> Any:
    try:
        return pickle.loads(blob)
    except Exception as e:  # truncated, garbage, or a class that no longer imports
        raise ValueError(
            f"{where}: expected the pickled state of a GlobalBatchLoader, but it does "
            f"not unpickle ({type(e).__name__}: {e}); the checkpoint is truncated or "
            "corrupt. Load a complete checkpoint that this loader's state_dict() saved."
        ) from e


def _peers_entry(state: Any, process: int) -> Any:
    """A ``GlobalBatchLoader`` state under a dp rank's key, made this process's own: the key
    holds the state of whichever process of the dp rank torch.distributed.checkpoint kept
    (every process of a dp rank writes it, the checkpoint keeps one), whose entry is named for
    that process (``process_<p>``). The processes of one dp rank read the same examples, so
    each resumes from it (``process``: this process's index)."""
    if not isinstance(state, dict):
        return state  # GlobalBatchLoader.load_state_dict names what is wrong
    mine = f"process_{process}"
    entries = [k for k in state if isinstance(k, str) and k.startswith("process_")]
    if mine in state or len(entries) != 1:
        return state
    return {mine: state[entries[0]], **{k: v for k, v in state.items() if k != entries[0]}}


def dataloader(
    source: Any,
    /,
    *,
    parallel_dims: Any = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
    prefetch: int = 2,
) -> Any:
    """A torchtitan ``BaseDataLoader`` that reads ``source`` (a torchtitan loader such as
    ``ParallelAwareDataloader``, or any iterable of this process's host batches, e.g.
    ``(input_dict, labels)``) through a ``GlobalBatchLoader`` and yields local tensors.

    Args:
        source: this process's host batches; stateful (``state_dict``/``load_state_dict``)
            for checkpointing. It must read the shard ``feed_read_config(partition, mesh=mesh)``
            names (torchtitan's stock loader with ``dp_rank``/``dp_world_size`` of the
            ``batch`` mesh does).
        parallel_dims: torchtitan's ``ParallelDims``: the mesh is its data-loading mesh
            (``dataloading_mesh``). Exactly one of ``parallel_dims`` and ``mesh``.
        mesh: a ``torchshard.Mesh`` to use instead.
        partition: the batch's spec; default ``P("batch")`` on the data-loading mesh, else
            ``P(<the mesh's first axis>)``.
        prefetch: as for ``GlobalBatchLoader``.

    Returns:
        A ``TorchshardDataLoader`` (a ``torchtitan.components.dataloader.BaseDataLoader``),
        with ``dp_rank``, ``dp_world_size`` (from ``feed_read_config``), ``loader`` (the
        ``GlobalBatchLoader``), ``batch_size`` and ``num_workers`` (the source's),
        ``state_dict``/``load_state_dict`` keyed by dp rank (a missing key: see
        ``load_state_dict``).

    Raises:
        MissingDependencyError: torchtitan is not installed.
        TypeError: neither or both of ``parallel_dims`` and ``mesh``; a bad ``parallel_dims``.
    """
    cls = _loader_class()
    if (parallel_dims is None) == (mesh is None):
        raise TypeError(
            "torchtitan.dataloader: pass exactly one of parallel_dims (torchtitan's "
            "ParallelDims: its data-loading mesh) and mesh (a torchshard.Mesh), but got "
            f"{'both' if mesh is not None else 'neither'}."
        )
    if mesh is None:
        mesh = dataloading_mesh(parallel_dims)
    if partition is None:
        axis = "batch" if "batch" in mesh.axis_names else mesh.axis_names[0]
        partition = PartitionSpec(axis)
    feed = feed_read_config(partition, mesh=mesh)
    loader = GlobalBatchLoader(
        source, partition=partition, mesh=mesh, prefetch=prefetch, local=True
    )
    return cls(loader, feed["shard_index"], feed["num_shards"], source)


class TorchshardGrainDataLoader:
    """torchtitan main's data-loader protocol (``GrainDataLoader``'s: ``__iter__`` yields the
    trainer's batches, ``state_dict``/``load_state_dict`` in its layout, ``close``) over a
    ``GlobalBatchLoader`` that reads grain's ``ElasticIterator`` on this process's feed.

    Made by ``grain_dataloader``; ``loader`` is the ``GlobalBatchLoader``, ``dp_rank`` and
    ``dp_world_size`` this process's shard of the batch (``feed_read_config``), ``batch_size``
    the examples per step of this dp rank."""

    def __init__(
        self, loader: GlobalBatchLoader, dp_rank: int, dp_world_size: int, batch_size: int
    ) -> None:
        self.loader = loader
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.batch_size = batch_size
        self._rank_id = f"dp_rank_{dp_rank}"

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """torchtitan main's layout: ``{"version": 1, "dp_world_size": dp, "dp_rank_<r>":
        ...}``, this rank's entry the pickled ``GlobalBatchLoader`` state (one opaque value per
        key for torch.distributed.checkpoint), which holds the job's position (grain's global
        index, the same on every rank). A collective: call it on every process, after the same
        step (torchtitan's checkpointer does)."""
        return {
            "version": GRAIN_STATE_VERSION,
            "dp_world_size": self.dp_world_size,
            self._rank_id: pickle.dumps(self.loader.state_dict()),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from a ``state_dict()`` saved on any dp degree: every entry holds the job's
        position, so a rank whose key is missing (the job has more dp ranks than the one that
        saved) reads it from another rank's entry. An empty state is none, as torchtitan's.

        Raises:
            ValueError: another state version, or a state without any ``dp_rank_<r>`` entry
                (naming the keys it has); as ``GlobalBatchLoader.load_state_dict`` for an
                entry saved over another pipeline.
        """
        if not state_dict:
            return
        version = state_dict.get("version")
        if version != GRAIN_STATE_VERSION:
            raise ValueError(
                f"TorchshardGrainDataLoader.load_state_dict: unsupported state version "
                f"{version!r}, expected {GRAIN_STATE_VERSION} (torchtitan main's GrainDataLoader "
                "layout, which this loader's state_dict() saves)."
            )
        entries = _dp_entries(state_dict)
        saved = state_dict.get("dp_world_size")
        fresh = isinstance(saved, int) and self.dp_rank >= saved and self._rank_id in state_dict
        if fresh:
            # a job of `saved` dp ranks saved no such entry: it is this loader's own (fresh),
            # left in place by a load that reads only the checkpoint's keys (dcp.load)
            others = [k for k in entries if k != self._rank_id]
            if not others:
                raise ValueError(
                    f"TorchshardGrainDataLoader.load_state_dict: the state was saved on "
                    f"{saved} dp rank(s), so its {self._rank_id!r} is not from the checkpoint "
                    "(torch.distributed.checkpoint.load keeps a key the checkpoint lacks as it "
                    "was: this loader's fresh state), and this rank would read its data from "
                    "the start again. Pass load_state_dict a state that holds a saved rank's "
                    "entry (e.g. {'version': 1, 'dp_world_size': "
                    f"{saved}, 'dp_rank_0': <the checkpoint's dp_rank_0>}}), or resume on at "
                    f"most {saved} dp rank(s)."
                )
            entries = others
        key = self._rank_id if self._rank_id in state_dict and not fresh else None
        if key is None and entries:
            key = entries[0]
        if key is None:
            raise ValueError(
                f"TorchshardGrainDataLoader.load_state_dict: checkpoint is missing dataloader "
                f"state for {self._rank_id} and has no other dp rank's (it has "
                f"{sorted(map(str, state_dict))}); load the state this loader's state_dict() "
                "saved on every rank."
            )
        where = f"TorchshardGrainDataLoader.load_state_dict: state_dict[{key!r}]"
        state = _unpickle(state_dict[key], where)
        self.loader.load_state_dict(_peers_entry(state, self.loader._where()[0]))

    def close(self) -> None:
        self.loader.close()


def grain_dataloader(
    dataset: Any,
    /,
    *,
    global_batch_size: int,
    parallel_dims: Any = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
    last_batch: str = "drop",
    prefetch: int = 2,
    read_options: Any = None,
) -> TorchshardGrainDataLoader:
    """torchtitan main's grain loader with torchshard as its distributed layer: a map-style
    grain pipeline read through grain's ``ElasticIterator`` on this process's feed, whose
    ranks end together on finite data and whose checkpoint resumes on another dp degree.

    torchtitan's own ``GrainDataLoader`` slices a globally shuffled ``MapDataset`` per dp rank
    and refuses ``repeat=False`` with dp > 1; here the same ``MapDataset`` (not sliced, not
    batched) is sharded by the mesh (``torchshard.integrations.grain.elastic_iterator``: the
    tp/cp/pp peers of a dp rank read its rows, grain's global index is the position), and a
    ``GlobalBatchLoader`` (``local=True``) makes every rank stop at the same step where the
    shards run out unevenly (``last_batch``).

    Args:
        dataset: a ``grain.MapDataset`` of the trainer's samples (``(input_dict, labels)``
            pairs of fixed shapes, numpy or tensors; grain stacks them into batches, which
            arrive as tensors), unbatched and unsharded: shuffle it first
            (``dataset.shuffle(seed)``), ``repeat()`` it for an endless run. No ``filter``
            (grain's ``ElasticIterator`` refuses it: a global index must mean one sample).
        global_batch_size: samples per step over every dp rank (divisible by the dp degree).
        parallel_dims: torchtitan's ``ParallelDims`` (its data-loading mesh); this or
            ``mesh``, exactly one.
        mesh: a ``torchshard.Mesh``; this or ``parallel_dims``, exactly one.
        partition: the batch's spec; default ``P("batch")`` on the data-loading mesh, else
            ``P(<the mesh's first axis>)``.
        last_batch: ``"drop"`` (default: every rank stops at the first step some rank's
            shard cannot fill), ``"pad"`` (every rank runs to the longest shard and yields
            ``(batch, mask)``), or ``"error"``; see ``GlobalBatchLoader``.
        prefetch: as for ``GlobalBatchLoader``.
        read_options: grain's ``ReadOptions``.

    Returns:
        A ``TorchshardGrainDataLoader``.

    Raises:
        MissingDependencyError: grain is not installed.
        TypeError: ``dataset`` not a ``grain.MapDataset`` (naming the fix for torchtitan's
            iterable pipelines), neither or both of ``parallel_dims`` and ``mesh``.
        ValueError: as grain's ``ElasticIterator`` (a ``filter``; a ``global_batch_size``
            not divisible by the dp degree).
    """
    grain = require("grain", "torchshard.integrations.torchtitan", extra="grain")
    if not isinstance(dataset, grain.MapDataset):
        raise TypeError(
            "grain_dataloader: expected a grain.MapDataset (torchtitan's map-style pipeline, "
            f"unbatched and not sliced per dp rank), but got {type(dataset).__name__}. "
            "torchtitan's iterable pipelines (packing, streams) are built per dp rank: batch "
            "this rank's and pass it to torchshard.integrations.torchtitan.dataloader(source, "
            "...), whose ranks end together as well but resume on the same dp degree only."
        )
    if (parallel_dims is None) == (mesh is None):
        raise TypeError(
            "grain_dataloader: pass exactly one of parallel_dims (torchtitan's ParallelDims: "
            "its data-loading mesh) and mesh (a torchshard.Mesh), but got "
            f"{'both' if mesh is not None else 'neither'}."
        )
    if mesh is None:
        mesh = dataloading_mesh(parallel_dims)
    if partition is None:
        axis = "batch" if "batch" in mesh.axis_names else mesh.axis_names[0]
        partition = PartitionSpec(axis)
    from torchshard.integrations.grain import elastic_iterator

    source = elastic_iterator(
        dataset, global_batch_size, partition, mesh=mesh, read_options=read_options
    )
    feed = feed_read_config(partition, mesh=mesh)
    loader = GlobalBatchLoader(
        source, partition=partition, mesh=mesh, prefetch=prefetch, local=True, last_batch=last_batch
    )
    per_rank = global_batch_size // feed["num_shards"]
    return TorchshardGrainDataLoader(loader, feed["shard_index"], feed["num_shards"], per_rank)
