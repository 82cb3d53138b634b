"""JAX and torchax as the torchax backend reaches them (torchshard._backend.torchax.runtime):
the devices in torchshard's order, the dtypes JAX holds without ``jax_enable_x64``, and the
conversions between CPU tensors, numpy arrays and torchax tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchax_env import jax8, needs_torchax

import torchshard as ts
from torchshard._backend.protocols import Refused

pytestmark = needs_torchax


@pytest.fixture(scope="module")
def rt():
    jax8()
    from torchshard._backend.torchax import runtime

    return runtime


def test_devices_are_jaxs_by_process_then_id(rt):
    import jax

    assert [d.id for d in rt.devices()] == sorted(d.id for d in jax.devices())
    assert rt.local_devices() == tuple(range(8))
    assert rt.topology().process_count == 1 and rt.cpu_devices()


def test_int64_is_narrowed_when_it_fits_and_refused_when_not(rt):
    a = rt.host_array(torch.tensor([-(2**31), 2**31 - 1]))
    assert a.dtype == np.int32 and a.tolist() == [-(2**31), 2**31 - 1]
    with pytest.raises(Refused) as e:
        rt.host_array(torch.tensor([0, 2**31]))
    assert isinstance(e.value.error, ts.errors.ShardingError)
    assert "holds the value 2147483648, which does not fit in int32" in str(e.value)
    assert rt.placed_dtype(torch.int64) == torch.int32
    assert rt.placed_dtype(torch.float16) == torch.float16


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_64_bit_floats_are_refused_with_the_fix(rt, dtype):
    with pytest.raises(Refused) as e:
        rt.host_array(torch.zeros(2, dtype=dtype))
    assert isinstance(e.value.error, TypeError)
    assert "jax_enable_x64" in str(e.value) and "Cast on the host" in str(e.value)


def test_bfloat16_moves_bit_for_bit(rt):
    x = torch.tensor([1.5, -0.0, float("inf"), 3e38], dtype=torch.bfloat16)
    a = rt.host_array(x)
    assert str(a.dtype) == "bfloat16"
    back = rt.to_torch(a)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


def test_a_jax_array_as_a_torchax_tensor_without_a_copy(rt):
    import jax.numpy as jnp

    array = jnp.arange(4)
    t = rt.as_tensor(array)
    assert rt.is_torchax_tensor(t) and not rt.is_torchax_tensor(torch.zeros(1))
    assert rt.array_of(t) is array


def test_a_missing_package_names_the_extra(rt):
    err = rt._import_error("torchax", ImportError("No module named 'torchax'", name="torchax"))
    assert isinstance(err, ts.errors.MissingDependencyError)
    assert "needs torchax, which is not installed" in str(err)
    assert "torchshard-input[torchax]" in str(err)
    broken = rt._import_error("torchax", AttributeError("aten.prod.dim_Dimname"))
    assert "cannot be imported on torch" in str(broken) and "dim_Dimname" in str(broken)


def test_cpu_devices_are_asked_for_only_before_jax_starts(rt, monkeypatch):
    import sys

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2")
    assert "jax" in sys.modules  # started here: too late, nothing changes
    assert not rt.setup_cpu_devices(4)
    monkeypatch.delitem(sys.modules, "jax")
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert not rt.setup_cpu_devices(4)  # a TPU's chips are its devices
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert rt.setup_cpu_devices(4)
    import os

    assert os.environ["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4"
    )


def test_host_converter_checks_the_dtype_once(rt):
    to_numpy = rt.host_converter(torch.float32)
    x = torch.arange(4, dtype=torch.float32)
    assert to_numpy(x).base is not None or to_numpy(x).ctypes.data == x.data_ptr()  # a view
    assert rt.host_converter(torch.int64) is rt.host_array  # narrowed per tensor, checked
    with pytest.raises(Refused, match="float64"):
        rt.host_converter(torch.float64)
