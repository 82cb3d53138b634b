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


def test_each_thread_reads_its_own_mesh_as_torch_xlas_global_mesh():
    """Thread A inside ``with a`` while the main thread is inside ``with b``: torch_xla's
    ``get_global_mesh`` (where its own calls look it up) gives each thread its own mesh, and
    torchshard's calls in A place on A's mesh (before: both read the mesh of the last entry,
    B's). A thread inside no mesh reads torch_xla's own value, the last open entry's; a mesh
    the program sets itself is every thread's; a helper lent a mesh reads that one."""
    import torch_xla.distributed.spmd.xla_sharding as xla_sharding

    from torchshard._core.context import thread_mesh
    from torchshard.testing import assert_sharded

    a = ts.Mesh(np.arange(8), ("a",))
    b = ts.Mesh(np.arange(8).reshape(4, 2), ("b", "c"))
    with a:  # installs the per-thread reader
        assert xs.get_global_mesh is xla_sharding.get_global_mesh  # enable_manual_sharding's
    a_in, b_in, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with a:
            a_in.set()
            assert b_in.wait(10)
            seen["a"] = (_xla_mesh_tuple(xs.get_global_mesh()), xla_sharding.get_global_mesh())
            g = ts.host_to_global_array(np.zeros((8, 2), np.float32), partition=ts.P("a"))
            assert_sharded(g, ts.P("a"), a)
            seen["a placed"] = True
        done.set()

    def no_mesh():
        seen["no mesh"] = _xla_mesh_tuple(xs.get_global_mesh())

    def helper():
        with thread_mesh(a):
            seen["helper"] = _xla_mesh_tuple(xs.get_global_mesh())

    t = threading.Thread(target=thread_a, name="thread-a")
    t.start()
    try:
        assert a_in.wait(10)
        with b:
            b_in.set()
            assert done.wait(30)
            assert _xla_mesh_tuple(xs.get_global_mesh()) == _xla_mesh_tuple(b.xla_mesh)
            for target in (no_mesh, helper):
                probe = threading.Thread(target=target, name=target.__name__)
                probe.start()
                probe.join(10)
            own = xs.Mesh(np.arange(8)[::-1].copy(), (8,), ("own",))
            xs.set_global_mesh(own)  # the program's own: every thread's, as in torch_xla
            assert xs.get_global_mesh() is own
            probe = threading.Thread(target=no_mesh, name="after-set")
            probe.start()
            probe.join(10)
            seen["program's own"] = seen.pop("no mesh")
            probe = threading.Thread(target=no_mesh, name="no-mesh")
            probe.start()
            probe.join(10)
    finally:
        b_in.set()
        t.join(30)
    assert seen["a"] == (_xla_mesh_tuple(a.xla_mesh), a.xla_mesh)
    assert seen["a placed"]
    assert seen["helper"] == _xla_mesh_tuple(a.xla_mesh)
    assert seen["program's own"] == _xla_mesh_tuple(own)
    assert seen["no mesh"] == _xla_mesh_tuple(own)  # until torchshard's next entry or exit
    assert xs.get_global_mesh() is None  # b's exit reset it


def test_asyncio_tasks_each_read_their_own_mesh_as_torch_xlas_global_mesh():
    a = ts.Mesh(np.arange(8), ("a",))
    b = ts.Mesh(np.arange(8).reshape(4, 2), ("b", "c"))
    seen = {}

    async def task(name, mesh, first, second):
        with mesh:
            first.set()
            await second.wait()
            await asyncio.sleep(0)  # both tasks are inside their meshes from here
            seen[name] = _xla_mesh_tuple(xs.get_global_mesh())
            await asyncio.sleep(0)  # neither leaves before both have read

    async def main():
        ea, eb = asyncio.Event(), asyncio.Event()
        await asyncio.gather(task("a", a, ea, eb), task("b", b, eb, ea))

    asyncio.run(main())
    assert seen == {"a": _xla_mesh_tuple(a.xla_mesh), "b": _xla_mesh_tuple(b.xla_mesh)}
