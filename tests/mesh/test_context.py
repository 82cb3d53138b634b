"""The mesh context: ``with mesh:`` makes a mesh current in this thread and tells its backend
(torch_xla's global mesh); nesting, exits out of order, per-thread stacks, and the checks on
entry (torchshard._mesh.context)."""

import asyncio
import re
import threading

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
    assert xs.get_global_mesh() is None


def _entered(mesh, entered, leave):
    with mesh:
        entered.set()
        assert leave.wait(10)


def test_torch_xlas_global_mesh_is_the_last_open_entrys():
    """Thread A inside ``with a``, thread B enters and leaves ``b``: torch_xla's global mesh
    is B's while B is inside (one per process), and then ``None`` under A's feet (before:
    the last thread to leave set it to ``None``). Now it is A's again."""
    a = ts.Mesh(np.arange(8), ("a",))
    b = ts.Mesh(np.arange(8).reshape(4, 2), ("b", "c"))
    entered, leave = threading.Event(), threading.Event()
    t = threading.Thread(target=_entered, args=(a, entered, leave), name="thread-a")
    t.start()
    try:
        assert entered.wait(10)
        assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(a.xla_mesh)
        b.__enter__()
        try:
            assert ts.current_mesh() is b
            assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(b.xla_mesh)
        finally:
            b.__exit__(None, None, None)
        assert ts.current_mesh() is None
        assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(a.xla_mesh)
    finally:
        leave.set()
        t.join(10)
    assert xs.get_global_mesh() is None
    # the same mesh in two threads at once: nothing to say
    entered.clear()
    leave.clear()
    t = threading.Thread(target=_entered, args=(a, entered, leave), name="thread-a")
    t.start()
    try:
        assert entered.wait(10)
        with a:
            assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(a.xla_mesh)
        assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(a.xla_mesh)
    finally:
        leave.set()
        t.join(10)
    assert xs.get_global_mesh() is None


def test_asyncio_tasks_that_interleave_each_see_their_own_mesh():
    """Two tasks on one thread, each inside its own ``with mesh:`` across awaits: before, the
    context was per thread, so each saw the other's mesh (and the exits came out of order)."""
    a = ts.Mesh(np.arange(8), ("a",))
    b = ts.Mesh(np.arange(8).reshape(4, 2), ("b", "c"))
    seen = {}

    async def task(name, mesh, first, second):
        with mesh:
            first.set()
            await second.wait()
            seen[name] = ts.current_mesh()
            await asyncio.sleep(0)
            seen[name + " again"] = ts.current_mesh()
        seen[name + " after"] = ts.current_mesh()

    async def main():
        ea, eb = asyncio.Event(), asyncio.Event()
        await asyncio.gather(task("a", a, ea, eb), task("b", b, eb, ea), return_exceptions=False)

    asyncio.run(main())
    assert seen == {
        "a": a,
        "b": b,
        "a again": a,
        "b again": b,
        "a after": None,
        "b after": None,
    }
    assert ts.current_mesh() is None and xs.get_global_mesh() is None
