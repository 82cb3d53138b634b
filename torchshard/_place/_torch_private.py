"""torch's private names that placement needs, in one place (checked on torch 2.9 and 2.14.1).

torch has no public predicate for a fake tensor, for a tensor a ``torch.func`` transform wrapped,
nor for "inside a ``torch.func`` transform";
each use goes through a function here, so that a release that moves a name changes one module
(``tests/cross/test_layers.py`` keeps every other module off torch's private names). The
torch.distributed ones are in ``_backend/dtensor/_torch_private.py``.
"""

from __future__ import annotations

from typing import Any

import torch


def is_fake_tensor(x: Any) -> bool:
    """Whether ``x`` is a ``FakeTensor`` (made under ``FakeTensorMode``: a shape, no values)."""
    from torch._subclasses.fake_tensor import FakeTensor  # imported by torch itself

    return isinstance(x, FakeTensor)


def functorch_wrapper(x: torch.Tensor) -> str | None:
    """Which ``torch.func`` transform wrapped ``x`` and left it without memory of its own:
    ``"vmap"`` (a ``BatchedTensor``), ``"grad"`` (a grad-tracking ``TensorWrapper``: ``grad``,
    ``vjp``, ``jacrev``, ``jvp``); ``None`` for any other tensor (a ``functionalize`` wrapper
    reads as its values)."""
    functorch = torch._C._functorch
    if not functorch.is_functorch_wrapped_tensor(x):
        return None
    if functorch.is_batchedtensor(x):
        return "vmap"
    if functorch.is_gradtrackingtensor(x):
        return "grad"
    return None


def in_functorch_transform() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform (``grad``, ``vmap``, ...)."""
    return torch._C._functorch.maybe_current_level() is not None
