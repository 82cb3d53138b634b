"""input_partition_spec, data_partition_type_to_spec, complete_partition_spec_tree
(torchshard._core.partition), ported from axlearn's utils_test.py and extended."""

import collections
import dataclasses
import re

import numpy as np
import optree
import pytest

import torchshard as ts
from torchshard._core.tree import structure


@pytest.mark.xla
@pytest.mark.parametrize(
    ("mesh_shape", "axis_names"),
    [((4, 2), ("data", "model")), ((2, 2, 2), ("pipeline", "data", "model"))],
)
def test_input_partition_spec(mesh_shape, axis_names):
    # axlearn: on meshes of rank 2 and 3, the input spec splits dim 0 over every axis.
    with ts.Mesh(np.arange(8).reshape(mesh_shape), axis_names):
        assert ts.input_partition_spec() == ts.P(axis_names)
        assert ts.input_partition_spec() == (axis_names,)


def test_input_partition_spec_needs_a_mesh():
    with pytest.raises(
        ts.errors.NoMeshError,
        match=re.escape(
            "input_partition_spec() must be called inside `with mesh:`, but there is no current "
            "mesh in this thread. Create one with torchshard.create_device_mesh(...) and enter it."
        ),
    ):
        ts.input_partition_spec()


def test_full_partition(mesh42):
    assert ts.data_partition_type_to_spec(ts.DataPartitionType.FULL) == ts.P(("data", "model"))


def test_replicated_partition():
    assert ts.data_partition_type_to_spec(ts.DataPartitionType.REPLICATED) == ts.P(None)


@pytest.mark.xla
def test_batch_partition():
    with ts.Mesh(np.arange(8).reshape(2, 2, 2), ("data", "seq", "model")):
        assert ts.data_partition_type_to_spec(ts.DataPartitionType.BATCH) == ts.P(
            ("data",), ("seq",)
        )
    with ts.Mesh(np.arange(8).reshape(2, 2, 2), ("fsdp", "data", "model")):
        assert ts.data_partition_type_to_spec(ts.DataPartitionType.BATCH) == ts.P(
            ("fsdp", "data"), None
        )
    with (
        ts.Mesh(np.arange(8).reshape(4, 2), ("x", "y")),
        pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "DataPartitionType.BATCH splits dim 0 over the batch axes ('data', 'fsdp'), but "
                "the mesh has axes ('x', 'y'); name a mesh axis 'data' or 'fsdp', or pass a "
                "PartitionSpec."
            ),
        ),
    ):
        ts.data_partition_type_to_spec(ts.DataPartitionType.BATCH)


def test_partition_spec_input_is_returned_as_is():
    # axlearn uses PartitionSpec(("data", 0), ("model", 1)); torchshard's specs hold axis names
    # only (validated when built), so the port uses names.
    custom = ts.P(("data", "fsdp"), ("model", "seq"))
    assert ts.data_partition_type_to_spec(custom) is custom


def test_dict_input(mesh42):
    tree = {"a": ts.P("b"), "c": {"d": ts.P("d")}}
    assert ts.data_partition_type_to_spec(tree) == tree
    mixed = {"a": ts.DataPartitionType.REPLICATED, "b": [ts.DataPartitionType.FULL, None]}
    assert ts.data_partition_type_to_spec(mixed) == {
        "a": ts.P(None),
        "b": [ts.P(("data", "model")), None],
    }


@pytest.mark.parametrize("bad", ["unsupported_type", 123, 1.5, object])
def test_unsupported_partition_type(bad):
    with pytest.raises(NotImplementedError, match=re.escape(f"Unsupported partition: {bad}")):
        ts.data_partition_type_to_spec(bad)
    with pytest.raises(TypeError, match=re.escape(f"Unsupported partition: {bad}")):
        ts.data_partition_type_to_spec({"x": bad})


def test_unsupported_is_both_type_and_not_implemented_error():
    assert issubclass(ts.errors.UnsupportedPartitionError, TypeError)
    assert issubclass(ts.errors.UnsupportedPartitionError, NotImplementedError)


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    """A dataclass used as a spec (axlearn's ParameterSpec): a leaf of a spec tree."""

    shape: tuple
    mesh_axes: tuple


@dataclasses.dataclass
class Pair:
    """A dataclass used as a node of a data tree."""

    c: object
    d: object


def test_complete_partition_spec_tree():
    # axlearn's test, with a dict and a dataclass node in place of its VDict.
    data = {"replicated": {"a": 1, "b": 2}, "sharded": Pair(c=3, d=4)}
    by_x = ts.P("x")
    # A treedef must come from torchshard's namespace, where dataclasses are nodes.
    for treedef_or_tree in (data, structure(data)):
        assert ts.complete_partition_spec_tree(
            treedef_or_tree, {"replicated": None, "sharded": by_x}
        ) == {"replicated": {"a": None, "b": None}, "sharded": Pair(c=by_x, d=by_x)}
    param_spec = ParameterSpec(shape=(1, 2, 3), mesh_axes=("x", "y", "z"))
    assert ts.complete_partition_spec_tree(data, {"replicated": None, "sharded": param_spec}) == {
        "replicated": {"a": None, "b": None},
        "sharded": Pair(c=param_spec, d=param_spec),
    }
    # The dataclass spec stayed a leaf: it was not registered as a tree node.
    leaves = optree.tree_leaves({"p": param_spec}, namespace="torchshard")
    assert leaves == [param_spec]


def test_complete_partition_spec_tree_types_and_none():
    Point = collections.namedtuple("Point", "x y")
    data = {"t": (1, [2, 3]), "n": Point(4, 5), "none": None}
    got = ts.complete_partition_spec_tree(
        data, {"t": (ts.P("a"), None), "n": ts.P("b"), "none": ts.P("c")}
    )
    assert got == {"t": (ts.P("a"), [None, None]), "n": Point(ts.P("b"), ts.P("b")), "none": None}
    assert type(got["t"]) is tuple and type(got["n"]) is Point
    assert ts.complete_partition_spec_tree(data, None) == {
        "t": (None, [None, None]),
        "n": Point(None, None),
        "none": None,
    }


def test_complete_partition_spec_tree_not_a_prefix():
    with pytest.raises(ValueError) as info:
        ts.complete_partition_spec_tree({"a": 1, "b": [2, 3]}, {"a": None, "b": [ts.P("x")]})
    assert isinstance(info.value, ts.errors.TreeStructureError)
    assert str(info.value) == (
        "partition_spec_tree['b'] must be a tree prefix of treedef_or_tree['b'], but it is a "
        "list of 1 where treedef_or_tree['b'] is a list of 2; give one spec per element, in a "
        "list, or one spec for the whole list."
    )


@pytest.mark.parametrize(
    ("bad", "spec"),
    [
        (("data", None), "P('data', None)"),
        (["data"], "P('data')"),
        ((("data", "model"), None), "P(('data', 'model'), None)"),
    ],
)
def test_axis_names_without_p_say_to_write_p(bad, spec):
    # Before: "partition[0]: Unsupported partition: data" (the tuple read as a tree prefix).
    with pytest.raises(ts.errors.UnsupportedPartitionError) as info:
        ts.data_partition_type_to_spec(bad)
    assert str(info.value) == (
        f"partition={bad!r}: a {type(bad).__name__} of mesh axis names is not a partition (a "
        "tuple or list is a tree prefix of the data, one partition per element). It reads as "
        "the entries of one PartitionSpec, as xs.ShardingSpec's partition_spec is written: "
        f"write {spec} (from torchshard import P)."
    )


def test_a_tuple_of_specs_is_still_a_tree_prefix():
    assert ts.data_partition_type_to_spec((ts.P("data"), None)) == (ts.P("data"), None)


def test_dataclass_spec_trees(mesh42):
    tree = Pair(c=ts.DataPartitionType.REPLICATED, d=[ts.P("data"), None])
    assert ts.data_partition_type_to_spec(tree) == Pair(c=ts.P(None), d=[ts.P("data"), None])
    with pytest.raises(
        ts.errors.UnsupportedPartitionError, match=re.escape("Unsupported partition: 3")
    ):
        ts.data_partition_type_to_spec(Pair(c=3, d=None))


def test_complete_partition_spec_tree_matches_dicts_by_key():
    """An OrderedDict tree with a plain-dict spec tree (and the other way round): each key
    keeps its own spec, in the tree's own key order (they were matched by position)."""
    P = ts.P
    tree = collections.OrderedDict(b=1, a=[2, 3])
    expected = collections.OrderedDict(b=None, a=[P("x"), P("x")])
    for given in (tree, optree.tree_structure(tree)):
        got = ts.complete_partition_spec_tree(given, {"a": P("x"), "b": None})
        assert got == expected
        assert type(got) is collections.OrderedDict and list(got) == ["b", "a"]
    got = ts.complete_partition_spec_tree(
        {"a": 1, "b": 2}, collections.OrderedDict(b=P("y"), a=None)
    )
    assert got == {"a": None, "b": P("y")}
