"""``_place/_torch_private.py``: torch's private names behind two predicates."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchshard._place._torch_private import in_functorch_transform, is_fake_tensor


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
