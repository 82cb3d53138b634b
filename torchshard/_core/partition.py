"""Input partition specs: ``input_partition_spec``, ``data_partition_type_to_spec`` and
``complete_partition_spec_tree`` (axlearn's semantics)."""

from __future__ import annotations

import dataclasses
from typing import Any

import optree

from torchshard._core.context import require_mesh
from torchshard._core.errors import ShardingError, UnsupportedPartitionError, at
from torchshard._core.mesh import Mesh
from torchshard._core.spec import DataPartitionType, PartitionSpec
from torchshard._core.tree import LazyPaths, broadcast_prefix, flatten, unflatten

BATCH_AXES = ("data", "fsdp")
SEQ_AXES = ("seq",)


class _DefaultPartition:
    """The default ``partition=`` of host -> global: ``FULL``, without a deprecation warning."""

    def __repr__(self) -> str:
        return "DataPartitionType.FULL"


DEFAULT_PARTITION: Any = _DefaultPartition()


def input_partition_spec() -> PartitionSpec:
    """The spec of an input batch: dim 0 split over every axis of the current mesh.

    Example (dim 0 of every global array is split 8 ways):
        >>> with torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model")):
        ...     torchshard.input_partition_spec()
        P(('data', 'model'),)
    """
    return PartitionSpec(require_mesh("input_partition_spec()").axis_names)


def batch_spec(mesh: Mesh) -> PartitionSpec:
    """The spec ``DataPartitionType.BATCH`` stands for on ``mesh``."""
    batch = tuple(a for a in mesh.axis_names if a in BATCH_AXES)
    seq = tuple(a for a in mesh.axis_names if a in SEQ_AXES)
    if not batch:
        raise ShardingError(
            f"DataPartitionType.BATCH splits dim 0 over the batch axes {BATCH_AXES}, but the "
            f"mesh has axes {mesh.axis_names}; name a mesh axis 'data' or 'fsdp', or pass a "
            "PartitionSpec."
        )
    return PartitionSpec(batch, seq or None)


def _is_partition_leaf(x: Any) -> bool:
    return isinstance(x, (PartitionSpec, DataPartitionType))


_ACCEPTED = (
    "a PartitionSpec (e.g. P('data')), a DataPartitionType, None (replicated), or a tree prefix "
    "of the data (dicts, lists, tuples, namedtuples, dataclasses) whose leaves are those"
)


def unsupported_partition(value: Any, where: str = "partition") -> UnsupportedPartitionError:
    """The error for a ``partition`` (or a leaf of a partition tree, at ``where``) that is none
    of the accepted forms: it lists them and, for a string, says how to write what it meant."""
    fix = ""
    if isinstance(value, str):
        fix = f" To split dim 0 over the mesh axis {value!r}, write P({value!r})."
        kinds = {t.value: t for t in DataPartitionType}
        if value.lower() in kinds:
            fix += f" For the partition type, write DataPartitionType.{kinds[value.lower()].name}."
    return UnsupportedPartitionError(
        at(
            where,
            f"Unsupported partition: {value} (of type {type(value).__name__}); expected "
            f"{_ACCEPTED}.{fix}",
        )
    )


def _one(partition: Any, where: str = "partition") -> PartitionSpec | None:
    if partition is None or isinstance(partition, PartitionSpec):
        return partition
    if partition is DataPartitionType.FULL:
        return input_partition_spec()
    if partition is DataPartitionType.REPLICATED:
        return PartitionSpec(None)
    if partition is DataPartitionType.BATCH:
        return batch_spec(require_mesh("data_partition_type_to_spec(BATCH)"))
    raise unsupported_partition(partition, where)


def data_partition_type_to_spec(partition: Any) -> Any:
    """The ``PartitionSpec`` (or tree of them) that ``partition`` stands for (axlearn
    compatibility: new code passes specs).

    ``FULL`` -> ``input_partition_spec()``; ``REPLICATED`` -> ``P(None)``; ``BATCH`` ->
    ``P(batch axes, seq axes)`` of the current mesh; a ``PartitionSpec`` is returned as is; a
    tree (dicts, lists, tuples, namedtuples, dataclasses, as data trees) is converted leaf by
    leaf.

    Example:
        >>> from torchshard import DataPartitionType
        >>> torchshard.data_partition_type_to_spec(DataPartitionType.REPLICATED)
        P(None,)
        >>> with torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model")):
        ...     torchshard.data_partition_type_to_spec(
        ...         {"x": DataPartitionType.FULL, "y": DataPartitionType.BATCH}
        ...     )
        {'x': P(('data', 'model'),), 'y': P('data', None)}
    """
    if _is_partition_leaf(partition) or partition is None:
        return _one(partition)
    if not _is_tree_node(partition):
        raise unsupported_partition(partition)
    if _looks_like_spec_entries(partition):
        spec = ", ".join(repr(e) for e in partition)
        raise UnsupportedPartitionError(
            f"partition={partition!r}: a {type(partition).__name__} of mesh axis names is not a "
            "partition (a tuple or list is a tree prefix of the data, one partition per "
            "element). It reads as the entries of one PartitionSpec, as xs.ShardingSpec's "
            f"partition_spec is written: write P({spec}) (from torchshard import P)."
        )
    leaves, treespec = flatten(partition, is_leaf=_is_partition_leaf)
    where = LazyPaths(treespec, "partition")
    return unflatten(treespec, [_one(x, where[i]) for i, x in enumerate(leaves)])


def _looks_like_spec_entries(x: Any) -> bool:
    """A plain tuple or list of axis names (str, ``None``, tuples of str), one a str: the
    entries of a ``PartitionSpec`` written without ``P``."""

    def entry(e: Any) -> bool:
        if isinstance(e, DataPartitionType | PartitionSpec):  # P is a tuple
            return False
        if isinstance(e, tuple) and not optree.is_namedtuple(e):
            return bool(e) and all(isinstance(a, str) for a in e)
        return e is None or isinstance(e, str)

    if not isinstance(x, tuple | list) or isinstance(x, PartitionSpec) or optree.is_namedtuple(x):
        return False
    if not x:
        return False
    return all(entry(e) for e in x) and any(e is not None for e in x)


def _is_tree_node(x: Any) -> bool:
    return (
        isinstance(x, (dict, list, tuple))
        or optree.is_namedtuple(x)
        or (dataclasses.is_dataclass(x) and not isinstance(x, type))
    )


def complete_partition_spec_tree(treedef_or_tree: Any, partition_spec_tree: Any) -> Any:
    """Broadcasts a prefix tree of specs to the full structure of ``treedef_or_tree`` (axlearn
    compatibility: torchshard's calls take prefix trees themselves).

    Args:
        treedef_or_tree: an optree ``PyTreeSpec``, or a tree whose structure is used.
        partition_spec_tree: a prefix of that structure whose leaves are specs (any object that
            is not a dict/list/tuple node) or ``None``; each covers its whole subtree.

    Returns:
        A tree with the structure of ``treedef_or_tree`` whose leaves are the covering specs.

    Raises:
        TreeStructureError: (a ``ValueError``) if ``partition_spec_tree`` is not a prefix.

    Example:
        >>> from torchshard import P
        >>> torchshard.complete_partition_spec_tree({"a": 1, "b": [2, 3]}, {"a": None, "b": P("x")})
        {'a': None, 'b': [P('x',), P('x',)]}
    """
    if isinstance(treedef_or_tree, optree.PyTreeSpec):
        tree = optree.tree_unflatten(treedef_or_tree, [0] * treedef_or_tree.num_leaves)
    else:
        tree = treedef_or_tree
    _, treespec = flatten(tree)
    specs = broadcast_prefix(
        partition_spec_tree,
        tree,
        is_prefix_leaf=_is_spec_tree_leaf,
        prefix_name="partition_spec_tree",
        full_name="treedef_or_tree",
    )
    return unflatten(treespec, specs)


def _is_spec_tree_leaf(x: Any) -> bool:
    return not isinstance(x, (dict, list, tuple)) or isinstance(x, PartitionSpec)


def feed_partition(partition: Any, dispatcher: Any) -> Any:
    """What a loader or a collate function passes as ``partition=``: the dispatcher's
    ``partition_spec`` when ``partition`` is the default and a dispatcher is given; the default
    for ``FULL`` (a ``DataPartitionType`` is accepted there without a deprecation warning); else
    the spec (tree) it stands for. Must run under the mesh."""
    if partition is DEFAULT_PARTITION and dispatcher is not None:
        return dispatcher.partition_spec
    if partition is DEFAULT_PARTITION or partition is DataPartitionType.FULL:
        return DEFAULT_PARTITION
    return data_partition_type_to_spec(partition)
