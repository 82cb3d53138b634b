"""The backend registry (torchshard._backend.registry): the shipped records, found by name, by
mesh, by tensor and by default; a backend module imported on first use; registration and its
errors; the process's default backend."""

import re
import sys

import numpy as np
import pytest
import torch

from torchshard._backend import registry
from torchshard._backend.protocols import Backend
from torchshard._core.mesh import Mesh


def test_the_shipped_backends_are_known_by_module():
    assert registry.KNOWN == {
        "xla": "torchshard._backend.xla.backend",
        "dtensor": "torchshard._backend.dtensor.backend",
        "torchax": "torchshard._backend.torchax.backend",
    }
    assert registry.names()[:3] == ("xla", "dtensor", "torchax")


@pytest.mark.parametrize("name", ["xla", "dtensor"])
def test_lookup_by_name_imports_and_registers_the_module(name):
    backend = registry.lookup(name)
    assert isinstance(backend, Backend) and backend.name == name
    assert sys.modules[registry.KNOWN[name]].BACKEND is backend
    assert registry.lookup(name) is backend  # one record per process


@pytest.mark.parametrize("name", ["xla", "dtensor"])
def test_lookup_by_mesh_uses_the_backend_it_names(name):
    mesh = Mesh(np.arange(4), ("a",), backend=name)
    assert registry.lookup(mesh) is registry.lookup(name)


def test_lookup_of_a_plain_tensor_is_xla():
    """A tensor that is no DTensor computes with plain torch ops in a step: torch_xla's
    in-step primitives are those."""
    assert registry.lookup(torch.zeros(2)) is registry.lookup("xla")


def test_lookup_of_none_is_the_default_backend(monkeypatch):
    monkeypatch.setattr(registry, "default_name", lambda: "dtensor")
    assert registry.lookup(None) is registry.lookup("dtensor")
    assert registry.lookup() is registry.lookup("dtensor")


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match=re.escape("unknown backend 'tpu'; expected one of ['dtensor', 'torchax', 'xla']."),
    ):
        registry.lookup("tpu")
    with pytest.raises(ValueError, match=re.escape("unknown backend 'tpu'")):
        registry.lookup(Mesh(np.arange(2), ("a",), backend="tpu"))


def test_a_module_that_does_not_register_is_an_error(monkeypatch):
    monkeypatch.setitem(registry.KNOWN, "ghost", "json")
    with pytest.raises(
        RuntimeError,
        match=re.escape("json was imported but did not register the backend 'ghost'."),
    ):
        registry.lookup("ghost")


def test_a_third_backend_is_registered_and_named(monkeypatch):
    monkeypatch.setattr(registry, "_BY_NAME", dict(registry._BY_NAME))
    xla = registry.lookup("xla")
    third = Backend("third", place=xla.place, read=xla.read, step=xla.step, meshes=xla.meshes)
    registry.register(third)
    registry.register(third)  # the same record again: nothing changes
    assert registry.lookup("third") is third
    assert registry.lookup(Mesh(np.arange(2), ("a",), backend="third")) is third
    assert registry.names() == ("xla", "dtensor", "torchax", "third")
    other = Backend("third", place=xla.place, read=xla.read, step=xla.step, meshes=xla.meshes)
    with pytest.raises(
        ValueError, match=re.escape("register: a backend called 'third' is registered already.")
    ):
        registry.register(other)
    assert registry.lookup("third") is third


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_backend_needs_a_name(name):
    xla = registry.lookup("xla")
    nameless = Backend(name, place=xla.place, read=xla.read, step=xla.step, meshes=xla.meshes)
    with pytest.raises(
        TypeError,
        match=re.escape(f"register: a backend's name must be a non-empty str, but got {name!r}."),
    ):
        registry.register(nameless)


def test_the_default_backend(monkeypatch):
    import torch.distributed as dist

    from torchshard._backend.xla import env

    monkeypatch.setitem(sys.modules, "torch_xla", object())  # torch_xla imported: the program's
    assert registry.default_name() == "xla"
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # not imported
    monkeypatch.setattr(env, "xla_installed", lambda: True)
    assert registry.default_name() == "xla"  # installed: imported on first use
    monkeypatch.setattr(env, "xla_installed", lambda: False)
    assert registry.default_name() == "dtensor"  # a plain install
    monkeypatch.setattr(env, "xla_installed", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert registry.default_name() == "dtensor"  # a process group: one process per device
