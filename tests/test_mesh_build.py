"""create_device_mesh, infer_mesh_shape, HybridMeshShape (torchshard._mesh_build)."""

import re

import numpy as np
import pytest

import torchshard as ts
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)

pytestmark = pytest.mark.xla  # every test here runs on torch_xla


def test_infer_mesh_shape_table():
    # axlearn's InferMeshShapeTest, with its exact outcomes.
    assert ts.infer_mesh_shape((4, 1, 8, 1)) == (4, 1, 8, 1)
    with pytest.raises(
        ValueError, match=re.escape("Only one axis can be -1 in mesh_shape=(-1, 1, -1, 8).")
    ):
        ts.infer_mesh_shape((-1, 1, -1, 8))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Unable to infer -1 in mesh shape (-1, 1, 8, 1) as num_devices 4 is not a multiple "
            "of the product 8 of mesh axes."
        ),
    ):
        ts.infer_mesh_shape((-1, 1, 8, 1), num_devices=4)
    assert ts.infer_mesh_shape((-1, 1, 8, 1), num_devices=32) == (4, 1, 8, 1)
    assert ts.infer_mesh_shape((4, 1, 8, -1), num_devices=32) == (4, 1, 8, 1)


def test_infer_mesh_shape_defaults_to_the_device_count():
    assert ts.infer_mesh_shape((-1, 2)) == (4, 2)
    with virtual_hosts(2):  # the emulation keeps every device
        assert ts.infer_mesh_shape((2, -1)) == (2, 4)


def test_hybrid_mesh_shape_length():
    # axlearn's HybridMeshShapeTest.
    with pytest.raises(
        ValueError,
        match=re.escape("self.ici_mesh_shape=(1, 2) should have the same length as (3,)."),
    ):
        ts.HybridMeshShape(ici_mesh_shape=(1, 2), dcn_mesh_shape=(3,))
    assert len(ts.HybridMeshShape(ici_mesh_shape=(1, 2), dcn_mesh_shape=(3, 4))) == 2
    assert ts.HybridMeshShape([1, 2], [3, 4]).ici_mesh_shape == (1, 2)


@pytest.mark.parametrize(
    ("shape", "names", "expected"),
    [
        ((8,), ("data",), (8,)),
        ((-1,), ("data",), (8,)),
        ((-1, 2), ("data", "model"), (4, 2)),
        ((2, -1), ("data", "model"), (2, 4)),
        ((2, 2, -1), ("a", "b", "c"), (2, 2, 2)),
        ((8, 1), ("data", "model"), (8, 1)),
    ],
)
def test_create_device_mesh(shape, names, expected):
    mesh = ts.create_device_mesh(shape, names)
    assert tuple(mesh.shape.values()) == expected
    assert mesh.axis_names == names
    assert mesh.devices.reshape(-1).tolist() == list(range(8))


def test_create_device_mesh_with_devices():
    mesh = ts.create_device_mesh((-1, 2), ("data", "model"), devices=[7, 6, 5, 4, 3, 2, 1, 0])
    assert mesh.devices.tolist() == [[7, 6], [5, 4], [3, 2], [1, 0]]


def test_create_device_mesh_errors():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "mesh shape (4, 4) has 16 devices, but 8 devices were given; a mesh must cover "
            "every device."
        ),
    ):
        ts.create_device_mesh((4, 4), ("a", "b"))
    with pytest.raises(ValueError, match=re.escape("Only one axis can be -1")):
        ts.create_device_mesh((-1, -1), ("a", "b"))
    with pytest.raises(ValueError, match=re.escape("Unable to infer -1 in mesh shape (-1, 3)")):
        ts.create_device_mesh((-1, 3), ("a", "b"))


def test_hybrid_on_one_host_is_the_ici_mesh():
    mesh = ts.create_device_mesh(ts.HybridMeshShape((4, 2), (1, 1)), ("data", "model"))
    assert mesh.devices.tolist() == np.arange(8).reshape(4, 2).tolist()


@pytest.mark.parametrize(
    ("hosts", "ici", "dcn", "expected"),
    [
        (2, (2, 2), (2, 1), [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (2, (2, 2), (1, 2), [[0, 1, 4, 5], [2, 3, 6, 7]]),
        (2, (-1, 2), (2, 1), [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (2, (2, 2), (-1, 1), [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (4, (2, 1), (2, 2), [[0, 2], [1, 3], [4, 6], [5, 7]]),
        (4, (1, 2), (4, 1), [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (8, (1,), (8,), [0, 1, 2, 3, 4, 5, 6, 7]),
        (2, (4,), (2,), [0, 1, 2, 3, 4, 5, 6, 7]),
    ],
)
def test_hybrid_under_virtual_hosts(hosts, ici, dcn, expected):
    with virtual_hosts(hosts):
        mesh = ts.create_device_mesh(ts.HybridMeshShape(ici, dcn), ("data", "model")[: len(ici)])
    assert mesh.devices.tolist() == expected


def test_hybrid_mesh_blocks_follow_hosts():
    # The point of a hybrid mesh: splitting dim 0 over the DCN axis gives each host a block.
    with virtual_hosts(2):
        mesh = ts.create_device_mesh(ts.HybridMeshShape((2, 2), (2, 1)), ("data", "model"))
        x = np.arange(8 * 3).reshape(8, 3)
        with mesh:
            g = host_to_global_array_per_host([x[:4], x[4:]], partition=ts.P("data"))
            back = global_to_host_array_per_host(g)
    np.testing.assert_array_equal(back[0].numpy(), x[:4])
    np.testing.assert_array_equal(back[1].numpy(), x[4:])


def test_hybrid_errors():
    with virtual_hosts(2):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "Number of slices/granules 2 must equal the product of dcn_mesh_shape (4, 1)"
            ),
        ):
            ts.create_device_mesh(ts.HybridMeshShape((1, 2), (4, 1)), ("a", "b"))
        with pytest.raises(
            ValueError,
            match=re.escape("Product of ICI mesh (2, 1) does not match num_devices_per_granule=4."),
        ):
            ts.create_device_mesh(ts.HybridMeshShape((2, 1), (2, 1)), ("a", "b"))
