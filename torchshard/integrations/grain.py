"""torchshard over grain: ``shard_options(partition=None, *, mesh=None, drop_remainder=True)``.

grain shards a pipeline with ``ShardOptions(shard_index, shard_count, drop_remainder)`` (an
``IndexSampler``'s records, ``grain.experimental.ElasticIterator``'s global indices, a
``MapDataset`` sliced ``ds[shard_index::shard_count]``), and its usual recipe takes the index
and count from the process (``ShardByJaxProcess``): every process its own shard. Under a layout
where several processes hold one block of the batch (the tp or cp peers of a dp row), they must
read the same examples; ``shard_options`` gives grain the *feed* of this process
(``torchshard.feed_read_config``), so that they do.

The pipelines then feed ``GlobalBatchLoader`` as they are (``docs/data.md``): a grain
``MapDataset``, ``IterDataset`` or ``DataLoader`` (each ``iter()`` a pass, its iterator's
``get_state``/``set_state`` inside the loader's snapshot), an iterator of one, or an
``ElasticIterator``, whose state (``{"global_next_index": n}``, the same on every process)
resumes on another number of processes.

grain is imported on first use.
"""

from __future__ import annotations

import functools
from typing import Any

from torchshard._core.feed import feed_read_config, resolve_mesh, resolve_spec
from torchshard._core.optional import require
from torchshard._core.spec import PartitionSpec
from torchshard._mesh.mesh import Mesh


def _grain() -> Any:
    return require("grain", "torchshard.integrations.grain", extra="grain")


def shard_options(
    partition: Any = None, /, *, mesh: Mesh | None = None, drop_remainder: bool = True
) -> Any:
    """A ``grain.sharding.ShardOptions`` for this process's feed: ``shard_index`` and
    ``shard_count`` are ``torchshard.feed_read_config(partition, mesh=mesh)``'s shard, so the
    processes whose devices hold the same block of the batch's dim 0 read the same shard.

    Args:
        partition: the batch's ``PartitionSpec`` (or ``DataPartitionType``; only dim 0
            matters); default ``None``: dim 0 over every mesh axis (the loader's default).
        mesh: a ``torchshard.Mesh``; default: the current mesh.
        drop_remainder: grain's: every shard the same number of records (the remainder
            dropped); ``False``: every record once, the shards differing by one (feed them with
            ``GlobalBatchLoader(..., last_batch="pad")``).

    Raises:
        MissingDependencyError: grain is not installed. TypeError: ``drop_remainder`` not a
        bool. NoMeshError, ShardingError: as ``feed_read_config``.

    Example::

        with mesh:  # (dp=2, tp=2): processes 0, 1 read shard 0 of 2; 2, 3 shard 1
            options = shard_options(P("dp"))
        sampler = grain.samplers.IndexSampler(len(source), shard_options=options, ...)
        elastic = grain.experimental.ElasticIterator(dataset, global_batch_size, options)
    """
    grain = _grain()
    if not isinstance(drop_remainder, bool):
        raise TypeError(
            f"shard_options: drop_remainder must be a bool, but got {drop_remainder!r}."
        )
    m = resolve_mesh(mesh, "shard_options")
    spec = (
        PartitionSpec(tuple(m.axis_names))
        if partition is None
        else resolve_spec(partition, m, "shard_options")
    )
    feed = feed_read_config(spec, mesh=m)
    return grain.sharding.ShardOptions(
        shard_index=feed["shard_index"],
        shard_count=feed["num_shards"],
        drop_remainder=drop_remainder,
    )


def elastic_iterator(
    dataset: Any,
    global_batch_size: int,
    partition: Any = None,
    /,
    *,
    mesh: Mesh | None = None,
    read_options: Any = None,
    multiprocessing_options: Any = None,
) -> Any:
    """grain's ``experimental.ElasticIterator`` over this process's feed (``shard_options(
    partition, mesh=mesh)``), which a ``GlobalBatchLoader`` resumes on another number of
    processes.

    grain's iterator reads the unbatched ``MapDataset`` ``dataset[n + shard_index ::
    shard_count]`` in batches of ``global_batch_size // shard_count``, its state is the global
    index ``{"global_next_index": n}``, the same on every shard; any shard count resumes from
    it. The one made here is that iterator (a subclass: the same batches, the same states),
    which also tells the loader that its state is the job's position: the loader's common
    entry keeps it, and a state saved on ``N`` processes loads on ``M``, every example once.

    Args:
        dataset: an unbatched, unsharded ``grain.MapDataset`` (no ``filter``: grain refuses it).
        global_batch_size: the examples per step over every feed (divisible by the feeds).
        partition, mesh: the batch's layout, as for ``shard_options``.
        read_options, multiprocessing_options: grain's.

    Raises:
        ValueError: as grain's ``ElasticIterator`` (a filter in the pipeline); a
        ``global_batch_size`` not divisible by the feeds (at the first batch, as grain).
    """
    options = shard_options(partition, mesh=mesh, drop_remainder=True)
    kwargs: dict[str, Any] = {"multiprocessing_options": multiprocessing_options}
    if read_options is not None:
        kwargs["read_options"] = read_options
    return _elastic_class()(dataset, global_batch_size, options, **kwargs)


@functools.cache
def _elastic_class() -> type:
    """grain's ``ElasticIterator`` with the loader's elastic protocol (made once)."""
    base: Any = _grain().experimental.ElasticIterator

    class ElasticIterator(base):
        """grain's ``ElasticIterator``, whose state is the job's position (a global index)."""

        def elastic_part(self, state: dict[str, Any]) -> dict[str, Any]:
            return {"global_next_index": int(state["global_next_index"])}

        @staticmethod
        def merge_elastic_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
            if len(parts) != 1:
                raise ValueError(
                    "ElasticIterator: the processes saved different global indices "
                    f"({sorted(p['global_next_index'] for p in parts)}); every shard of an "
                    "ElasticIterator advances by the global batch per step, so they were not "
                    "saved after the same step. Save the loader's state on every process after "
                    "the same batch."
                )
            return dict(parts[0])

        def load_elastic_state(self, position: dict[str, Any]) -> None:
            self.set_state({"global_next_index": int(position["global_next_index"])})

    ElasticIterator.__module__ = __name__
    ElasticIterator.__qualname__ = "ElasticIterator"
    return ElasticIterator
