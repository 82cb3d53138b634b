"""``TensorSpec`` (torchshard._core.tensor_spec): shape, dtype and optional sharding of an
array without data; a frozen value, always a leaf, its shape checked and made a tuple of ints.
The shape errors' texts are in tests/cross/test_failure_modes.py."""

import dataclasses
import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import NamedSharding
from torchshard._core.tensor_spec import TensorSpec
from torchshard._core.tree import flatten


def test_the_public_name_is_this_class():
    assert ts.TensorSpec is TensorSpec


def test_fields_and_defaults():
    spec = TensorSpec([8, np.int64(3)], torch.float32)
    assert spec.shape == (8, 3) and all(type(n) is int for n in spec.shape)
    assert spec.dtype is torch.float32 and spec.sharding is None
    assert repr(spec) == "TensorSpec(shape=(8, 3), dtype=torch.float32, sharding=None)"
    assert TensorSpec((), np.float32).shape == ()


def test_a_frozen_value():
    sharding = NamedSharding(Mesh(np.arange(8), ("data",)), ts.P("data"))
    a = TensorSpec((8,), torch.int8, sharding)
    assert a == TensorSpec(
        (8,), torch.int8, NamedSharding(Mesh(np.arange(8), ("data",)), ts.P("data"))
    )
    assert a != TensorSpec((8,), torch.int8) and a != TensorSpec((8,), torch.int16, sharding)
    assert hash(a) == hash(TensorSpec((8,), torch.int8, sharding))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.shape = (4,)
    assert dataclasses.replace(a, shape=[4]).shape == (4,)  # replace checks the shape again


def test_always_a_leaf():
    tree = {"a": TensorSpec((2, 2), torch.float32), "b": [TensorSpec((1,), torch.bool)]}
    leaves, _ = flatten(tree)
    assert leaves == [tree["a"], tree["b"][0]]


def test_the_shape_check_names_tensorspec():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "TensorSpec: every size of a shape must be >= 0, but dim 0 of (-8,) is -8."
        ),
    ):
        TensorSpec((-8,), torch.float32)
    with pytest.raises(TypeError, match=re.escape("TensorSpec: expected a shape")):
        TensorSpec(None, torch.float32)
