"""torchshard.Mesh, the core's mesh value bound to its backend: torch_xla's meshes both ways
(torchshard._mesh.mesh)."""

import re

import numpy as np
import pytest

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla.distributed.spmd as xs

import torchshard as ts


def _xla_mesh_tuple(m):
    return (
        None
        if m is None
        else (tuple(np.asarray(m.device_ids).tolist()), tuple(m.mesh_shape), tuple(m.axis_names))
    )


def test_xla_mesh_round_trip():
    mesh = ts.Mesh(np.array([3, 1, 0, 2, 7, 5, 6, 4]).reshape(2, 4), ("data", "model"))
    xm = mesh.xla_mesh
    assert isinstance(xm, xs.Mesh)
    assert _xla_mesh_tuple(xm) == ((3, 1, 0, 2, 7, 5, 6, 4), (2, 4), ("data", "model"))
    assert mesh.xla_mesh is xm  # cached
    assert ts.Mesh.from_xla(xm) == mesh
    native = xs.Mesh(np.arange(8), (2, 2, 2), ("x", "y", "z"))
    back = ts.Mesh.from_xla(native)
    assert dict(back.shape) == {"x": 2, "y": 2, "z": 2}
    assert back.device_ids == tuple(range(8))


def test_from_xla_needs_axis_names():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "Mesh.from_xla: the torch_xla mesh has no axis_names; torchshard specs name mesh "
            "axes, so build it with xs.Mesh(device_ids, mesh_shape, axis_names=(...))."
        ),
    ):
        ts.Mesh.from_xla(xs.Mesh(np.arange(8), (8,)))


def test_unknown_backend():
    with pytest.raises(
        ValueError,
        match=re.escape("Mesh backend must be 'xla', 'dtensor' or 'torchax', but got 'tpu'."),
    ):
        ts.Mesh(np.arange(8), ("a",), backend="tpu")


def test_of_binds_a_bare_value_and_keeps_a_bound_mesh():
    from torchshard._core.mesh import Mesh as Value

    bare = Value(np.arange(8).reshape(4, 2), ("data", "model"))
    bound = ts.Mesh.of(bare)
    assert type(bound) is ts.Mesh and bound == bare
    assert bound.devices.tolist() == bare.devices.tolist() and bound.backend == "xla"
    assert ts.Mesh.of(bound) is bound
    with bound:  # a bound mesh enters as a context
        assert ts.current_mesh() is bound


def test_a_bound_mesh_asks_its_backend_for_the_topology():
    from torchshard._core.mesh import topology_of

    topology = topology_of(ts.Mesh(np.arange(8), ("data",)))
    assert (topology.process_index, topology.process_count) == (0, 1)
    assert topology.device_process == (0,) * 8 and not topology.virtual
