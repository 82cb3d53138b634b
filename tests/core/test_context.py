"""The mesh context's pure stack (torchshard._core.context): which mesh is current in this
thread, push/pop in order, ``thread_mesh`` for helper threads, and the no-mesh error. No
backend is told here (``with mesh:`` is tested in tests/mesh/test_context.py)."""

import re
import threading

import numpy as np
import pytest

from torchshard._core import context
from torchshard._core.errors import NoMeshError
from torchshard._core.mesh import Mesh

A = Mesh(np.arange(8), ("a",))
B = Mesh(np.arange(8).reshape(4, 2), ("b", "c"))


def test_push_and_pop_nest():
    assert context.current_mesh() is None
    context.push(A)
    try:
        assert context.current_mesh() is A
        context.push(B)
        assert context.current_mesh() is B
        assert context.pop(B) is A  # the mesh current again
        assert context.current_mesh() is A
    finally:
        assert context.pop(A) is None
    assert context.current_mesh() is None


def test_the_same_mesh_may_be_pushed_twice():
    context.push(A)
    context.push(A)
    assert context.pop(A) is A
    assert context.pop(A) is None


def test_pop_out_of_order_is_an_error_and_changes_nothing():
    context.push(A)
    context.push(B)
    try:
        with pytest.raises(
            RuntimeError,
            match=re.escape(
                "Mesh contexts exited out of order: leaving Mesh({'a': 8}), but the current "
                "mesh is Mesh({'b': 4, 'c': 2})."
            ),
        ):
            context.pop(A)
        assert context.current_mesh() is B
    finally:
        context.pop(B)
        context.pop(A)


def test_pop_with_nothing_pushed_is_an_error():
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "Mesh contexts exited out of order: leaving Mesh({'a': 8}), but the current mesh "
            "is None."
        ),
    ):
        context.pop(A)


def test_an_equal_mesh_is_not_the_current_one():
    """``pop`` compares identities: a mesh equal to the current one is another context."""
    twin = Mesh(np.arange(8), ("a",))
    assert twin == A
    context.push(A)
    try:
        with pytest.raises(RuntimeError, match="exited out of order"):
            context.pop(twin)
    finally:
        context.pop(A)


def test_require_mesh_names_the_caller():
    with pytest.raises(
        NoMeshError,
        match=re.escape(
            "dispatch_input_batch must be called inside `with mesh:`, but there is no current "
            "mesh in this thread. Create one with torchshard.create_device_mesh(...) and "
            "enter it."
        ),
    ):
        context.require_mesh("dispatch_input_batch")
    with context.thread_mesh(A):
        assert context.require_mesh("anything") is A


def test_thread_mesh_pushes_and_pops_even_on_error():
    with pytest.raises(KeyError), context.thread_mesh(B) as entered:
        assert entered is B and context.current_mesh() is B
        raise KeyError("boom")
    assert context.current_mesh() is None


def test_each_thread_has_its_own_stack():
    seen = {}
    ready, done = threading.Event(), threading.Event()

    def helper():
        seen["before"] = context.current_mesh()
        with context.thread_mesh(B):
            ready.set()
            done.wait(10)
            seen["inside"] = context.current_mesh()
        seen["after"] = context.current_mesh()

    context.push(A)
    try:
        t = threading.Thread(target=helper, name="context-probe")
        t.start()
        assert ready.wait(10)
        assert context.current_mesh() is A  # the helper's mesh is the helper's only
        done.set()
        t.join(10)
    finally:
        context.pop(A)
    assert not t.is_alive()
    assert seen == {"before": None, "inside": B, "after": None}
