"""The host trees of one call (torchshard._place.call): ``read`` takes one tree per host this
process supplies and says so when the count is wrong; ``HostCall`` flattens them and names
their leaves after the argument; ``CallPlan`` holds the plans, unbound until placed twice."""

import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._core.topology import Topology
from torchshard._core.tree import structure
from torchshard._place.call import CallPlan, HostCall, read

ONE = Topology(0, 1, (0,) * 8)
FOUR = Topology(0, 4, (0, 0, 1, 1, 2, 2, 3, 3), virtual=True, data_hosts=(0, 1, 2, 3))


def _tree(k=0):
    return {"x": np.full((2, 3), k, np.float32), "y": [torch.zeros(2, dtype=torch.int8), None]}


def test_read_flattens_one_tree_per_host():
    call = read([_tree()], ONE, ts.P("data"), per_host=False)
    assert isinstance(call, HostCall)
    assert call.partition == ts.P("data") and call.global_shape is None and not call.per_host
    assert [type(x) for x in call.leaves[0]] == [np.ndarray, torch.Tensor]
    assert call.treespec == structure(_tree()) and call.treespecs == (call.treespec,)
    assert call.tensors is None  # set by validation
    trees = [_tree(h) for h in range(4)]
    call = read(trees, FOUR, None, per_host=True, global_shape=(8, 3))
    assert call.trees is trees and len(call.leaves) == 4 and call.global_shape == (8, 3)
    assert [float(leaves[0][0, 0]) for leaves in call.leaves] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("trees", "topology", "per_host", "message"),
    [
        (
            [_tree(), _tree()],
            ONE,
            False,
            "host_arrays: expected one tree per host, 1 in all, but got 2.",
        ),
        (
            [_tree()] * 3,
            FOUR,
            True,
            "per_host_arrays: expected one tree per host, 4 in all, but got 3.",
        ),
        ([], ONE, True, "per_host_arrays: expected one tree per host, 1 in all, but got 0."),
    ],
)
def test_read_needs_one_tree_per_data_host(trees, topology, per_host, message):
    with pytest.raises(ts.ShardingError, match=f"^{re.escape(message)}$"):
        read(trees, topology, ts.P(), per_host=per_host)


def test_paths_are_named_after_the_argument():
    call = read([_tree()], ONE, ts.P(), per_host=False)
    assert call.argname == "host_arrays"
    assert [call.paths[0][i] for i in range(2)] == ["host_arrays['x']", "host_arrays['y'][0]"]
    assert call.path(1) == "host_arrays['y'][0]"
    call = read([_tree(h) for h in range(4)], FOUR, ts.P(), per_host=True)
    assert call.argname == "per_host_arrays"
    assert len(call.paths) == 4
    assert call.paths[2][0] == "per_host_arrays[2]['x']"
    assert call.paths[3][1] == "per_host_arrays[3]['y'][0]"
    assert call.path(0) == "per_host_arrays[0]['x']"
    assert call.paths is call.paths  # computed once


def test_describe_lists_the_structure_partition_and_leaves():
    call = read([_tree()], ONE, ts.P("data"), per_host=False)
    lines = call.describe()
    assert lines[0] == f"structure {call.treespec}, partition P('data',)"
    assert lines[1:] == ["(2, 3) float32", "(2,) int8"]
    call = read([_tree()], ONE, ts.P("data"), per_host=False, global_shape=(4, 3))
    assert call.describe()[0].endswith(", global_shape (4, 3)")


def test_a_call_plan_starts_unbound():
    plan = CallPlan([None], {0: 0})
    assert plan.plans == [None] and plan.slot == {0: 0}
    assert plan.shared == () and plan.bound is None
