"""``TensorSpec``: the shape, dtype and (optional) sharding of an array, without data."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from torchshard._core.sharding import NamedSharding
from torchshard._core.tree import register_leaf_type


@register_leaf_type
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a (host or global) array; always a leaf of a tree.

    Example:
        >>> torchshard.TensorSpec((8, 3), torch.float32)
        TensorSpec(shape=(8, 3), dtype=torch.float32, sharding=None)
    """

    shape: tuple[int, ...]
    dtype: Any
    sharding: NamedSharding | None = None

    def __post_init__(self) -> None:
        try:
            dims = tuple(self.shape)
        except TypeError:
            raise TypeError(
                f"TensorSpec: shape must be a sequence of ints, but got {self.shape!r}."
            ) from None
        for i, n in enumerate(dims):
            size = None if isinstance(n, bool) else _as_size(n)  # never a rounded float
            if size is None:
                raise TypeError(
                    f"TensorSpec: every size of shape must be an int, but dim {i} of {dims!r} is "
                    f"{n!r} of type {type(n).__name__}; sizes count elements (nothing is "
                    "rounded)."
                )
            if size < 0:
                raise ValueError(
                    f"TensorSpec: every size of shape must be >= 0, but dim {i} of {dims!r} is "
                    f"{size}."
                )
        object.__setattr__(self, "shape", tuple(operator.index(n) for n in dims))


def _as_size(n: Any) -> int | None:
    """``n`` as an int when it is one (a Python or numpy integer), else ``None``."""
    try:
        return operator.index(n)
    except TypeError:
        return None
