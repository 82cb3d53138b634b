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


def test_paths_of_a_tuple_of_named_parts():
    """The loader places a batch and its mask as one tuple: each part is named on its own."""
    _, spec = flatten(({"x": 1, "y": [2]}, {"x": 3}))
    assert paths(spec, "ignored", ("batch", "mask")) == ["batch['x']", "batch['y'][0]", "mask['x']"]
    assert LazyPaths(spec, "ignored", ("b", "m"))[2] == "m['x']"


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


# -- prefixes are matched by key, whatever order each dict flavour keeps --

_FLAVOURS = {
    "dict": dict,
    "OrderedDict": collections.OrderedDict,
    "defaultdict": lambda items: collections.defaultdict(list, items),
}


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=5, unique=True),
    data_order=st.randoms(use_true_random=False),
    prefix_order=st.randoms(use_true_random=False),
    data_flavour=st.sampled_from(sorted(_FLAVOURS)),
    prefix_flavour=st.sampled_from(sorted(_FLAVOURS)),
)
def test_a_prefix_dict_is_matched_by_key_in_every_flavour_and_order(
    keys, data_order, prefix_order, data_flavour, prefix_flavour
):
    """An OrderedDict of data with a plain-dict partition (or any mix of dict, OrderedDict and
    defaultdict, in any insertion order) gives each key its own spec: optree orders a dict's
    keys sorted and an OrderedDict's as inserted, so matching by position swapped them."""
    data_keys, prefix_keys = list(keys), list(keys)
    data_order.shuffle(data_keys)
    prefix_order.shuffle(prefix_keys)
    data = _FLAVOURS[data_flavour]([(k, [k + "0", k + "1"]) for k in data_keys])
    prefix = _FLAVOURS[prefix_flavour]([(k, ts.P(k)) for k in prefix_keys])
    leaves, spec = flatten(data)
    got = broadcast_prefix(
        prefix, data, is_prefix_leaf=_is_spec, prefix_name="partition", full_name="host_arrays"
    )
    assert [s[0] for s in got] == [leaf[0] for leaf in leaves]  # each leaf: its own key's spec
    back = unflatten(spec, got)
    assert type(back) is type(data) and list(back) == data_keys
    assert all(back[k] == [ts.P(k), ts.P(k)] for k in keys)


def test_a_nested_prefix_is_matched_by_key_at_every_level():
    data = collections.OrderedDict(
        z={"b": 1, "a": collections.OrderedDict(q=2, p=3)}, y=collections.OrderedDict(d=4, c=5)
    )
    prefix = {
        "y": ts.P("y"),
        "z": collections.OrderedDict(a={"p": ts.P("p"), "q": None}, b=ts.P("b")),
    }
    got = broadcast_prefix(
        prefix, data, is_prefix_leaf=_is_spec, prefix_name="partition", full_name="host_arrays"
    )
    spec = flatten(data)[1]
    assert unflatten(spec, got) == collections.OrderedDict(
        z={"b": ts.P("b"), "a": collections.OrderedDict(q=None, p=ts.P("p"))},
        y=collections.OrderedDict(d=ts.P("y"), c=ts.P("y")),
    )


# -- the flat-dict memo: keys that compare equal are not the same key --


@pytest.mark.parametrize(
    ("first", "second"),
    [(1, True), (True, 1), (2, 2.0), (0, False), ("a", np.str_("a"))],
    ids=["1-True", "True-1", "2-2.0", "0-False", "str-np.str_"],
)
def test_a_flat_dict_keeps_its_own_keys(first, second, monkeypatch):
    """A dict keyed ``True`` after one keyed ``1`` (``2.0`` after ``2``, ``np.str_`` after
    ``str``) comes back with its own key and key type, not the remembered one."""
    from torchshard._core import tree

    monkeypatch.setattr(tree, "_FLAT_DICTS", {})  # nothing remembered from other tests
    flatten({first: np.zeros(1)})
    flatten({first: np.zeros(1)})  # remembered, if it may be
    leaves, spec = flatten({second: np.ones(1)})
    back = unflatten(spec, leaves)
    (key,) = back
    assert key == second and type(key) is type(second)
    assert spec == optree_structure({second: 0})


def optree_structure(tree):
    import optree

    return optree.tree_structure(tree, none_is_leaf=False, namespace=NAMESPACE)


# -- dataclass fields with init=False --


@dataclasses.dataclass
class Late:
    x: object
    y: object = dataclasses.field(init=False, default=None)


@dataclasses.dataclass(frozen=True)
class Derived:
    x: object
    n: object = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "n", [self.x])


@dataclasses.dataclass
class Unset:
    x: object
    y: object = dataclasses.field(init=False)


def test_dataclass_fields_with_init_false_are_children():
    """A field set after construction is a leaf of the tree and is set again on the rebuilt
    node (it was dropped: the rebuilt node had its default, ``None``)."""
    late = Late(1)
    late.y = 2
    leaves, spec = flatten(late)
    assert leaves == [1, 2]
    back = unflatten(spec, [10, 20])
    assert type(back) is Late and (back.x, back.y) == (10, 20)
    assert paths(spec, "t") == ["t.x", "t.y"]
    # frozen, set in __post_init__: the leaf's new value wins over the recomputed one
    leaves, spec = flatten(Derived(3))
    assert leaves == [3, 3]
    back = unflatten(spec, [5, 6])
    assert back.x == 5 and back.n == [6]
    # never set: not a child, and still unset after the round trip
    leaves, spec = flatten(Unset(7))
    assert leaves == [7]
    back = unflatten(spec, [8])
    assert back.x == 8 and not hasattr(back, "y")


# -- trees optree cannot flatten: cycles and nesting past its limit --


def test_a_cyclic_tree_is_named_with_the_cycle():
    tree = [np.zeros(1), {"a": [np.ones(1)]}]
    tree[1]["a"].append(tree[1])
    with pytest.raises(
        ts.errors.TreeStructureError,
        match=re.escape(
            "host_arrays contains itself: host_arrays[1]['a'][1] is host_arrays[1] (a cycle), "
            "and a tree must be acyclic. Pass a tree without the back reference."
        ),
    ):
        flatten(tree, name="host_arrays")


def test_a_tree_nested_past_optrees_limit_is_named():
    import optree

    tree = {}
    inner = tree
    for _ in range(5000):
        inner["k"] = {}
        inner = inner["k"]
    inner["k"] = np.zeros(1)
    limit = optree.MAX_RECURSION_DEPTH
    with pytest.raises(
        ts.errors.TreeStructureError,
        match=re.escape(
            f"host_arrays is nested more than {limit} levels deep (at "
            f"host_arrays['k']['k']['k']..., {limit} levels), deeper than optree flattens "
            f"({limit} levels). Flatten the structure (e.g. a list or a dict of leaves) before "
            "passing it."
        ),
    ):
        flatten(tree, name="host_arrays")


def test_a_leaf_path_is_computed_when_an_error_formats_it(monkeypatch):
    from torchshard._core import tree
    from torchshard._core.errors import at

    built = []
    real = tree.paths
    monkeypatch.setattr(
        tree, "paths", lambda spec, name, *parts: built.append(name) or real(spec, name, *parts)
    )
    lazy = tree.LazyPaths(tree.flatten({"a": [1, 2]})[1], "x")
    where = lazy.at(1)
    assert built == []  # taken, not read
    assert at(where, "bad") == "x['a'][1]: bad"
    assert (str(where), f"{where}", repr(where)) == ("x['a'][1]", "x['a'][1]", "\"x['a'][1]\"")
    assert built == ["x"]  # once for every leaf of the tree
