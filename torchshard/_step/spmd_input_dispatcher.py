"""``SpmdInputDispatcher``: feeds inferred from the mesh, so each host's block assembles the
global batch directly (axlearn's ``SpmdInputDispatcher``).

The feed index and count along the batch dimension come from
``NamedSharding(mesh, partition_spec).process_index_and_count(0)`` on the current mesh and
topology (virtual hosts included); batch conversions are the identity. A spec may split other
dimensions too (``P("dp", "tp")``, ``P("dp", "cp")`` on a sequence dim): the feed is dim 0's,
and each host supplies its slice of the others (``torchshard.feed_slices``).
"""

from __future__ import annotations

import math
from typing import Any

from torchshard._core.checks import positive_int
from torchshard._core.context import require_mesh
from torchshard._core.errors import ShardingError, at
from torchshard._core.sharding import NamedSharding
from torchshard._core.spec import PartitionSpec, as_partition_spec, spec_entry_axes
from torchshard._core.tensor_spec import TensorSpec
from torchshard._core.tree import LazyPaths, flatten, unflatten
from torchshard._place.host_data import shape_dtype


class SpmdInputDispatcher:
    """A mesh-aware dispatcher: each feed's index and the feed count along the batch dim come
    from the current mesh and topology, so feeds assemble the global batch directly (identity
    batch conversions).

    Args:
        global_logical_batch_size: the examples per step.
        partition_spec: how the batch is split. Its dim 0 decides the feeds; where it splits
            other dims too (``P("dp", "tp")``), each host's block holds its slice of them
            (``torchshard.feed_slices(partition_spec, global_shape)``), which the dispatcher
            does not check (dim 0 is the batch it counts).

    Raises:
        NoMeshError: outside ``with mesh:``.
        ValueError: an empty spec, or a batch not divisible by the partitions of dim 0.
        NonUniformShardingError: the processes' blocks of dim 0 are not equal, disjoint groups.

    Example (mesh ``(4, 2)``, axes ``data``/``model``, on host 1 of 2):
        >>> from torchshard.testing import virtual_hosts
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> with virtual_hosts(2, process_index=1), mesh:
        ...     d = torchshard.SpmdInputDispatcher(8, partition_spec=torchshard.P("data"))
        >>> d.feed_read_config()
        {'num_shards': 2, 'shard_index': 1}
        >>> d.feed_logical_batch_size
        4
    """

    def __init__(self, global_logical_batch_size: int, *, partition_spec: PartitionSpec) -> None:
        mesh = require_mesh("SpmdInputDispatcher")
        logical = positive_int(global_logical_batch_size, "global_logical_batch_size")
        if not isinstance(partition_spec, PartitionSpec):
            raise TypeError(f"partition_spec must be a PartitionSpec, but got {partition_spec!r}.")
        if not partition_spec:
            raise ValueError(f"partition_spec={partition_spec!r} cannot be empty.")
        sharding = NamedSharding(mesh, as_partition_spec(partition_spec))
        num_partitions = math.prod(mesh.shape[a] for a in spec_entry_axes(partition_spec[0]))
        if logical % num_partitions:
            raise ValueError(
                f"partition_spec={partition_spec!r} attempts to divide the batch over "
                f"num_partitions={num_partitions}, which is incompatible with "
                f"global_logical_batch_size={logical}."
            )
        self._logical = logical
        self._spec = partition_spec
        self._index, self._count = sharding.process_index_and_count(0)

    def __repr__(self) -> str:
        return (
            f"SpmdInputDispatcher(global_logical_batch_size={self._logical}, "
            f"partition_spec={self._spec!r})"
        )

    @property
    def global_logical_batch_size(self) -> int:
        """The examples per step."""
        return self._logical

    @property
    def num_logical_feeds(self) -> int:
        """The distinct blocks of the batch along dim 0 (the feeds)."""
        return self._count

    @property
    def logical_feed_index(self) -> int:
        """This process's block."""
        return self._index

    @property
    def feed_logical_batch_size(self) -> int:
        """The examples this process batches."""
        return self._logical // self._count

    @property
    def partition_spec(self) -> PartitionSpec:
        """The spec to assemble with."""
        return self._spec

    def feed_read_config(self) -> dict[str, int]:
        """``{"num_shards": feed count, "shard_index": this feed}``."""
        return {"num_shards": self._count, "shard_index": self._index}

    def logical_to_physical_batch(self, logical_feed_batch: Any, /) -> Any:
        """The batch itself (new containers, same leaves), once every leaf's dim 0 is checked
        to be ``feed_logical_batch_size``.

        Raises:
            ShardingError: (a ``ValueError``) naming the leaf whose dim 0 is another size (the
                global batch would then not be ``global_logical_batch_size`` examples).
            TypeError: a leaf without a shape.
        """
        leaves, treespec = flatten(logical_feed_batch)
        where = LazyPaths(treespec, "logical_feed_batch")
        for i, leaf in enumerate(leaves):
            self._check_rows(leaf, self.feed_logical_batch_size, where[i], "feed's")
        return unflatten(treespec, leaves)

    def physical_to_logical_batch(self, global_physical_batch: Any, /) -> Any:
        """The batch itself (new containers, same leaves), once every leaf's dim 0 is checked
        to be ``global_logical_batch_size`` (shapes only: nothing syncs).

        Raises:
            ShardingError: (a ``ValueError``) naming the leaf whose dim 0 is another size.
        """
        leaves, treespec = flatten(global_physical_batch)
        where = LazyPaths(treespec, "global_physical_batch")
        for i, leaf in enumerate(leaves):
            self._check_rows(leaf, self._logical, where[i], "global")
        return unflatten(treespec, leaves)

    def _check_rows(self, leaf: Any, expected: int, where: str, which: str) -> None:
        shape = getattr(leaf, "shape", None)
        if shape is None:
            raise TypeError(
                at(
                    where,
                    f"expected an array or tensor (a batch along dim 0), but got "
                    f"{type(leaf).__name__}.",
                )
            )
        shape = tuple(shape)
        if not shape or shape[0] != expected:
            found = "a scalar" if not shape else f"dim 0 of size {shape[0]}"
            raise ShardingError(
                at(
                    where,
                    f"dim 0 of every leaf is the {which} batch of this "
                    f"SpmdInputDispatcher(global_logical_batch_size={self._logical}) over "
                    f"{self._count} feeds; expected {expected}, got {found} (shape {shape}). Batch "
                    f"feed_logical_batch_size={self.feed_logical_batch_size} examples per feed, or "
                    "make the dispatcher with the batch size the data has.",
                )
            )

    def logical_to_physical_shapes(self, logical_feed_shapes: Any, /) -> Any:
        """``TensorSpec``s of the same shapes; every leaf's dim 0 must be
        ``feed_logical_batch_size``."""
        leaves, treespec = flatten(logical_feed_shapes)
        where = LazyPaths(treespec, "logical_feed_shapes")
        out = []
        for i, leaf in enumerate(leaves):
            shape, dtype = shape_dtype(leaf, where[i])
            if not shape:
                raise ShardingError(
                    at(where[i], "expected a batch of rank >= 1, but got a scalar spec.")
                )
            self._check_rows(
                TensorSpec(shape, dtype), self.feed_logical_batch_size, where[i], "feed's"
            )
            out.append(TensorSpec(shape, dtype))
        return unflatten(treespec, out)
