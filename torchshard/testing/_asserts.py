"""Assertions on global tensors, checked against the shards the runtime itself reports.

The oracle is the backend's own per-device shard indices (torch_xla's
``_get_local_shard_replica_and_indices``, via ``ReadBack.local_shards``; this materialises
lazy tensors), compared with ``NamedSharding(mesh, spec).devices_indices_map``. Only this
process's devices are compared (all of them on one host or under ``virtual_hosts``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend.protocols import Backend, LocalShard
from torchshard._backend.registry import lookup
from torchshard._core import mesh as value
from torchshard._core.context import current_mesh
from torchshard._core.errors import NoMeshError, at
from torchshard._core.sharding import NamedSharding
from torchshard._core.spec import PartitionSpec, as_partition_spec
from torchshard._mesh.mesh import Mesh

_MAX_ROWS = 16  # mismatching devices listed in a message
Ranges = tuple[tuple[int, int], ...]


def format_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    """``((0, 4), (0, 8))`` as ``[0:4, 0:8]`` (numpy slice notation)."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in ranges) + "]"


def _as_ranges(index: Sequence[slice]) -> Ranges:
    return tuple((int(s.start), int(s.stop)) for s in index)


def _check_global(backend: Backend, tensor: Any, caller: str, argname: str) -> None:
    if not backend.place.is_global(tensor):
        got = (
            f"a tensor on {tensor.device}"
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        raise TypeError(
            at(
                caller,
                f"{argname} must be a global tensor of the {backend.name!r} backend (an "
                f"XLA tensor, e.g. from torchshard.host_to_global_array), but got {got}.",
            )
        )


def _split_summary(ranges: Sequence[Ranges], shape: tuple[int, ...]) -> str:
    """How many blocks each dimension is cut into, e.g. ``dim 0 in 4 blocks, dim 1 whole``."""
    parts = []
    for i, n in enumerate(shape):
        k = len({r[i] for r in ranges})
        parts.append(f"dim {i} whole" if k == 1 and n > 0 else f"dim {i} in {k} blocks")
    return ", ".join(parts) if parts else "a scalar"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]


def assert_sharded(
    tensor: torch.Tensor, spec: PartitionSpec | Sequence[Any] | None, mesh: Mesh | None = None
) -> None:
    """Asserts that ``tensor`` is laid out on the devices exactly as ``spec`` says.

    Every local device's block, as the runtime reports it, must equal the block
    ``NamedSharding(mesh, spec).devices_indices_map`` names; otherwise the ``AssertionError``
    lists, for each mismatching device, the expected and the actual block. A tensor with no
    sharding at all (moved with ``.to()`` and never annotated) is whole on every device: it
    passes for a replicated spec and fails for any split.

    Args:
        tensor: a global (XLA) tensor.
        spec: the expected partition spec (``None`` or ``P()``: replicated).
        mesh: the mesh of ``spec`` (default: the current mesh).

    Example:
        >>> from torchshard import P
        >>> from torchshard.testing import assert_sharded
        >>> with torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model")):
        ...     g = torchshard.host_to_global_array(np.zeros((16, 8)), partition=P("data"))
        ...     assert_sharded(g, P("data"))  # passes
        ...     assert_sharded(g, P("data", "model"))
        Traceback (most recent call last):
        ...
        AssertionError: tensor of shape (16, 8) is not sharded as P('data', 'model') on
        Mesh({'data': 4, 'model': 2}).
        Expected dim 0 in 4 blocks, dim 1 in 2 blocks; torch_xla holds dim 0 in 4 blocks, dim 1
        whole.
        8 of 8 devices hold another block:
          device  expected      actual
          0       [0:4, 0:4]    [0:4, 0:8]
          1       [0:4, 4:8]    [0:4, 0:8]
        ...
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this helper's body
    active: value.Mesh | None = mesh if mesh is not None else current_mesh()
    if active is None:
        raise NoMeshError(
            "assert_sharded: no mesh was given and there is no current mesh in this thread; "
            "pass mesh=... or call it inside `with mesh:`."
        )
    spec = as_partition_spec(() if spec is None else spec)
    backend = lookup(active)
    _check_global(backend, tensor, "assert_sharded", "tensor")
    shape = tuple(int(n) for n in tensor.shape)
    sharding = NamedSharding(active, spec)
    expected = {d: _as_ranges(i) for d, i in sharding.devices_indices_map(shape).items()}
    where = f"tensor of shape {shape} is not sharded as {spec!r} on {active!r}"
    exp_summary = _split_summary(list(expected.values()), shape)
    whole = tuple((0, n) for n in shape)
    if not backend.read.is_sharded(tensor):
        if all(r == whole for r in expected.values()):
            return
        raise AssertionError(
            at(
                where,
                f"it carries no sharding at all (moved to the device and never annotated), "
                f"so every device holds the whole array, but {spec!r} expects {exp_summary}. Place "
                "it with torchshard.host_to_global_array(..., partition=spec) or annotate it.",
            )
        )
    actual = {s.device: s.ranges for s in backend.read.local_shards([tensor])[0]}
    strangers = sorted(set(actual) - set(expected))
    if strangers:
        raise AssertionError(
            at(
                where,
                f"the tensor lives on devices {strangers}, which are not in the mesh "
                f"(devices {sorted(expected)}).",
            )
        )
    bad = [d for d in sorted(actual) if actual[d] != expected[d]]
    if not bad:
        return
    if all(r == whole for r in actual.values()):
        found = f"torch_xla holds it replicated: every device has the whole {shape} array"
    else:
        found = f"torch_xla holds {_split_summary(list(actual.values()), shape)}"
    rows: list[tuple[str, ...]] = [("device", "expected", "actual")]
    rows += [(str(d), format_ranges(expected[d]), format_ranges(actual[d])) for d in bad]
    lines = [
        f"{where}.",
        f"Expected {exp_summary}; {found}.",
        f"{len(bad)} of {len(actual)} devices hold another block:",
        *_table(rows[: _MAX_ROWS + 1]),
    ]
    if len(bad) > _MAX_ROWS:
        lines.append(f"  ... and {len(bad) - _MAX_ROWS} more devices")
    if len(actual) < active.size:
        lines.append(f"(compared this process's {len(actual)} of {active.size} devices)")
    raise AssertionError("\n".join(lines))


def _expected_tensor(expected: Any) -> torch.Tensor:
    if isinstance(expected, torch.Tensor):
        if expected.device.type != "cpu":
            raise TypeError(
                "assert_global_equal: expected must be a host value (numpy array or CPU "
                f"tensor), but got a tensor on {expected.device}."
            )
        return expected
    arr = np.asarray(expected)
    if arr.dtype == object or arr.dtype.kind in "USV":
        raise TypeError(
            f"assert_global_equal: expected must be numeric, but got a numpy array of dtype "
            f"{arr.dtype}."
        )
    if not arr.dtype.isnative:  # torch takes native byte order only (">f4" failed inside it)
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(arr))


def _equal_mask(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    if got.dtype.is_floating_point or got.dtype.is_complex:
        return torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    return got == want


def assert_global_equal(
    global_tensor: torch.Tensor, expected: Any, *, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Asserts that a global tensor holds ``expected`` (the full global value), shard by shard.

    Each local device's block is read back (no all-gather) and compared with the same slice of
    ``expected``; the ``AssertionError`` names every mismatching device, its global slice, how
    many elements differ and the first one. Exact by default (NaN equals NaN); ``rtol``/``atol``
    compare floats with ``torch.isclose``.

    Args:
        global_tensor: a global (XLA) tensor.
        expected: the full global value: a numpy array or a CPU tensor of the same shape and
            dtype.
        rtol: relative tolerance for floating dtypes.
        atol: absolute tolerance for floating dtypes.

    Example:
        >>> from torchshard.testing import assert_global_equal
        >>> x = np.arange(16.0).reshape(8, 2)
        >>> with torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model")):
        ...     g = torchshard.host_to_global_array(x, partition=torchshard.P("data"))
        ...     assert_global_equal(g, x)  # passes: on one host, the global value is x
        ...     assert_global_equal(g + 1, x)
        Traceback (most recent call last):
        ...
        AssertionError: assert_global_equal: 8 of 8 device shards differ from expected (global
        shape (8, 2), torch.float64):
          device 0 holds [0:2, 0:2]: 4 of 4 elements differ; first at [0, 0]: got 1.0, expected 0.0
        ...
    """
    __tracebackhide__ = True
    backend = lookup(current_mesh())
    _check_global(backend, global_tensor, "assert_global_equal", "global_tensor")
    want = _expected_tensor(expected)
    shape = tuple(int(n) for n in global_tensor.shape)
    if tuple(want.shape) != shape:
        raise AssertionError(
            f"assert_global_equal: the global tensor has shape {shape}, but expected has shape "
            f"{tuple(want.shape)}."
        )
    if want.dtype != global_tensor.dtype:
        raise AssertionError(
            f"assert_global_equal: the global tensor has dtype {global_tensor.dtype}, but "
            f"expected has dtype {want.dtype}; cast expected to compare values."
        )
    if backend.read.is_sharded(global_tensor):
        shards = backend.read.local_shards([global_tensor])[0]
    else:  # no sharding: the whole value on every device; .cpu() is no gather
        whole = tuple((0, n) for n in shape)
        shards = [LocalShard(-1, whole, backend.read.gather(global_tensor))]
    bad = []
    for s in shards:
        index = tuple(slice(a, b) for a, b in s.ranges)
        block = want[index]
        mask = _equal_mask(s.data, block, rtol, atol)
        if bool(mask.all()):
            continue
        wrong = (~mask).nonzero()
        first = tuple(int(i) for i in wrong[0]) if wrong.numel() else ()
        at = tuple(a + i for (a, _), i in zip(s.ranges, first, strict=True))
        dev = "every device (unsharded)" if s.device < 0 else f"device {s.device}"
        bad.append(
            f"  {dev} holds {format_ranges(s.ranges)}: {wrong.shape[0]} of "
            f"{math.prod(s.data.shape)} elements differ; first at {list(at)}: got "
            f"{s.data[first].item()!r}, expected {block[first].item()!r}"
        )
    if bad:
        head = (
            f"assert_global_equal: {len(bad)} of {len(shards)} device shards differ from "
            f"expected (global shape {shape}, {global_tensor.dtype}):"
        )
        raise AssertionError("\n".join([head, *bad]))
