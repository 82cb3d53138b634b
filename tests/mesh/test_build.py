"""create_device_mesh, infer_mesh_shape, HybridMeshShape (torchshard._mesh.build)."""

import re

import numpy as np
import pytest

import torchshard as ts
from torchshard._core.topology import Topology, override_topology
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
            "create_device_mesh: mesh shape (4, 4) has 16 devices, but torch_xla's runtime has "
            "8 devices; a mesh covers every device of the run. On a CPU, emulate 16 devices: "
            "call torchshard.setup_cpu_emulation(16) before torch_xla starts (or run with "
            "PJRT_DEVICE=CPU CPU_NUM_DEVICES=16); on a TPU, use a shape of this host's devices, "
            "or a shape with -1 (e.g. (-1, 4)) to fit any count."
        ),
    ):
        ts.create_device_mesh((4, 4), ("a", "b"))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "create_device_mesh: mesh shape (4,) has 4 devices, but devices= gives 2; a mesh "
            "covers exactly the devices given: pass 4 device ids, or a shape with -1 (e.g. "
            "(-1,)) to fit 2."
        ),
    ):
        ts.create_device_mesh((4,), ("a",), devices=[0, 1])
    with pytest.raises(ValueError, match=re.escape("Only one axis can be -1")):
        ts.create_device_mesh((-1, -1), ("a", "b"))
    with pytest.raises(ValueError, match=re.escape("Unable to infer -1 in mesh shape (-1, 3)")):
        ts.create_device_mesh((-1, 3), ("a", "b"))


def test_a_shape_and_names_of_different_lengths_name_both_and_the_fix():
    # Before: Mesh's "the ndim of `devices`", which the caller never passed.
    with pytest.raises(
        ValueError,
        match=re.escape(
            "create_device_mesh: mesh_shape has 1 axes ((2,)), but axis_names has 2 (('data', "
            "'model')); give one name per axis, e.g. create_device_mesh((2,), ('data',)) or "
            "create_device_mesh((-1, 1), ('data', 'model'))."
        ),
    ):
        ts.create_device_mesh((2,), ("data", "model"))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "mesh_shape has 2 axes ((4, 2)), but axis_names has 1 (('data',)); give one name per "
            "axis, e.g. create_device_mesh((4, 2), ('data', 'model')) or "
            "create_device_mesh((-1,), ('data',))."
        ),
    ):
        ts.create_device_mesh((4, 2), "data")
    assert ts.create_device_mesh((8,), "data").axis_names == ("data",)


def test_the_dtensor_count_mismatch_says_to_start_processes():
    from torchshard._mesh.build import _count_mismatch

    assert _count_mismatch((4,), 1, "dtensor", given=False) == (
        "create_device_mesh: mesh shape (4,) has 4 devices, but torch.distributed's default "
        "process group has 1 rank; a mesh covers every device of the run. Start 4 processes "
        "(e.g. torchrun --nproc-per-node 4 train.py; the dtensor backend has one device per "
        "process), or a shape with -1 (e.g. (-1,)) to fit any count."
    )


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
                "Number of slices/granules 2 must equal the product of dcn_mesh_shape (4, 1), "
                "but that product is 4: the DCN mesh tiles the hosts, and 2 hosts own the mesh's "
                "devices (4 each). Use a dcn_mesh_shape whose product is 2 (-1 infers one axis)."
            ),
        ):
            ts.create_device_mesh(ts.HybridMeshShape((1, 2), (4, 1)), ("a", "b"))
        with pytest.raises(
            ValueError,
            match=re.escape(
                "Product of ICI mesh (2, 1) does not match num_devices_per_granule=4: the ICI "
                "mesh has 2 devices, but each of the 2 hosts owns 4 of the mesh's devices. Use "
                "an ici_mesh_shape whose product is 4 (-1 infers one axis)."
            ),
        ):
            ts.create_device_mesh(ts.HybridMeshShape((2, 1), (2, 1)), ("a", "b"))


def _interleaved_hosts(hosts):
    """A topology whose hosts own interleaved device ids (device d on host d % hosts), as
    global ordinals may be on a real multi-host run; contiguous ids hide host splitting."""
    return override_topology(Topology(0, hosts, tuple(d % hosts for d in range(8)), virtual=True))


@pytest.mark.parametrize(
    ("hosts", "shape", "expected"),
    [
        # axlearn's rule: the first non-singleton axis is split over the hosts; each host's
        # devices, in id order, fill its block of the mesh.
        (2, (2, 4), [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (2, (4, 2), [[0, 2], [4, 6], [1, 3], [5, 7]]),
        (2, (1, 8), [[0, 2, 4, 6, 1, 3, 5, 7]]),
        (2, (1, 2, 4), [[[0, 2, 4, 6], [1, 3, 5, 7]]]),
        (4, (4, 2), [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (4, (-1, 1), [[0], [4], [1], [5], [2], [6], [3], [7]]),
    ],
)
def test_plain_shape_is_split_over_hosts(hosts, shape, expected):
    with _interleaved_hosts(hosts):
        mesh = ts.create_device_mesh(shape, ("a", "b", "c")[: len(shape)])
    assert mesh.devices.tolist() == expected
    # the oracle: each host's devices form one contiguous block along the split axis
    axis = next(i for i, n in enumerate(mesh.devices.shape) if n != 1)
    for h, block in enumerate(np.split(mesh.devices, hosts, axis=axis)):
        assert sorted(block.reshape(-1).tolist()) == [d for d in range(8) if d % hosts == h]


@pytest.mark.parametrize("hosts", [2, 4])
@pytest.mark.parametrize("shape", [(4, 2), (8, 1), (1, 8), (4, 1, 2), (-1, 2)])
def test_plain_shape_on_contiguous_hosts_is_the_reshape(hosts, shape):
    # Contiguous host groups (virtual_hosts): splitting the leading axis is the plain reshape.
    with virtual_hosts(hosts):
        mesh = ts.create_device_mesh(shape, ("a", "b", "c")[: len(shape)])
    assert mesh.devices.reshape(-1).tolist() == list(range(8))


def test_plain_shape_whose_first_axis_spans_hosts_is_refused():
    # The case: (2, 4) on 4 hosts would give rows that span two hosts each.
    with virtual_hosts(4):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "create_device_mesh: mesh shape (2, 4) on 4 hosts: the first non-singleton mesh "
                "axis 0 has size 2, which must be divisible by the number of slices/granules "
                "(hosts) 4: that axis is split over the hosts so that each host's 2 devices form "
                "one block of the mesh. Make axis 0 a multiple of 4 (e.g. put the axis that "
                "spans hosts first), or lay the hosts out yourself with a HybridMeshShape."
            ),
        ):
            ts.create_device_mesh((2, 4), ("data", "model"))
        with pytest.raises(ValueError, match=re.escape("the first non-singleton mesh axis 1")):
            ts.create_device_mesh((1, 2, 4), ("a", "b", "c"))
        # the hybrid shape that lays the hosts out as wanted is accepted
        mesh = ts.create_device_mesh(ts.HybridMeshShape((1, 2), (2, 2)), ("data", "model"))
    assert mesh.devices.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hosts_owning_different_numbers_of_devices():
    topology = Topology(0, 2, (0, 0, 0, 0, 0, 0, 1, 1), virtual=True)
    with override_topology(topology):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "create_device_mesh: a mesh over several hosts gives every host the same block, "
                "so each host must own the same number of the mesh's devices, but the hosts own "
                "{0: 6, 1: 2} (host: devices; the devices by host: {0: [0, 1, 2, 3, 4, 5], "
                "1: [6, 7]}). Pass devices= with the same number of devices from each host."
            ),
        ):
            ts.create_device_mesh((4, 2), ("a", "b"))


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        (
            "42",
            TypeError,
            (
                "create_device_mesh: mesh_shape must be a sequence of ints (one size per mesh "
                "axis, -1 inferred), but got str '42'. Pass a tuple such as (4, 2) or (-1, 2)."
            ),
        ),
        (
            8,
            TypeError,
            (
                "create_device_mesh: mesh_shape must be a sequence of ints (one size per mesh "
                "axis, -1 inferred), but got int 8. Pass a tuple such as (4, 2) or (-1, 2)."
            ),
        ),
        (
            (-2, -4),
            ValueError,
            (
                "create_device_mesh: mesh_shape (-2, -4): axis 0 is -2, but each axis must be a "
                "positive size, or -1 for the one axis inferred from the device count. Use sizes "
                ">= 1 (e.g. (2, 4)) or -1 (e.g. (-1, 4))."
            ),
        ),
        ((4, 0), ValueError, "create_device_mesh: mesh_shape (4, 0): axis 1 is 0, but each"),
        (
            (2.0, 4),
            TypeError,
            (
                "create_device_mesh: mesh_shape (2.0, 4): axis 0 must be an int, but got float "
                "2.0. Pass a tuple of ints such as (4, 2)."
            ),
        ),
        ((True, 8), TypeError, "create_device_mesh: mesh_shape (True, 8): axis 0 must be an int"),
    ],
)
def test_bad_mesh_shapes(shape, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        ts.create_device_mesh(shape, ("a", "b"))


def test_bad_shapes_elsewhere():
    with pytest.raises(TypeError, match=re.escape("mesh_shape must be a sequence of ints")):
        ts.infer_mesh_shape("42")
    with pytest.raises(ValueError, match=re.escape("ici_mesh_shape (2, -3): axis 1 is -3")):
        ts.HybridMeshShape((2, -3), (1, 1))
    with pytest.raises(TypeError, match=re.escape("dcn_mesh_shape must be a sequence of ints")):
        ts.HybridMeshShape((2, 4), "11")
    assert ts.create_device_mesh(np.array([4, 2]), ("a", "b")).devices.shape == (4, 2)
