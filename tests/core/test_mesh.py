"""Mesh: the value of a named grid of device ids, immutable, validated when built, equal by
value; bound to no runtime (torchshard._core.mesh). The context that enters a mesh is tested in
tests/mesh/test_context.py and tests/core/test_context.py."""

import pickle
import re

import numpy as np
import pytest

import torchshard as ts
from torchshard._core.mesh import Mesh as Value
from torchshard._core.mesh import topology_of
from torchshard._core.topology import Topology, override_topology


@pytest.mark.xla  # a Mesh without backend= is torch_xla's only where it is installed
def test_properties():
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert list(mesh.shape) == ["data", "model"]  # ordered
    assert mesh.axis_names == ("data", "model")
    assert mesh.size == 8
    assert mesh.devices.dtype == np.int64 and mesh.devices.shape == (4, 2)
    assert mesh.device_ids == tuple(range(8))
    assert mesh.backend == "xla"
    with pytest.raises(ValueError):
        mesh.devices[0, 0] = 5  # read-only
    with pytest.raises(TypeError):
        mesh.shape["data"] = 3  # read-only mapping


def test_single_axis_name_may_be_a_str():
    assert ts.Mesh(np.arange(8), "data").axis_names == ("data",)


def test_devices_are_copied_not_aliased():
    ids = np.arange(8)
    mesh = ts.Mesh(ids, ("data",))
    ids[0] = 7
    assert mesh.device_ids[0] == 0


def test_value_semantics():
    a = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    b = ts.Mesh([[0, 1], [2, 3], [4, 5], [6, 7]], ["data", "model"])
    c = ts.Mesh(np.arange(8).reshape(4, 2)[::-1], ("data", "model"))
    d = ts.Mesh(np.arange(8).reshape(4, 2), ("x", "model"))
    assert a == b and hash(a) == hash(b)
    assert a != c and a != d
    assert len({a, b, c, d}) == 3
    assert pickle.loads(pickle.dumps(c)) == c


def test_repr():
    assert repr(ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))) == (
        "Mesh({'data': 4, 'model': 2})"
    )
    assert repr(ts.Mesh(np.arange(8)[::-1], ("data",))) == (
        "Mesh({'data': 8}, devices=[7, 6, 5, 4, 3, 2, 1, 0])"
    )


@pytest.mark.parametrize(
    ("devices", "names", "error", "message"),
    [
        (
            np.arange(8),
            ("a", "b"),
            ValueError,
            (
                "Mesh requires the ndim of `devices` to equal the length of `axis_names`, but got "
                "devices.ndim == 1 (shape (8,)) and len(axis_names) == 2 (('a', 'b'))."
            ),
        ),
        (
            np.zeros(8),
            ("a",),
            TypeError,
            "Mesh requires `devices` to be an integer array of device ids, but got dtype float64",
        ),
        (
            np.array([0, 1, 1, 2]),
            ("a",),
            ValueError,
            "Mesh device ids must be distinct, but [1] appear more than once.",
        ),
        (np.array([0, -1]), ("a",), ValueError, "Mesh device ids must be >= 0, but got [0, -1]."),
        (
            np.arange(8).reshape(4, 2),
            ("a", "a"),
            ValueError,
            "Mesh axis names must be distinct, but got ('a', 'a').",
        ),
        (np.arange(8), ("",), TypeError, "Mesh axis names must be non-empty str, but got ''."),
        (np.arange(8), (3,), TypeError, "Mesh axis names must be non-empty str, but got 3."),
        (
            np.zeros((0,), np.int64),
            ("a",),
            ValueError,
            "Mesh requires at least one device, but got shape (0,).",
        ),
    ],
)
def test_invalid(devices, names, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ts.Mesh(devices, names)


# -- the bare value (torchshard._core.mesh.Mesh): no runtime behind it -----------------------


@pytest.mark.xla  # a Mesh without backend= is torch_xla's only where it is installed
def test_a_bare_value_is_equal_to_the_bound_mesh_of_the_same_grid():
    bare = Value(np.arange(8).reshape(4, 2), ("data", "model"))
    assert bare == ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    assert hash(bare) == hash(ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model")))
    assert bare != Value(np.arange(8).reshape(4, 2), ("data", "model"), backend="dtensor")
    assert bare.native is None and bare.backend == "xla"
    assert Value(np.arange(2), ("a",), native="dm").native == "dm"


def test_a_bare_value_pickles_as_itself():
    bare = Value(np.array([1, 0, 3, 2]), ("a",), backend="dtensor")
    back = pickle.loads(pickle.dumps(bare))
    assert type(back) is Value and back == bare and back.device_ids == (1, 0, 3, 2)
    assert back.backend == "dtensor"


def test_a_bare_value_names_no_backend_check_but_a_backend_name():
    # Which names a runtime serves is the registry's to say (torchshard.Mesh checks them).
    assert Value(np.arange(2), ("a",), backend="tpu").backend == "tpu"
    for bad in ("", None, 3):
        with pytest.raises(
            ValueError,
            match=re.escape(f"Mesh backend must be a backend name, but got {bad!r}."),
        ):
            Value(np.arange(2), ("a",), backend=bad)


def test_a_bare_value_knows_no_topology_unless_one_is_emulated():
    bare = Value(np.arange(4), ("a",))
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "Mesh({'a': 4}) is a bare mesh value (torchshard._core.mesh.Mesh), bound to no "
            "runtime, so it cannot say which process owns which device. Use torchshard.Mesh, "
            "or pass device_process= (and process_index=) explicitly."
        ),
    ):
        topology_of(bare)
    emulation = Topology(1, 2, (0, 0, 1, 1), virtual=True)
    with override_topology(emulation, backend="xla"):
        assert topology_of(bare) is emulation
    with override_topology(emulation, backend="dtensor"), pytest.raises(RuntimeError):
        topology_of(bare)  # an emulation of another backend does not apply
