"""Mesh: an immutable grid of device ids, and the thread-local mesh context
(torchshard._core.mesh)."""

import pickle
import re
import threading

import numpy as np
import pytest

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla: pip install 'torchshard[xla]'")
import torch_xla.distributed.spmd as xs

import torchshard as ts


def _xla_mesh_tuple(m):
    return (
        None
        if m is None
        else (tuple(np.asarray(m.device_ids).tolist()), tuple(m.mesh_shape), tuple(m.axis_names))
    )


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


def test_unknown_backend():
    with pytest.raises(
        ValueError, match=re.escape("Mesh backend must be 'xla' or 'dtensor', but got 'tpu'.")
    ):
        ts.Mesh(np.arange(8), ("a",), backend="tpu")


def test_with_sets_the_current_mesh_and_torch_xla_global_mesh():
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    assert ts.current_mesh() is None
    with mesh as entered:
        assert entered is mesh
        assert ts.current_mesh() is mesh
        assert _xla_mesh_tuple(xs.get_global_mesh()) == (tuple(range(8)), (4, 2), ("data", "model"))
    assert ts.current_mesh() is None
    assert xs.get_global_mesh() is None


def test_nested_with_restores_the_outer_mesh():
    outer = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    inner = ts.Mesh(np.arange(8)[::-1], ("x",))
    with outer:
        with inner:
            assert ts.current_mesh() is inner
            assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(inner.xla_mesh)
        assert ts.current_mesh() is outer
        assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(outer.xla_mesh)
        with outer:  # re-entering the same mesh nests too
            assert ts.current_mesh() is outer
        assert ts.current_mesh() is outer
    assert ts.current_mesh() is None
    assert xs.get_global_mesh() is None


def test_exit_out_of_order_is_an_error():
    a = ts.Mesh(np.arange(8), ("a",))
    b = ts.Mesh(np.arange(8), ("b",))
    a.__enter__()
    b.__enter__()
    try:
        with pytest.raises(
            RuntimeError,
            match=re.escape(
                "Mesh contexts exited out of order: leaving Mesh({'a': 8}), but the current "
                "mesh is Mesh({'b': 8})."
            ),
        ):
            a.__exit__(None, None, None)
    finally:
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)


def test_mesh_over_fewer_devices_than_the_runtime_is_refused_on_entry():
    mesh = ts.Mesh(np.arange(4), ("data",))  # building it is fine: it is a pure value
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "mesh Mesh({'data': 4}) covers devices [0, 1, 2, 3], but the runtime has 8 devices "
            "(ids 0..7); a mesh must cover every device exactly once."
        ),
    ):
        mesh.__enter__()
    assert ts.current_mesh() is None


def test_mesh_naming_unknown_devices_is_refused_on_entry():
    with pytest.raises(
        ts.ShardingError, match=re.escape("covers devices [1, 2, 3, 4, 5, 6, 7, 8]")
    ):
        ts.Mesh(np.arange(1, 9), ("data",)).__enter__()
    assert ts.current_mesh() is None


def test_context_is_per_thread():
    mesh = ts.Mesh(np.arange(8), ("data",))
    seen = []
    with mesh:
        t = threading.Thread(target=lambda: seen.append(ts.current_mesh()), name="probe")
        t.start()
        t.join(timeout=10)
    assert seen == [None]


def test_threads_nest_their_own_meshes():
    meshes = [
        ts.Mesh(np.arange(8), ("a",)),
        ts.Mesh(np.arange(8).reshape(4, 2), ("b", "c")),
        ts.Mesh(np.arange(8)[::-1], ("d",)),
    ]
    barrier = threading.Barrier(len(meshes), timeout=10)
    results = {}

    def work(i):
        outer, inner = meshes[i], meshes[(i + 1) % len(meshes)]
        with outer:
            barrier.wait()
            with inner:
                barrier.wait()
                got_inner = ts.current_mesh()
            barrier.wait()
            results[i] = (got_inner is inner, ts.current_mesh() is outer)
        results[i] += (ts.current_mesh() is None,)

    threads = [threading.Thread(target=work, args=(i,), name=f"mesh-{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {i: (True, True, True) for i in range(3)}


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
