"""``TensorSpec``: the shape, dtype and (optional) sharding of an array, without data."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchshard._core import checks
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
        object.__setattr__(self, "shape", checks.shape(self.shape, "TensorSpec"))
