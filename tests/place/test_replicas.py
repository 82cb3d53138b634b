"""The virtual-host replica check (torchshard._place.replicas): hosts that supply the same block
of a leaf must pass equal values for it; the error names the leaf's path, the block, the
devices of each host's copy and the first global index at which they differ (NaN equals NaN).
The failure-mode cases through the public API are in tests/cross/test_failure_modes.py."""

import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._place import replicas

pytestmark = pytest.mark.xla  # the plans come from torch_xla's devices under virtual hosts

SHARED_MESH = np.array([[0, 4], [1, 5], [2, 6], [3, 7]])  # hosts 0/2 and 1/3 hold the same rows


def _planned(trees, partition, hosts, mesh):
    """The call of ``trees`` (one per virtual host), its plan and its hosts' tensors."""
    from torchshard._backend.registry import lookup
    from torchshard._mesh.context import current_topology
    from torchshard._place.call import read
    from torchshard._place.validate import validated_plan
    from torchshard.testing import virtual_hosts

    with virtual_hosts(hosts), mesh:
        topology = current_topology(mesh)
        call = read(trees, topology, partition, per_host=True)
        planned = validated_plan(mesh, lookup(mesh), topology, call)
    return call, planned, call.tensors


def test_differ_finds_the_first_unequal_index():
    a = torch.arange(12.0).reshape(3, 4)
    assert replicas._differ(a, a.clone()) is None
    b = a.clone()
    b[1, 2] = -1.0
    b[2, 0] = -1.0
    assert replicas._differ(a, b) == (1, 2)  # row-major: the first one
    i = torch.tensor([[1, 2], [3, 4]])
    assert replicas._differ(i, torch.tensor([[1, 2], [3, 5]])) == (1, 1)
    assert replicas._differ(torch.tensor(True), torch.tensor(False)) == ()


def test_differ_takes_nan_for_nan_and_zero_for_minus_zero():
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert replicas._differ(a, torch.tensor([1.0, float("nan"), -0.0])) is None
    assert replicas._differ(a, torch.tensor([1.0, 2.0, 0.0])) == (1,)
    assert replicas._differ(torch.tensor([float("nan")]), torch.tensor([1.0])) == (0,)


def test_equal_replicas_pass_and_each_shared_block_is_listed():
    mesh = ts.Mesh(SHARED_MESH, ("data", "model"))
    rows = [np.arange(8.0).reshape(4, 2), np.arange(8.0, 16.0).reshape(4, 2)]
    call, planned, hosts = _planned([{"x": rows[h % 2]} for h in range(4)], ts.P("data"), 4, mesh)
    ((leaf, spec, blocks),) = planned.shared
    assert leaf == 0 and spec == ts.P("data")
    assert [b.ranges for b in blocks] == [
        ((0, 2), (0, 2)),
        ((2, 4), (0, 2)),
        ((4, 6), (0, 2)),
        ((6, 8), (0, 2)),
    ]
    assert [[o[0] for o in b.owners] for b in blocks] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    replicas.check_shared_values(call, planned, hosts)  # equal: nothing raised


def test_unequal_replicas_name_the_global_index():
    mesh = ts.Mesh(SHARED_MESH, ("data", "model"))
    rows = [np.arange(8.0).reshape(4, 2), np.arange(8.0, 16.0).reshape(4, 2)]
    trees = [{"x": rows[h % 2].copy()} for h in range(4)]
    trees[2]["x"][3, 0] = 100.0  # host 2's rows 2:4 are the global rows 2:4 (host 0's too)
    call, planned, hosts = _planned(trees, ts.P("data"), 4, mesh)
    with pytest.raises(
        ts.ShardingError,
        match="^"
        + re.escape(
            "per_host_arrays[2]['x']: hosts 0 and 2 supply the same block [2:4, 0:2] of this leaf "
            "under P('data',) (devices [1] take host 0's values, devices [5] host 2's), so they "
            "must pass equal values for it, but they differ: at global index (3, 0) host 0 has "
            "6.0 and host 2 has 100.0. Pass the same values on every host that shares a block "
            "(every host, for a replicated leaf), or use a spec under which each host feeds its "
            "own rows (e.g. torchshard.input_partition_spec())."
        )
        + "$",
    ):
        replicas.check_shared_values(call, planned, hosts)


def test_a_replicated_leaf_is_shared_by_every_host():
    mesh = ts.Mesh(np.arange(8), ("data",))
    w = np.arange(6).reshape(3, 2)
    other = w.copy()
    other[2, 1] = 7
    call, planned, hosts = _planned([{"w": w}, {"w": other}], ts.P(), 2, mesh)
    ((_, _, (block,)),) = planned.shared
    assert block.ranges == ((0, 3), (0, 2))
    assert [(o[0], o[2]) for o in block.owners] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "per_host_arrays[1]['w']: hosts 0 and 1 supply the same block [0:3, 0:2] of this "
            "leaf under P() (devices [0, 1, 2, 3] take host 0's values, devices [4, 5, 6, 7] "
            "host 1's), so they must pass equal values for it, but they differ: at global "
            "index (2, 1) host 0 has 5 and host 1 has 7."
        ),
    ):
        replicas.check_shared_values(call, planned, hosts)


def test_hosts_feeding_their_own_rows_share_nothing():
    mesh = ts.Mesh(np.arange(8), ("data",))
    call, planned, hosts = _planned([np.zeros(4), np.ones(4)], ts.P("data"), 2, mesh)
    assert planned.shared == ()
    replicas.check_shared_values(call, planned, hosts)
