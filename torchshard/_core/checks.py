"""The checks several arguments share, each with one wording: counts, shapes, host groups.

Every message names the argument (or the tree path) first, then the rule, then what was found.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from torchshard._core.errors import at


def _as_int(value: Any) -> int | None:
    """``value`` as an int when it is one (a Python or numpy integer, never a bool or a float,
    which would be rounded), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _as_whole(value: Any) -> int | None:
    """The int that ``value`` would stand for as a size, for a fix to suggest (never to use):
    an int, a bool (``True``: 1) or a float that is a whole number; else ``None``."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    size = _as_int(value)
    if size is not None:
        return size
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    return None


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int; ``ValueError`` naming ``name`` unless it is an int >= 1."""
    n = _as_int(value)
    if n is None or n < 1:
        raise ValueError(f"{name} must be a positive int, but got {value!r}.")
    return n


def nonnegative_int(value: Any, name: str) -> int:
    """``value`` as an int; ``ValueError`` naming ``name`` unless it is an int >= 0."""
    n = _as_int(value)
    if n is None or n < 0:
        raise ValueError(f"{name} must be an int >= 0, but got {value!r}.")
    return n


def shape(value: Any, where: object) -> tuple[int, ...]:
    """``value`` as a shape (a tuple of ints >= 0); raises naming ``where``: ``TypeError`` for
    something that is not a sequence or a size that is not an int (fractional sizes are not
    rounded), ``ValueError`` for a negative size."""
    if isinstance(value, (str, bytes)):
        dims = None
    else:
        try:
            dims = tuple(value)
        except TypeError:
            dims = None
    if dims is None:
        raise TypeError(
            at(
                where,
                f"expected a shape (a sequence of ints >= 0), but got {value!r} of type "
                f"{type(value).__name__}.",
            )
        )
    out = []
    for i, n in enumerate(dims):
        size = _as_int(n)
        if size is None:
            if isinstance(n, (bool, np.bool_)):
                why = "a bool is not a size"
            elif isinstance(n, (float, np.floating)):
                why = "sizes count elements: nothing is rounded"
            else:
                why = "sizes count elements: nothing is converted"
            whole = [_as_whole(v) for v in dims]
            fix = (
                f"pass {tuple(whole)!r} if that is the shape meant"
                if None not in whole
                else "pass one int per dimension"
            )
            raise TypeError(
                at(
                    where,
                    f"every size of a shape must be an int, but dim {i} of {dims!r} is {n!r} of "
                    f"type {type(n).__name__} ({why}); {fix}.",
                )
            )
        if size < 0:
            raise ValueError(
                at(where, f"every size of a shape must be >= 0, but dim {i} of {dims!r} is {n}.")
            )
        out.append(size)
    return tuple(out)


def contiguous_hosts(num_devices: int, num_hosts: Any, *, where: str = "") -> tuple[int, ...]:
    """The device -> host map of ``num_hosts`` equal, contiguous groups of device ids (device
    ``d`` on host ``d // (num_devices // num_hosts)``), as ``virtual_hosts`` and TPU pods lay
    them out; ``TypeError``/``ValueError`` naming ``where`` unless ``num_hosts`` is a positive
    int that divides ``num_devices``."""
    n = _as_int(num_hosts)
    if n is None:
        raise TypeError(
            at(
                where,
                f"num_hosts must be an int, but got {num_hosts!r} of type "
                f"{type(num_hosts).__name__}.",
            )
        )
    if n < 1 or num_devices % n:
        raise ValueError(
            at(
                where,
                f"num_hosts must be a positive divisor of the {num_devices} devices, but got "
                f"{n}; each host owns an equal, contiguous group of device ids.",
            )
        )
    per = num_devices // n
    return tuple((np.arange(num_devices) // per).tolist())  # numpy: a pod has 16,384 devices
