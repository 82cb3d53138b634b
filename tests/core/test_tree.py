"""Pytree handling (torchshard._core.tree): None as an empty subtree, dataclasses as nodes, paths,
prefix broadcasting with precise errors."""

import collections
import dataclasses
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchshard as ts
from torchshard._core.tree import (
    NAMESPACE,
    LazyPaths,
    broadcast_prefix,
    flatten,
    paths,
    structure,
    unflatten,
)

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Node:
    a: object
    b: object = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    u: object
    v: object


def _is_spec(x):
    return isinstance(x, ts.PartitionSpec)


def test_flatten_keeps_node_types_and_passes_none_through():
    tree = {"d": {"z": 1, "a": 2}, "l": [3, None], "t": (4,), "p": Point(5, 6), "n": Node(7)}
    leaves, spec = flatten(tree)
    assert sorted(leaves) == [1, 2, 3, 4, 5, 6, 7]
    back = unflatten(spec, leaves)
    assert back == tree
    assert type(back["t"]) is tuple and type(back["p"]) is Point and type(back["n"]) is Node
    assert list(back["d"]) == ["z", "a"]  # insertion order kept
    assert back["l"][1] is None and back["n"].b is None


def test_frozen_dataclasses_rebuild():
    leaves, spec = flatten(Frozen(1, [2, 3]))
    assert leaves == [1, 2, 3]
    assert unflatten(spec, [4, 5, 6]) == Frozen(4, [5, 6])


def test_tensor_spec_is_a_leaf():
    spec = ts.TensorSpec((2, 3), "float32")
    assert flatten({"s": spec})[0] == [spec]


def test_paths_are_code():
    tree = {"x": [1, {"y": 2}], "p": Point(3, 4), "n": Node(5, 6)}
    _, spec = flatten(tree)
    assert paths(spec, "host_arrays") == [
        "host_arrays['n'].a",
        "host_arrays['n'].b",
        "host_arrays['p'].x",
        "host_arrays['p'].y",
        "host_arrays['x'][0]",
        "host_arrays['x'][1]['y']",
    ]
    lazy = LazyPaths(spec, "t")
    assert lazy[4] == "t['x'][0]"


def test_broadcast_prefix():
    full = {"a": [1, 2], "b": {"c": 3, "d": None}, "e": Node(4, 5)}
    got = broadcast_prefix(
        {"a": ts.P("x"), "b": None, "e": Node(ts.P("y"), None)},
        full,
        is_prefix_leaf=_is_spec,
        prefix_name="partition",
        full_name="host_arrays",
    )
    # flatten order: a[0], a[1], b.c, e.a, e.b
    assert got == [ts.P("x"), ts.P("x"), None, ts.P("y"), None]
    assert (
        broadcast_prefix(ts.P("z"), full, is_prefix_leaf=_is_spec, prefix_name="p", full_name="f")
        == [ts.P("z")] * 5
    )
    assert (
        broadcast_prefix(None, full, is_prefix_leaf=_is_spec, prefix_name="p", full_name="f")
        == [None] * 5
    )


def test_broadcast_prefix_spec_for_a_none_subtree_covers_nothing():
    got = broadcast_prefix(
        {"a": ts.P("x"), "b": ts.P("y")},
        {"a": 1, "b": None},
        is_prefix_leaf=_is_spec,
        prefix_name="partition",
        full_name="host_arrays",
    )
    assert got == [ts.P("x")]


def test_broadcast_prefix_error_names_the_keys_in_one_sentence():
    # Before: optree's raw error and both tree structures (15 lines for a misspelt key).
    with pytest.raises(ts.errors.TreeStructureError) as info:
        broadcast_prefix(
            {"image": ts.P("x"), "lables": None},
            {"image": 1, "label": 2},
            is_prefix_leaf=_is_spec,
            prefix_name="partition",
            full_name="host_arrays",
        )
    assert str(info.value) == (
        "partition must be a tree prefix of host_arrays, but it has key 'lables' that "
        "host_arrays lacks and lacks key 'label' (did you mean 'label' for 'lables'?). A dict "
        "of specs names exactly the keys of the data (host_arrays has keys 'image', 'label'); "
        "to give a whole dict one spec, pass that spec instead of the dict."
    )
    with pytest.raises(ts.errors.TreeStructureError) as info:
        broadcast_prefix(
            {"a": {"b": ts.P("x")}},
            {"a": {"b": 1, "c": 2}},
            is_prefix_leaf=_is_spec,
            prefix_name="partition",
            full_name="host_arrays",
        )
    assert str(info.value).startswith(
        "partition['a'] must be a tree prefix of host_arrays['a'], but it lacks key 'c'. "
    )


def test_broadcast_prefix_tuple_is_not_a_prefix_of_a_namedtuple():
    with pytest.raises(
        ts.errors.TreeStructureError,
        match=re.escape("partition must be a tree prefix of host_arrays, but it is not."),
    ):
        broadcast_prefix(
            (ts.P("x"), None),
            Point(1, 2),
            is_prefix_leaf=_is_spec,
            prefix_name="partition",
            full_name="host_arrays",
        )


def test_structure():
    assert structure({"a": None, "b": [1]}) == flatten({"a": None, "b": [1]})[1]


# -- flat dicts: flattened again from their keys, not by optree --

_VALUES = st.one_of(
    st.integers(),
    st.none(),
    st.just(np.zeros(2)),
    st.builds(lambda v: torch.full((1,), v), st.integers(0, 9)),
    st.builds(lambda a: (a,), st.integers()),
    st.builds(lambda a: {"inner": a}, st.integers()),
    st.builds(lambda a: Node(a), st.integers()),
)
_KEYS = st.one_of(st.text(max_size=3), st.integers(-3, 3))


@settings(max_examples=200, deadline=None)
@given(
    first=st.dictionaries(_KEYS, _VALUES, max_size=6),
    again=st.lists(_VALUES, max_size=6),
)
def test_a_flat_dict_seen_before_flattens_as_optree_does(first, again):
    """Flattening a dict whose keys were seen before takes the memo of its treespec when every
    value is a leaf of a type seen before; whatever the values, the result is optree's."""
    import optree

    def reference(tree):
        return optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)

    flatten(first)  # records the keys when every value is a leaf
    values = (again + [None] * len(first))[: len(first)]
    second = dict(zip(first, values, strict=True))
    for tree in (first, second):
        leaves, spec = flatten(tree)
        ref_leaves, ref_spec = reference(tree)
        assert spec == ref_spec
        assert len(leaves) == len(ref_leaves)
        assert all(a is b for a, b in zip(leaves, ref_leaves, strict=True))
        rebuilt = unflatten(spec, leaves)
        assert list(rebuilt) == list(tree)  # the dict's own key order
        assert all(a is b for a, b in zip(reference(rebuilt)[0], ref_leaves, strict=True))


def test_a_flat_dict_of_non_arrays_is_flattened_by_optree_every_time():
    """Only array values take the keys' path: ``None`` and a deque may have been leaves of an
    earlier flatten under ``is_leaf`` (a spec tree's), but here they are an empty subtree and a
    node."""
    import collections

    flatten({"k": torch.zeros(1), "q": np.zeros(1)})  # records the keys ("k", "q")
    as_leaves = lambda x: x is None or isinstance(x, collections.deque)  # noqa: E731
    assert len(flatten({"k": None, "q": collections.deque([1])}, is_leaf=as_leaves)[0]) == 2
    leaves, spec = flatten({"k": None, "q": collections.deque([1, 2])})
    assert leaves == [1, 2]
    assert str(spec) == "PyTreeSpec({'k': None, 'q': deque([*, *])})"


def test_a_flat_dict_keeps_its_key_order_and_its_values():
    a = {"b": torch.zeros(1), "a": np.ones(1)}
    flatten(a)
    b = {"b": np.full(1, 2.0), "a": torch.ones(1)}  # same keys, other values and types
    leaves, spec = flatten(b)
    assert leaves[0] is b["a"] and leaves[1] is b["b"]  # optree's order: sorted keys
    assert list(unflatten(spec, leaves)) == ["b", "a"]  # the dict's own order back
    c = {"a": torch.ones(1), "b": np.ones(1)}  # same keys, other insertion order
    assert list(unflatten(*reversed(flatten(c)))) == ["a", "b"]
