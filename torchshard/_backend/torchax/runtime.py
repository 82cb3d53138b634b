"""JAX and torchax themselves: their import, the devices of the run and their owners, and the
conversions between CPU tensors, numpy arrays and torchax tensors.

With ``_jax_private.py``, the only modules that import JAX or torchax; both are imported on
first use, not with this module (torchshard's other backends never load them).

**Device ids.** torchshard's meshes are grids of ints. JAX numbers its devices per process
(process 1 of a 2-process CPU run has ids 2048-2051), so torchshard's id ``i`` is the ``i``-th
device of ``jax.devices()`` ordered by ``(process_index, id)``: the ids are ``0..N-1``, each
process's a contiguous run, as on the other backends.

**64-bit values.** JAX holds no 64-bit values unless ``jax_enable_x64`` is on (its default is
off): there, ``jax.device_put`` of an int64 array makes int32 values silently, wrapping the ones
that do not fit. torchshard places a 64-bit integer leaf as its 32-bit type when every value
fits (checked on the host, per call) and refuses it otherwise; it refuses float64 and complex128
leaves (a narrowing would round them). With ``jax_enable_x64`` on, every dtype moves as it is.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend.protocols import Refused
from torchshard._core.errors import MissingDependencyError, ShardingError
from torchshard._core.topology import Topology
from torchshard._core.version import pip_install

INSTALL = pip_install("torchax")
FEATURE = "the torchax backend (PyTorch on JAX)"


def _import_error(package: str, e: BaseException) -> MissingDependencyError:
    import torch

    version = torch.__version__.split("+")[0]
    if isinstance(e, ImportError) and getattr(e, "name", None) in (package, None):
        cause = "is not installed"
    else:
        cause = f"cannot be imported on torch {version} ({type(e).__name__}: {str(e)[:160]})"
    return MissingDependencyError(
        f"{FEATURE} needs {package}, which {cause}; install the extra with {INSTALL} (jax and "
        "torchax: torchax 0.0.13 fails to import on torch >= 2.13, its 0.0.14 nightlies work)."
    )


@functools.cache
def jax() -> Any:
    """``jax``, imported (``MissingDependencyError`` naming the extra when it is missing)."""
    try:
        import jax
    except ImportError as e:
        raise _import_error("jax", e) from None
    return jax


@functools.cache
def torchax() -> Any:
    """``torchax`` (with ``torchax.interop`` and ``torchax.tensor``), imported."""
    jax()
    try:
        import torchax
        import torchax.interop
        import torchax.tensor
    except Exception as e:  # noqa: BLE001 -- torchax 0.0.13 raises at import on torch >= 2.13
        raise _import_error("torchax", e) from None
    return torchax


@functools.cache
def tensor_types() -> tuple[type, ...]:
    """The classes of torchax's tensors: ``torchax.tensor.Tensor`` and its lazy ``View``."""
    tx = torchax()
    types: list[type] = [tx.tensor.Tensor]
    view = getattr(getattr(tx, "view", None), "View", None)
    if isinstance(view, type):
        types.append(view)
    return tuple(types)


def is_torchax_tensor(x: Any) -> bool:
    return isinstance(x, tensor_types())


def array_of(x: Any) -> Any:
    """The ``jax.Array`` (or tracer) under the torchax tensor ``x``."""
    return x.jax()


def as_tensor(array: Any) -> torch.Tensor:
    """``array`` (a ``jax.Array``) as a torchax tensor, without a copy (what
    ``torchax.interop.torch_view`` makes of one array, without its tree walk)."""
    return _wrap()(array)


@functools.cache
def _wrap() -> Any:
    tx = torchax()
    cls, env = tx.tensor.Tensor, tx.default_env()
    return lambda array: cls(array, env)


# -- devices -------------------------------------------------------------------------------

CPU_COUNT_FLAG = "--xla_force_host_platform_device_count"


def setup_cpu_devices(count: int) -> bool:
    """Asks JAX for ``count`` CPU devices (``XLA_FLAGS``, read when JAX makes its CPU client),
    where that can still take effect: JAX not imported yet, and no other platform named by
    ``JAX_PLATFORMS`` (a TPU's chips are its devices). Whether it was set."""
    import os
    import sys

    if "jax" in sys.modules or os.environ.get("JAX_PLATFORMS", "").strip() not in ("", "cpu"):
        return False
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(CPU_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{CPU_COUNT_FLAG}={count}"])
    return True


_LOCK = threading.Lock()


@functools.cache
def devices() -> tuple[Any, ...]:
    """Every device of the run, in torchshard's order: by owning process, then JAX's id."""
    found = jax().devices()
    return tuple(sorted(found, key=lambda d: (d.process_index, d.id)))


@functools.cache
def device_index() -> dict[Any, int]:
    """JAX device -> torchshard's device id."""
    return {d: i for i, d in enumerate(devices())}


@functools.cache
def topology() -> Topology:
    """The run's topology (JAX knows each device's process: no collective)."""
    j = jax()
    owners = tuple(int(d.process_index) for d in devices())
    return Topology(int(j.process_index()), int(j.process_count()), owners)


@functools.cache
def local_devices() -> tuple[int, ...]:
    """This process's device ids, ascending (the order ``make_global`` takes shards)."""
    return topology().devices_of(topology().process_index)


@functools.cache
def cpu_devices() -> bool:
    """Whether the devices are JAX's CPU devices (buffers in this process's memory)."""
    return all(d.platform == "cpu" for d in devices())


# -- dtypes ----------------------------------------------------------------------------------


def x64() -> bool:
    """Whether JAX holds 64-bit values (``jax_enable_x64``, read on the calling thread)."""
    return bool(jax().config.read("jax_enable_x64"))


_NARROW = {torch.int64: np.int32, torch.uint64: np.uint32}
_WIDE_FLOATS = {torch.float64: "float32", torch.complex128: "complex64"}

X64_FIX = 'jax.config.update("jax_enable_x64", True) at the start of the program'


def check_dtype(dtype: torch.dtype) -> None:
    """Refuses a float dtype JAX would round, float64 and complex128 while ``jax_enable_x64``
    is off (``Refused`` of a ``TypeError``: placement adds the leaf's path)."""
    narrow = _WIDE_FLOATS.get(dtype)
    if narrow is not None and not x64():
        raise Refused(
            TypeError(
                f"a {str(dtype).removeprefix('torch.')} leaf, but JAX holds no 64-bit floats "
                "while jax_enable_x64 is off (its default): it would round every value to "
                f"{narrow}. Cast on the host (x.to(torch.{narrow}), x.astype(np.{narrow})), or "
                f"turn 64-bit values on: {X64_FIX}."
            )
        )


def host_converter(dtype: torch.dtype) -> Callable[[torch.Tensor], np.ndarray]:
    """``host_array`` for CPU tensors of ``dtype``, with the dtype's checks made once (a
    ``Refused`` for a dtype JAX would round): a leaf's shards share its dtype."""
    if dtype == torch.bfloat16 or (dtype in _NARROW and not x64()):
        return host_array
    check_dtype(dtype)
    return torch.Tensor.numpy


def host_array(t: torch.Tensor) -> np.ndarray:
    """The CPU tensor ``t`` as a numpy array JAX takes: a view where the dtypes match
    (bfloat16 through ``ml_dtypes``); a 64-bit integer tensor narrowed to 32 bits (a copy)
    while ``jax_enable_x64`` is off, after checking that every value fits."""
    dtype = t.dtype
    if dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jax().numpy.bfloat16)
    if dtype in _NARROW and not x64():
        return narrowed(t.numpy(), _NARROW[dtype])
    check_dtype(dtype)
    return t.numpy()


def narrowed(a: np.ndarray, to: Any) -> np.ndarray:
    """``a`` (64-bit integers) as ``to`` (32-bit), refusing values that do not fit."""
    if a.size:
        info = np.iinfo(to)
        lo, hi = a.min(), a.max()
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise Refused(
                ShardingError(
                    f"a {a.dtype} leaf holds the value {int(bad)}, which does not fit in "
                    f"{np.dtype(to)}: JAX holds no 64-bit integers while jax_enable_x64 is off "
                    f"(its default), and torchshard places such a leaf as {np.dtype(to)} only "
                    "when every value fits (JAX itself would wrap it silently). Turn 64-bit "
                    "values on: "
                    f"{X64_FIX}."
                )
            )
    return a.astype(to)


def placed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a leaf of ``dtype`` has once placed (64-bit integers narrowed without x64)."""
    if dtype == torch.int64 and not x64():
        return torch.int32
    return dtype


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A host copy of the numpy array ``a`` (from a device) as a CPU tensor that owns it."""
    if a.dtype == jax().numpy.bfloat16:
        return torch.from_numpy(np.array(a.view(np.int16), copy=True)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


def fetch(arrays: Sequence[Any]) -> list[np.ndarray]:
    """Device -> host for several single-device arrays at once (``jax.device_get``: the
    copies start together)."""
    return list(jax().device_get(list(arrays)))
