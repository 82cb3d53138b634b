"""Validation before anything moves (torchshard._place.validate): the spec of each leaf (a
partition broadcast as a prefix), the hosts' trees and leaves agreeing, FULL batch agreement,
given global shapes, the backend's local devices belonging to this process; a bad leaf anywhere
means nothing is transferred. Errors name the leaf's path."""

import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.topology import Topology
from torchshard._place import validate
from torchshard._place.call import read

FOUR = Topology(0, 4, (0, 0, 1, 1, 2, 2, 3, 3), virtual=True, data_hosts=(0, 1, 2, 3))


@pytest.mark.xla
def test_spec_tree_of_the_default_is_full():
    with ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model")):
        assert validate.spec_tree_of(DEFAULT_PARTITION) == (ts.P(("data", "model")), True)
        assert validate.spec_tree_of(ts.DataPartitionType.FULL)[1] is True
    assert validate.spec_tree_of(ts.P("x")) == (ts.P("x"), False)
    assert validate.spec_tree_of(None) == (None, False)  # replicated (specs_for says so)
    assert validate.spec_tree_of(ts.DataPartitionType.REPLICATED) == (ts.P(None), False)
    assert validate.spec_tree_of({"a": None}) == ({"a": None}, False)


def test_specs_for_broadcasts_a_prefix_and_none_replicates():
    tree = {"a": 1, "b": {"c": 2, "d": [3, 4]}}
    assert validate.specs_for(ts.P("x"), tree, 4, "host_arrays") == [ts.P("x")] * 4
    assert validate.specs_for(None, tree, 4, "host_arrays") == [ts.P()] * 4
    specs = validate.specs_for(
        {"a": ts.P("x"), "b": {"c": None, "d": ts.P(None, "y")}}, tree, 4, "host_arrays"
    )
    assert specs == [ts.P("x"), ts.P(), ts.P(None, "y"), ts.P(None, "y")]
    with pytest.raises(ts.errors.TreeStructureError, match=re.escape("partition")):
        validate.specs_for({"a": ts.P("x"), "z": None}, tree, 4, "host_arrays")


def test_check_full_batch_needs_one_batch_size():
    validate.check_full_batch(["a", "b"], [(8, 2), (8,)])
    validate.check_full_batch(["s", "a", "b"], [(), (4,), (4, 1)])  # 0-d leaves carry no batch
    validate.check_full_batch([], [])
    with pytest.raises(
        ts.ShardingError,
        match="^"
        + re.escape(
            "host_arrays['y']: under DataPartitionType.FULL every leaf is a per-host batch split "
            "along dim 0, so all leaves must have the same batch size; expected 8 (the size of "
            "host_arrays['x']), got 6 (shape (6, 3))."
        )
        + "$",
    ):
        validate.check_full_batch(
            ["host_arrays['s']", "host_arrays['x']", "host_arrays['y']"], [(), (8,), (6, 3)]
        )


def test_check_local_owner_refuses_another_processes_devices():
    validate.check_local_owner(Topology(0, 2, (0, 0, 1, 1)), (0, 1))
    validate.check_local_owner(FOUR, tuple(range(8)))  # virtual hosts: every host's data here
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "the backend's local devices (0, 1, 2) belong to processes [0, 1], not to this "
            "process (0)."
        ),
    ):
        validate.check_local_owner(Topology(0, 2, (0, 0, 1, 1)), (0, 1, 2))


def test_global_shapes_one_shape_or_a_prefix_tree():
    tree = {"a": 1, "b": [2, 3]}
    paths = ["host_arrays['a']", "host_arrays['b'][0]", "host_arrays['b'][1]"]
    assert validate.global_shapes(None, tree, 3, "host_arrays", paths) == [None] * 3
    assert validate.global_shapes((8, np.int64(2)), tree, 3, "host_arrays", paths) == [(8, 2)] * 3
    assert validate.global_shapes(torch.Size([4]), tree, 3, "host_arrays", paths) == [(4,)] * 3
    got = validate.global_shapes({"a": (16,), "b": None}, tree, 3, "host_arrays", paths)
    assert got == [(16,), None, None]
    with pytest.raises(
        TypeError,
        match=re.escape(
            "global_shape: expected a shape (a tuple of ints), or a tree of them (and None) "
            "matching host_arrays, but got int 8."
        ),
    ):
        validate.global_shapes(8, tree, 3, "host_arrays", paths)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "host_arrays['a']: global_shape: every size of a shape must be >= 0, but dim 0 of "
            "(-1,) is -1."
        ),
    ):
        validate.global_shapes({"a": (-1,), "b": None}, tree, 3, "host_arrays", paths)


@pytest.mark.parametrize(
    ("given", "where", "found"),
    [
        (
            (True, 2),
            "global_shape",
            (
                "dim 0 of (True, 2) is True of type bool (a bool is not a size); pass (1, 2) if "
                "that is the shape meant."
            ),
        ),
        (
            (8, 2.0),
            "global_shape",
            (
                "dim 1 of (8, 2.0) is 2.0 of type float (sizes count elements: nothing is "
                "rounded); pass (8, 2) if that is the shape meant."
            ),
        ),
        (
            (8, "2"),
            "global_shape",
            (
                "dim 1 of (8, '2') is '2' of type str (sizes count elements: nothing is "
                "converted); pass one int per dimension."
            ),
        ),
        (
            [8, None],
            "global_shape",
            (
                "dim 1 of (8, None) is None of type NoneType (sizes count elements: nothing is "
                "converted); pass one int per dimension."
            ),
        ),
        (
            {"x": (8, 2.5), "y": None},
            "host_arrays['x']: global_shape",
            (
                "dim 1 of (8, 2.5) is 2.5 of type float (sizes count elements: nothing is "
                "rounded); pass one int per dimension."
            ),
        ),
    ],
    ids=["bool", "float", "str", "None", "in-a-tree"],
)
def test_a_bad_size_in_global_shape_is_named(mesh8, given, where, found):
    """Before: a shape with a bool, float, str or None entry was not recognised as a shape, so
    it was taken for a subtree: a ``TreeStructureError`` ("global_shape must be a tree prefix
    of host_arrays, but it is not"), naming neither the entry nor the fix."""
    data = {"x": np.zeros((8, 2), np.float32), "y": np.zeros(8, np.int64)}
    message = f"{where}: every size of a shape must be an int, but {found}"
    with mesh8, pytest.raises(TypeError, match=re.escape(message)):
        ts.host_to_global_array(data, partition=ts.P("data"), global_shape=given)
    specs = message.replace("host_arrays", "host_specs")
    with mesh8, pytest.raises(TypeError, match=re.escape(specs)):
        ts.host_to_global_specs(data, partition=ts.P("data"), global_shape=given)


def test_every_host_needs_the_first_hosts_structure():
    trees = [{"x": np.zeros(2)}] * 3 + [{"y": np.zeros(2)}]
    call = read(trees, FOUR, ts.P(), per_host=True)
    with pytest.raises(
        ts.errors.TreeStructureError,
        match=re.escape("per_host_arrays[3] has a different structure from per_host_arrays[0]:"),
    ):
        validate.check_host_structures(call)


def test_every_host_needs_the_first_hosts_shapes_and_dtypes():
    trees = [{"x": torch.zeros(2, 3)}] * 2 + [{"x": torch.zeros(2, 3, dtype=torch.int32)}] * 2
    call = read(trees, FOUR, ts.P(), per_host=True)
    tensors = [[t["x"]] for t in trees]
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "per_host_arrays[2]['x']: every host must pass the same shape and dtype for a leaf; "
            "expected (2, 3) torch.float32 (host 0), got (2, 3) torch.int32."
        ),
    ):
        validate.check_host_leaves(call, tensors, frozenset())
    validate.check_host_leaves(call, tensors, frozenset({0}))  # an already-global leaf: skipped


def test_hosts_may_pass_blocks_of_different_shapes_under_a_given_global_shape():
    """As in JAX: with the leaf's global shape given, each host passes its own part (whose
    size may differ) or the whole dimension; the dtype stays one. The leaves whose shapes
    differ are returned (planned host by host)."""
    trees = [{"x": torch.zeros(2, 3), "y": torch.zeros(4)}] + [
        {"x": torch.zeros(4, 3), "y": torch.zeros(4)}
    ] * 3
    call = read(trees, FOUR, ts.P(), per_host=True, global_shape={"x": (8, 3), "y": None})
    tensors = [[t["x"], t["y"]] for t in trees]
    assert validate.check_host_leaves(call, tensors, frozenset(), [(8, 3), None]) == {0}
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "per_host_arrays[1]['x']: every host must pass the same shape and dtype for a leaf; "
            "expected (2, 3) torch.float32 (host 0), got (4, 3) torch.float32. Hosts whose parts "
            "differ in size pass global_shape=: each host then passes its own part, or the whole "
            "dimension."
        ),
    ):
        validate.check_host_leaves(call, tensors, frozenset(), [None, None])
    tensors[2][0] = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(ts.ShardingError, match=re.escape("got (4, 3) torch.int32.")):
        validate.check_host_leaves(call, tensors, frozenset(), [(8, 3), None])


@pytest.mark.xla
def test_validated_plan_plans_every_leaf(mesh42):
    from torchshard._mesh.context import current_topology

    topology = current_topology(mesh42)
    call = read([{"x": np.zeros((8, 4)), "y": np.zeros(8)}], topology, ts.P("data"), per_host=False)
    planned = validate.validated_plan(mesh42, lookup(mesh42), topology, call)
    assert [p.global_shape for p in planned.plans] == [(8, 4), (8,)]
    assert [p.local_shape for p in planned.plans] == [(8, 4), (8,)]
    assert planned.slot == {0: 0} and planned.shared == () and planned.bound is None
    assert [tuple(t.shape) for t in call.tensors[0]] == [(8, 4), (8,)]  # converted once


@pytest.mark.xla
def test_plan_leaf_prefixes_the_path(mesh42):
    from torchshard._mesh.context import current_topology

    with pytest.raises(
        ts.errors.IndivisibleError,
        match=re.escape("host_arrays['x']: dim 0 has size 6, not divisible by 4"),
    ):
        validate.plan_leaf(
            mesh42,
            lookup(mesh42),
            ts.P("data"),
            (6,),
            None,
            current_topology(mesh42),
            (),
            "host_arrays['x']",
        )


@pytest.mark.parametrize(
    ("tree", "partition", "error"),
    [
        ({"a": np.zeros(8), "b": np.zeros(6)}, ts.P("data"), ts.errors.IndivisibleError),
        ({"a": np.zeros(8), "b": np.array(["s"] * 8)}, ts.P("data"), TypeError),
        (
            {"a": np.zeros(8), "b": np.zeros(8)},
            {"a": ts.P("data"), "c": None},
            ts.errors.TreeStructureError,
        ),
        ({"a": np.zeros(8), "b": np.zeros(4)}, None, None),  # FULL: batch sizes disagree
        (
            {"a": np.zeros(8), "b": np.zeros(8)},
            {"a": ts.P(), "b": ts.P("data", "x")},
            ts.ShardingError,
        ),
    ],
)
def test_nothing_is_transferred_when_any_leaf_is_bad(mesh42, monkeypatch, tree, partition, error):
    backend = lookup(ts.current_mesh())
    calls = []
    monkeypatch.setattr(backend.place, "make_global", lambda *a: calls.append(a))
    kwargs = {} if error is None else {"partition": partition}
    with pytest.raises(error or ts.ShardingError):
        ts.host_to_global_array(tree, **kwargs)
    assert calls == []


@pytest.mark.xla
def test_float64_on_a_torch_xla_mesh_warns_once_naming_the_leaf(monkeypatch):
    from torchshard._place import cache

    cache.clear()  # the check runs when a call is planned
    monkeypatch.setattr(validate, "_warned_float64", False)
    message = (
        "host_arrays['y']: torch.float64 data on a torch_xla mesh; TPUs have no 64-bit floats, "
        "so torch_xla emulates them slowly or computes in float32. Cast on the host "
        "(x.astype(np.float32), or x.to(torch.float32)) unless 64 bits are meant; then filter "
        "this warning: warnings.filterwarnings('ignore', "
        "category=torchshard.errors.Float64Warning). Warned once per process."
    )
    batch = {"x": np.zeros((8, 2), np.float32), "y": np.zeros((8, 2), np.float64)}
    with ts.Mesh(np.arange(8), ("data",)):
        with pytest.warns(ts.errors.Float64Warning, match=re.escape(message)) as record:
            ts.host_to_global_array(batch)
            ts.host_to_global_array({"z": np.zeros(8)})  # once per process
        assert len(record) == 1
    assert issubclass(ts.errors.Float64Warning, UserWarning)


@pytest.mark.xla
def test_float32_and_narrower_do_not_warn(monkeypatch):
    import warnings

    monkeypatch.setattr(validate, "_warned_float64", False)
    with ts.Mesh(np.arange(8), ("data",)), warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.host_to_global_array({"x": np.zeros(8, np.float32), "i": np.zeros(8, np.int64)})
    assert validate._warned_float64 is False
