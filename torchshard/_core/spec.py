"""Partition specs: ``PartitionSpec`` (alias ``P``), ``UNCONSTRAINED`` and ``DataPartitionType``.

A ``PartitionSpec`` says, for each leading dimension of an array, which mesh axes split it:
``None`` (not split), an axis name, or a tuple of axis names (major to minor). It is an
immutable tuple subclass and compares equal to the same plain tuple. Standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Final


class _Unconstrained:
    """The type of ``PartitionSpec.UNCONSTRAINED``: "no opinion" on a dimension."""

    _instance: _Unconstrained | None = None

    def __new__(cls) -> _Unconstrained:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCONSTRAINED"

    def __reduce__(self) -> str:
        return "UNCONSTRAINED"


UNCONSTRAINED: Final = _Unconstrained()

Entry = None | str | tuple[str, ...] | _Unconstrained


def _canonical_entry(entry: Any, position: int) -> Entry:
    if entry is None or entry is UNCONSTRAINED or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        if not entry:  # JAX: an empty tuple splits over no axis, i.e. not split
            return None
        if not all(isinstance(a, str) for a in entry):
            raise TypeError(
                f"PartitionSpec entry {position} must be None, an axis name or a tuple of axis "
                f"names, but got {entry!r} (an element is not a str)."
            )
        # JAX: a tuple of one axis is that axis (P(("x",)) == P("x"), the same hash)
        return entry[0] if len(entry) == 1 else tuple(entry)
    raise TypeError(
        f"PartitionSpec entry {position} must be None, an axis name or a tuple of axis names, "
        f"but got {entry!r} of type {type(entry).__name__}."
    )


class PartitionSpec(tuple):
    """How each leading dimension of an array is split over the axes of a mesh.

    Entries are ``None`` (dimension not split), an axis name, or a tuple of axis names
    (the dimension is split over their product, the first axis major). As in JAX, an empty
    tuple is ``None`` and a tuple of one axis is that axis: ``P((), "x") == P(None, "x")`` and
    ``P(("x",)) == P("x")``, with the same hashes. A spec may be
    shorter than the array's rank: the remaining dimensions are not split. An axis may be
    used at most once. ``PartitionSpec.UNCONSTRAINED`` (only for ``maybe_shard``) leaves a
    dimension to the compiler.

    Example:
        >>> from torchshard import P
        >>> P("data", None) == ("data", None)
        True
        >>> P(("data", "model"))
        P(('data', 'model'),)
    """

    __slots__ = ()
    UNCONSTRAINED: Final = UNCONSTRAINED

    def __new__(cls, *entries: Any) -> PartitionSpec:
        canonical = tuple(_canonical_entry(e, i) for i, e in enumerate(entries))
        seen: dict[str, int] = {}
        for i, entry in enumerate(canonical):
            for axis in spec_entry_axes(entry):
                if axis in seen:
                    raise ValueError(
                        f"PartitionSpec {canonical!r} uses mesh axis {axis!r} twice "
                        f"(entries {seen[axis]} and {i}); each axis may split at most one "
                        "dimension."
                    )
                seen[axis] = i
        return super().__new__(cls, canonical)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("Subclassing PartitionSpec is not supported.")

    def __repr__(self) -> str:
        inner = ", ".join(repr(e) for e in self)
        return f"P({inner},)" if len(self) == 1 else f"P({inner})"

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return (PartitionSpec, tuple(self))

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec names, in order."""
        return tuple(a for e in self for a in spec_entry_axes(e))


P = PartitionSpec


def spec_entry_axes(entry: Entry) -> tuple[str, ...]:
    """The axis names of one spec entry: ``()`` for ``None``/``UNCONSTRAINED``."""
    if entry is None or entry is UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)  # type: ignore[arg-type]


def as_partition_spec(spec: Iterable[Any] | PartitionSpec) -> PartitionSpec:
    """``spec`` as a ``PartitionSpec`` (a plain sequence of entries is wrapped)."""
    if isinstance(spec, PartitionSpec):
        return spec
    if isinstance(spec, str):
        return PartitionSpec(spec)
    return PartitionSpec(*spec)


class DataPartitionType(enum.Enum):
    """How an input batch is partitioned (axlearn's enum; axlearn compatibility: new code
    passes a ``PartitionSpec``, e.g. ``input_partition_spec()``).

    - ``FULL``: dim 0 is split over every mesh axis (``input_partition_spec()``).
    - ``REPLICATED``: every device holds the whole array.
    - ``BATCH``: dim 0 over the batch axes (``data``, ``fsdp``), dim 1 over ``seq``.
    """

    FULL = "full"
    REPLICATED = "replicated"
    BATCH = "batch"
