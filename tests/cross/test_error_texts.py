"""Golden error texts for every bad input the issue lists: the whole message, exactly.

Each message names the argument and leaf path as code, the rule, what was expected and what
was found, and the fix where there is one. Exception types are ValueError/TypeError subclasses.
"""

import re

import numpy as np
import pytest

import torchshard as ts
from torchshard.testing import host_to_global_array_per_host, virtual_hosts

NO_MESH = (
    "{} must be called inside `with mesh:`, but there is no current mesh in this thread. Create "
    "one with torchshard.create_device_mesh(...) and enter it."
)
DTYPES = (
    "bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, complex64, "
    "complex128"
)


def _exactly(message):
    return f"^{re.escape(message)}$"


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ts.host_to_global_array({"x": np.zeros(8)}), "host_to_global_array"),
        (lambda: ts.host_to_global_specs({"x": np.zeros(8)}), "host_to_global_specs"),
        (lambda: ts.input_partition_spec(), "input_partition_spec()"),
        (
            lambda: ts.data_partition_type_to_spec(ts.DataPartitionType.BATCH),
            "data_partition_type_to_spec(BATCH)",
        ),
    ],
)
def test_no_current_mesh(call, name):
    with pytest.raises(ts.errors.NoMeshError, match=_exactly(NO_MESH.format(name))):
        call()
    assert issubclass(ts.errors.NoMeshError, ValueError)


CASES = {
    "spec longer than rank": (
        lambda: ts.host_to_global_array({"a": [np.zeros(8)]}, partition=ts.P("data", "model")),
        ts.ShardingError,
        (
            "host_arrays['a'][0]: partition spec P('data', 'model') has 2 entries but the array "
            "has rank 1; a spec may not be longer than the rank of the array it shards."
        ),
    ),
    "axis not in mesh": (
        lambda: ts.host_to_global_array({"a": np.zeros((8, 2))}, partition={"a": ts.P("batch")}),
        ts.ShardingError,
        (
            "host_arrays['a']: partition spec P('batch',) names mesh axis 'batch', which is not an "
            "axis of the mesh; expected one of ('data', 'model')."
        ),
    ),
    "indivisible dim": (
        lambda: ts.host_to_global_array({"x": np.zeros((6, 3))}, partition=ts.P("data")),
        ts.errors.IndivisibleError,
        (
            "host_arrays['x']: dim 0 has size 6, not divisible by 4 (axes ('data',) of "
            "P('data',) on mesh {'data': 4, 'model': 2}); global shape (6, 3). Pad the batch to "
            "a multiple, or use torchshard.InputDispatcher to pad and drop the padding in the "
            "step."
        ),
    ),
    "indivisible minor dim": (
        lambda: ts.host_to_global_array({"x": np.zeros((8, 3))}, partition=ts.P(None, "model")),
        ts.errors.IndivisibleError,
        (
            "host_arrays['x']: dim 1 has size 3, not divisible by 2 (axes ('model',) of "
            "P(None, 'model') on mesh {'data': 4, 'model': 2}); global shape (8, 3). Pad the "
            "batch to a multiple, or use torchshard.InputDispatcher to pad and drop the padding "
            "in the step."
        ),
    ),
    "FULL batch sizes disagree": (
        lambda: ts.host_to_global_array({"ids": np.zeros((8, 4)), "mask": [np.zeros(16)]}),
        ts.ShardingError,
        (
            "host_arrays['mask'][0]: under DataPartitionType.FULL every leaf is a per-host batch "
            "split along dim 0, so all leaves must have the same batch size; expected 8 (the "
            "size of host_arrays['ids']), got 16 (shape (16,))."
        ),
    ),
    "string array": (
        lambda: ts.host_to_global_array({"s": np.array(["a"] * 8)}),
        TypeError,
        (
            f"host_arrays['s']: numpy dtype <U1 is not supported; expected one of {DTYPES} "
            "(bfloat16 as a torch.Tensor). Strings and objects must be encoded as numbers on the "
            "host."
        ),
    ),
    "object array": (
        lambda: ts.host_to_global_array({"o": [np.array([None] * 8)]}),
        TypeError,
        (
            f"host_arrays['o'][0]: numpy dtype object is not supported; expected one of {DTYPES} "
            "(bfloat16 as a torch.Tensor). Strings and objects must be encoded as numbers on the "
            "host."
        ),
    ),
    "python scalar leaf": (
        lambda: ts.host_to_global_array({"n": 3}),
        TypeError,
        (
            "host_arrays['n']: expected a numpy array or a CPU torch.Tensor, but got int (3). Wrap "
            "Python numbers with np.asarray(...) or torch.tensor(...)."
        ),
    ),
    "spec tree not a prefix": (
        lambda: ts.host_to_global_array(
            {"x": np.zeros(8), "y": [np.zeros(8), np.zeros(8)]},
            partition={"x": ts.P("data"), "y": [ts.P("data")]},
        ),
        ts.errors.TreeStructureError,
        (
            "partition['y'] must be a tree prefix of host_arrays['y'], but it is a list of 1 "
            "where host_arrays['y'] is a list of 2; give one spec per element, in a list, or one "
            "spec for the whole list."
        ),
    ),
    "unsupported partition": (
        lambda: ts.host_to_global_array({"x": np.zeros(8)}, partition="data"),
        ts.errors.UnsupportedPartitionError,
        (
            "partition: Unsupported partition: data (of type str); expected a PartitionSpec "
            "(e.g. P('data')), a DataPartitionType, None (replicated), or a tree prefix of the "
            "data (dicts, lists, tuples, namedtuples, dataclasses) whose leaves are those. To "
            "split dim 0 over the mesh axis 'data', write P('data')."
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(mesh42, monkeypatch, case):
    call, error, message = CASES[case]
    from torchshard._backend.registry import lookup

    transfers = []
    monkeypatch.setattr(lookup(mesh42).place, "make_global", lambda *a: transfers.append(a))
    with pytest.raises(error, match=_exactly(message)):
        call()
    assert transfers == []
    assert issubclass(error, (ValueError, TypeError))


def test_axis_used_twice():
    with pytest.raises(
        ValueError,
        match=_exactly(
            "PartitionSpec ('data', 'data') uses mesh axis 'data' twice (entries 0 and 1); each "
            "axis may split at most one dimension."
        ),
    ):
        ts.P("data", "data")


@pytest.mark.xla
def test_mesh_over_fewer_devices_than_the_runtime():
    with pytest.raises(
        ts.ShardingError,
        match=_exactly(
            "mesh Mesh({'data': 2, 'model': 2}) covers devices [0, 1, 2, 3], but the runtime has "
            "8 devices (ids 0..7); a mesh must cover every device exactly once."
        ),
    ):
        with ts.Mesh(np.arange(4).reshape(2, 2), ("data", "model")):
            pass


PER_HOST = {
    "wrong length": (
        [{"x": np.zeros(4)}] * 3,
        ts.ShardingError,
        "per_host_arrays: expected one tree per host, 2 in all, but got 3.",
    ),
    "shapes disagree": (
        [{"x": np.zeros((4, 2))}, {"x": np.zeros((4, 3))}],
        ts.ShardingError,
        (
            "per_host_arrays[1]['x']: every host must pass the same shape and dtype for a leaf; "
            "expected (4, 2) torch.float64 (host 0), got (4, 3) torch.float64. Hosts whose parts "
            "differ in size pass global_shape=: each host then passes its own part, or the whole "
            "dimension."
        ),
    ),
    "dtypes disagree": (
        [{"x": np.zeros(4, np.int32)}, {"x": np.zeros(4, np.int64)}],
        ts.ShardingError,
        (
            "per_host_arrays[1]['x']: every host must pass the same shape and dtype for a leaf; "
            "expected (4,) torch.int32 (host 0), got (4,) torch.int64."
        ),
    ),
    "structures disagree": (
        [{"x": np.zeros(4)}, {"x": np.zeros(4), "y": np.zeros(4)}],
        ts.errors.TreeStructureError,
        (
            "per_host_arrays[1] has a different structure from per_host_arrays[0]: expected "
            "PyTreeSpec({'x': *}), got PyTreeSpec({'x': *, 'y': *})."
        ),
    ),
    "bad leaf on one host": (
        [{"x": np.zeros(4)}, {"x": np.array(["a"] * 4)}],
        TypeError,
        (
            f"per_host_arrays[1]['x']: numpy dtype <U1 is not supported; expected one of {DTYPES} "
            "(bfloat16 as a torch.Tensor). Strings and objects must be encoded as numbers on the "
            "host."
        ),
    ),
}


@pytest.mark.parametrize("case", list(PER_HOST))
def test_bad_per_host_input(mesh42, monkeypatch, case):
    per_host, error, message = PER_HOST[case]
    from torchshard._backend.registry import lookup

    transfers = []
    monkeypatch.setattr(lookup(mesh42).place, "make_global", lambda *a: transfers.append(a))
    with virtual_hosts(2), pytest.raises(error, match=_exactly(message)):
        host_to_global_array_per_host(per_host)
    assert transfers == []


@pytest.mark.xla
def test_non_uniform_layout():
    mesh = ts.Mesh(np.array([0, 1, 2, 4, 3, 5, 6, 7]).reshape(2, 4), ("a", "b"))
    with (
        virtual_hosts(4),
        mesh,
        pytest.raises(
            ts.errors.NonUniformShardingError,
            match=_exactly(
                "per_host_arrays[0]['x']: dim 0 is not process-uniform under P('a',) on "
                "Mesh({'a': 2, 'b': 4}, devices=[0, 1, 2, 4, 3, 5, 6, 7]): the hosts hold the "
                "shard sets {0: (0,), 1: (0, 1), 2: (0, 1), 3: (1,)} along it, which are not "
                "equal, disjoint groups, so no global shape has one block per host. Choose a spec "
                "or a mesh device order that follows host boundaries, or give global_shape (as in "
                "JAX: each host then passes its own part, whose size may differ from host to host, "
                "or the whole dimension)."
            ),
        ),
    ):
        host_to_global_array_per_host([{"x": np.zeros((2, 2))}] * 4, partition=ts.P("a"))
