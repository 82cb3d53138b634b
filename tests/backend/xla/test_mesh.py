"""torch_xla's own meshes (torchshard._backend.xla.mesh): a mesh value as an ``xs.Mesh`` and
back, the check that it covers the runtime's devices, and torch_xla's global mesh
(``XlaMeshes``)."""

import re

import numpy as np
import pytest

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla.distributed.spmd as xs

import torchshard as ts
from torchshard._backend.xla import mesh as xla_mesh
from torchshard._core.mesh import Mesh

pytestmark = pytest.mark.xla


def _as_tuple(m):
    return tuple(np.asarray(m.device_ids).tolist()), tuple(m.mesh_shape), tuple(m.axis_names)


@pytest.mark.parametrize(
    ("ids", "names"),
    [
        (np.arange(8), ("data",)),
        (np.arange(8).reshape(4, 2), ("data", "model")),
        (np.array([3, 1, 0, 2, 7, 5, 6, 4]).reshape(2, 2, 2), ("a", "b", "c")),
    ],
)
def test_round_trip(ids, names):
    value = Mesh(ids, names)
    native = xla_mesh.to_xla_mesh(value)
    assert isinstance(native, xs.Mesh)
    assert _as_tuple(native) == (tuple(ids.reshape(-1).tolist()), ids.shape, names)
    back = xla_mesh.mesh_from_xla(native)
    assert type(back) is Mesh and back == value and back.backend == "xla"
    assert xla_mesh.to_xla_mesh(value) is native  # cached per mesh value


def test_a_native_mesh_without_axis_names_is_refused():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "Mesh.from_xla: the torch_xla mesh has no axis_names; torchshard specs name mesh "
            "axes, so build it with xs.Mesh(device_ids, mesh_shape, axis_names=(...))."
        ),
    ):
        xla_mesh.mesh_from_xla(xs.Mesh(np.arange(8), (8,)))


def test_a_mesh_must_cover_the_runtimes_devices():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "mesh Mesh({'data': 4}) covers devices [0, 1, 2, 3], but the runtime has 8 devices "
            "(ids 0..7); a mesh must cover every device exactly once."
        ),
    ):
        xla_mesh.to_xla_mesh(Mesh(np.arange(4), ("data",)))


def test_meshes_create_and_make_current():
    meshes = xla_mesh.XlaMeshes()
    grid = np.arange(8).reshape(2, 4)
    created = meshes.create(grid, ("x", "y"))
    assert created == Mesh(grid, ("x", "y")) and created.backend == "xla"
    assert meshes.native(created) is xla_mesh.to_xla_mesh(created)
    assert meshes.from_native(meshes.native(created)) == created
    assert xs.get_global_mesh() is None
    try:
        meshes.make_current(created)
        assert _as_tuple(xs.get_global_mesh()) == (tuple(range(8)), (2, 4), ("x", "y"))
    finally:
        meshes.make_current(None)
    assert xs.get_global_mesh() is None
