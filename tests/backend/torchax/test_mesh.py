"""JAX's own meshes (torchshard._backend.torchax.mesh): a mesh value as a
``jax.sharding.Mesh`` with ``Auto`` axes and back, ``Explicit`` axes refused with the fix,
``NamedSharding`` of a layout, and JAX's current mesh per thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from torchax_env import jax8, needs_torchax

import torchshard as ts

pytestmark = needs_torchax


@pytest.fixture(scope="module")
def jax():
    return jax8()


def test_round_trip_with_auto_axes(jax):
    from torchshard._backend.torchax.mesh import mesh_from_jax, to_jax_mesh

    ids = np.array([3, 1, 0, 2, 7, 5, 6, 4]).reshape(2, 4)
    value = ts.Mesh(ids, ("a", "b"), backend="torchax")
    native = to_jax_mesh(value)
    assert isinstance(native, jax.sharding.Mesh)
    assert [str(t) for t in native.axis_types] == ["AxisType.Auto"] * 2
    assert [[d.id for d in row] for row in native.devices] == ids.tolist()
    assert to_jax_mesh(value) is native  # cached
    back = mesh_from_jax(native)
    assert back == value and back.native is native and back.backend == "torchax"
    assert ts.Mesh.from_jax(native).jax_mesh is native


def test_explicit_axes_are_refused_with_the_fix(jax):
    explicit = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    with pytest.raises(ts.errors.ShardingError) as e:
        ts.Mesh.from_jax(explicit)
    text = str(e.value)
    assert "[('data', 'Explicit'), ('model', 'Explicit')] are not Auto" in text
    assert "axis_types=(jax.sharding.AxisType.Auto,) * 2" in text
    with pytest.raises(TypeError, match=r"expected a jax\.sharding\.Mesh, but got str"):
        ts.Mesh.from_jax("mesh")


def test_named_sharding_of_a_layout(jax):
    from torchshard._backend.torchax.mesh import named_sharding

    P = jax.sharding.PartitionSpec
    mesh = ts.create_device_mesh((4, 2), ("data", "model"), backend="torchax")
    assert named_sharding(mesh, (("data", "model"), ())).spec == P(("data", "model"))
    assert named_sharding(mesh, (("data",), ("model",))).spec == P("data", "model")
    assert named_sharding(mesh, ((), ())).spec == P()
    kept = named_sharding(mesh, (("data",), ()), frozenset({1}))
    assert kept.spec == P("data", P.UNCONSTRAINED)


def test_the_current_mesh_is_per_thread(jax):
    mesh = ts.create_device_mesh((8,), ("data",), backend="torchax")
    seen = []
    with mesh:
        t = threading.Thread(target=lambda: seen.append(jax.sharding.get_mesh()))
        t.start()
        t.join()
        assert jax.sharding.get_mesh() == mesh.jax_mesh
    assert seen and seen[0] != mesh.jax_mesh  # another thread's mesh is its own


def test_a_mesh_of_more_devices_than_jax_has_names_the_flag(jax):
    with pytest.raises(ValueError, match=r"JAX has 8 devices.*device_count=16 before JAX"):
        ts.create_device_mesh((16,), ("data",), backend="torchax")
