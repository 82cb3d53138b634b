"""Host leaf validation and zero-copy conversion (torchshard._place.host_data)."""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla

from torchshard._place.host_data import SUPPORTED_DTYPES, as_host_tensor, shape_dtype

NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16,
                np.float32, np.float64, np.complex64, np.complex128]  # fmt: skip
DTYPE_NAMES = (
    "bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, complex64, "
    "complex128"
)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_is_shared_not_copied(dtype):
    x = np.zeros((3, 2), dtype)
    t = as_host_tensor(x, "x")
    assert t.dtype == torch.from_numpy(x).dtype
    assert t.data_ptr() == x.ctypes.data


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_cpu_tensors_pass_through(dtype):
    x = torch.zeros(3, dtype=dtype)
    assert as_host_tensor(x, "x") is x


def test_requires_grad_is_detached():
    x = torch.zeros(3, requires_grad=True)
    t = as_host_tensor(x, "x")
    assert not t.requires_grad and t.data_ptr() == x.data_ptr()


@pytest.mark.parametrize(
    "x",
    [
        np.arange(12)[::-1],
        np.arange(12).reshape(3, 4)[:, ::-2],
        np.arange(12, dtype=">i4"),
        np.arange(12, dtype=">f8").reshape(3, 4).T,
        np.asfortranarray(np.arange(12).reshape(3, 4)),
    ],
    ids=["reversed", "negative-stride-2d", "big-endian", "big-endian-transposed", "fortran"],
)
def test_awkward_numpy_layouts_keep_their_values(x):
    t = as_host_tensor(x, "x")
    np.testing.assert_array_equal(t.numpy(), x)
    assert t.dtype.is_floating_point == (x.dtype.kind == "f")


def test_read_only_numpy_is_copied():
    x = np.arange(4)
    x.setflags(write=False)
    t = as_host_tensor(x, "x")
    np.testing.assert_array_equal(t.numpy(), x)
    assert t.data_ptr() != x.ctypes.data


def test_numpy_scalars_are_0d():
    assert as_host_tensor(np.float32(2.5), "x").shape == ()


@pytest.mark.parametrize(
    ("x", "error", "message"),
    [
        (
            np.array(["a", "b"]),
            TypeError,
            (
                f"host_arrays['s']: numpy dtype <U1 is not supported; expected one of "
                f"{DTYPE_NAMES} (bfloat16 as a torch.Tensor). Strings and objects must be "
                "encoded as numbers on the host."
            ),
        ),
        (
            np.array([object()]),
            TypeError,
            f"host_arrays['s']: numpy dtype object is not supported; expected one of {DTYPE_NAMES}",
        ),
        (
            np.zeros(2, np.clongdouble),
            TypeError,
            "host_arrays['s']: numpy dtype complex256 is not supported",
        ),
        (
            torch.zeros(2, dtype=torch.uint16),
            TypeError,
            (
                f"host_arrays['s']: dtype torch.uint16 is not supported; expected one of "
                f"{DTYPE_NAMES}."
            ),
        ),
        (
            [1, 2],
            TypeError,
            (
                "host_arrays['s']: expected a numpy array or a CPU torch.Tensor, but got list "
                "([1, 2]). Wrap Python numbers with np.asarray(...) or torch.tensor(...)."
            ),
        ),
        (
            3,
            TypeError,
            "host_arrays['s']: expected a numpy array or a CPU torch.Tensor, but got int (3).",
        ),
    ],
)
def test_bad_leaves(x, error, message):
    with pytest.raises(error, match=re.escape(message)):
        as_host_tensor(x, "host_arrays['s']")


def test_device_tensor_is_refused():
    x = torch.zeros(2, device=torch_xla.device())
    with pytest.raises(
        TypeError,
        match=re.escape(
            "host_arrays['s']: expected a host array (numpy array or CPU torch.Tensor), but got a "
            "tensor on device xla:0. Global tensors are read back with global_to_host_array."
        ),
    ):
        as_host_tensor(x, "host_arrays['s']")


def test_shape_dtype():
    assert shape_dtype(np.zeros((2, 3), np.int8), "x") == ((2, 3), np.dtype(np.int8))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "host_specs['a']: expected a TensorSpec or an object with .shape and .dtype, but got "
            "int."
        ),
    ):
        shape_dtype(3, "host_specs['a']")


# -- tensors whose memory is not their values: refused, naming the leaf and the fix --


def _freed():
    t = torch.arange(4.0)
    t.untyped_storage().resize_(0)  # as FSDP frees a sharded parameter's storage
    return t


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(8, 2)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),
            (
                "x['a']: expected a tensor whose memory holds its values, but got a lazy conjugate "
                "view (x.conj() of a complex tensor: the memory holds the unconjugated values). "
                "Pass x.resolve_conj()."
            ),
        ),
        (
            lambda: torch._neg_view(torch.arange(4.0)),
            (
                "x['a']: expected a tensor whose memory holds its values, but got a lazy negative "
                "view (the memory holds the values negated). Pass x.resolve_neg()."
            ),
        ),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            (
                "x['a']: expected a dense tensor, but got a nested tensor, whose parts differ in "
                "shape. Pad it to one shape (x.to_padded_tensor(0)) or pass its parts as leaves of "
                "their own (x.unbind())."
            ),
        ),
        (
            _freed,
            (
                "x['a']: expected a tensor with data, but got one of shape (4,) whose storage was "
                "freed (resized to 0 bytes, as FSDP does to a sharded parameter)."
            ),
        ),
        (
            _fake,
            (
                "x['a']: expected a tensor with data, but got a FakeTensor (made under "
                "FakeTensorMode), which has a shape and a dtype but no values."
            ),
        ),
    ],
    ids=["conj", "neg", "nested", "freed-storage", "FakeTensor"],
)
def test_tensors_whose_memory_is_not_their_values_are_refused(make, message, mesh8):
    """Before: the conjugate and negative views moved their memory (the wrong values, or an
    obscure error), a nested tensor or freed storage an obscure error, a FakeTensor a
    segfault."""
    import torchshard as ts

    x = make()
    with pytest.raises(TypeError, match=re.escape(message)):
        as_host_tensor(x, "x['a']")
    with (
        mesh8,
        pytest.raises(TypeError, match=re.escape(message.replace("x['a']", "host_arrays['a']"))),
    ):
        ts.host_to_global_array({"a": x}, partition=ts.P())


def test_resolved_views_are_placed_with_their_values(mesh8):
    import torchshard as ts

    z = torch.tensor([1 + 2j, 3 - 1j] * 4)
    n = torch.arange(8.0)
    with mesh8:
        g = ts.host_to_global_array(
            {"c": z.conj().resolve_conj(), "n": torch._neg_view(n).resolve_neg()},
            partition=ts.P("data"),
        )
        back = ts.global_to_host_array(g)
    assert torch.equal(back["c"], torch.conj_physical(z))
    assert torch.equal(back["n"], -n)


# -- tensors kept from inside a torch.func transform ------------------------------------------


def _kept_from(transform):
    """The tensor a function saw inside ``transform``, kept past its end (a user's list)."""
    kept = []

    def f(x):
        kept.append(x)
        return (x * x).sum()

    x = torch.arange(32.0).reshape(8, 4)
    if transform == "vmap":
        torch.func.vmap(f)(torch.stack([x] * 2))
    elif transform == "grad":
        torch.func.grad(f)(x)
    elif transform == "jvp":
        torch.func.jvp(f, (x,), (torch.ones_like(x),))
    else:  # grad inside vmap: a grad wrapper around a batched tensor
        torch.func.vmap(torch.func.grad(f))(torch.stack([x] * 2))
    return kept[-1]


VMAPPED = (
    "host_arrays['x']: expected a host tensor, but got a tensor batched by torch.func.vmap and "
    "kept from inside the vmapped function (there of shape (8, 4), its batch dimension taken "
    "off): it has no memory of its own, and outside the transform torch cannot read its "
    "values. Return it from the vmapped function (vmap stacks what the function returns into a "
    "plain tensor) and pass that, or pass the tensor vmap was given."
)


@pytest.mark.parametrize("transform", ["vmap", "grad-in-vmap"])
def test_a_tensor_kept_from_inside_vmap_is_refused(transform, mesh8):
    """Before: ``NotImplementedError: Cannot access storage of BatchedTensorImpl`` (or of
    ``TensorWrapper``) from the leaf checks, naming nothing."""
    import torchshard as ts

    leaf = _kept_from(transform)
    with mesh8:
        with pytest.raises(TypeError, match=re.escape(VMAPPED)):
            ts.host_to_global_array({"x": leaf}, partition=ts.P("data"))
        with pytest.raises(
            TypeError, match=re.escape(VMAPPED.replace("host_arrays", "host_specs"))
        ):
            ts.host_to_global_specs({"x": leaf}, partition=ts.P("data"))
        loader = ts.GlobalBatchLoader([{"x": leaf}], partition=ts.P("data"))
        with pytest.raises(TypeError, match=re.escape(VMAPPED.replace("host_arrays", "batch"))):
            next(iter(loader))
        loader.close()


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_a_tensor_kept_from_inside_grad_is_placed_with_its_values(transform, mesh8):
    """Once ``grad``/``jvp`` has returned, the wrapper it left reads as its values (torch
    itself reads it so): placed like any tensor. Before: ``NotImplementedError: Cannot
    access storage of TensorWrapper``."""
    import torchshard as ts

    leaf = _kept_from(transform)
    want = torch.arange(32.0).reshape(8, 4)
    with mesh8:
        g = ts.host_to_global_array({"x": leaf}, partition=ts.P("data"))
        assert torch.equal(ts.global_to_host_array(g)["x"], want)
        (batch,) = ts.GlobalBatchLoader([{"x": leaf}], partition=ts.P("data"))
        assert torch.equal(ts.global_to_host_array(batch)["x"], want)
