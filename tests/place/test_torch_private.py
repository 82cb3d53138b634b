"""``_place/_torch_private.py``: torch's private names behind two predicates."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchshard._place._torch_private import (
    functorch_wrapper,
    in_functorch_transform,
    is_fake_tensor,
)


def test_is_fake_tensor():
    with FakeTensorMode():
        fake = torch.zeros(2, 3)
    assert is_fake_tensor(fake)
    assert not is_fake_tensor(torch.zeros(2, 3))
    assert not is_fake_tensor([1, 2])


def test_in_functorch_transform():
    seen = []

    def f(x):
        seen.append(in_functorch_transform())
        return (x * x).sum()

    assert not in_functorch_transform()
    torch.func.grad(f)(torch.ones(3))
    torch.func.vmap(lambda x: (seen.append(in_functorch_transform()), x)[1])(torch.ones(2, 3))
    assert seen == [True, True]


# torch >= 2.13's jvp loads its decompositions through torch.jit.script, deprecated there
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_functorch_wrapper():
    kept = []

    def f(x):
        kept.append(x)
        return x.sum()

    torch.func.vmap(f)(torch.ones(2, 3))
    torch.func.grad(f)(torch.ones(3))
    torch.func.jvp(f, (torch.ones(3),), (torch.ones(3),))
    torch.func.functionalize(lambda x: f(x) * 1)(torch.ones(3))
    assert [functorch_wrapper(t) for t in kept] == ["vmap", "grad", "grad", None]
    assert functorch_wrapper(torch.ones(3)) is None
