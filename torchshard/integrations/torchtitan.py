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

torchtitan is imported on first use.
"""

from __future__ import annotations

import functools
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

        def __init__(self, loader: GlobalBatchLoader, dp_rank: int, dp_world_size: int) -> None:
            self.loader = loader
            self.dp_rank = dp_rank
            self.dp_world_size = dp_world_size
            self._rank_id = f"dp_rank_{dp_rank}"

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
            if not state_dict:  # torchtitan loads an empty state when there is none
                return
            if self._rank_id not in state_dict:
                raise ValueError(
                    f"TorchshardDataLoader.load_state_dict: the state has no entry "
                    f"{self._rank_id!r} for this process's dp rank (it has "
                    f"{sorted(state_dict)}); it was saved by another loader or dp layout."
                )
            saved = state_dict.get("world_size")
            if saved != self.dp_world_size:
                raise ValueError(
                    f"TorchshardDataLoader.load_state_dict: the state was saved with "
                    f"{saved} dp shards, this loader has {self.dp_world_size}; resuming on "
                    "another dp degree is not supported by this state layout."
                )
            where = f"TorchshardDataLoader.load_state_dict: state_dict[{self._rank_id!r}]"
            try:
                state = pickle.loads(state_dict[self._rank_id])
            except Exception as e:  # truncated, garbage, or a class that no longer imports
                raise ValueError(
                    f"{where}: expected the pickled state of a GlobalBatchLoader, but it does "
                    f"not unpickle ({type(e).__name__}: {e}); the checkpoint is truncated or "
                    "corrupt. Load a complete checkpoint that this loader's state_dict() saved."
                ) from e
            self.loader.load_state_dict(_peers_entry(state, self.loader._where()[0]))

    return TorchshardDataLoader


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
        ``GlobalBatchLoader``), ``state_dict``/``load_state_dict`` keyed by dp rank.

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
    return cls(loader, feed["shard_index"], feed["num_shards"])
