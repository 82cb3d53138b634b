"""The torchax backend (registered as ``"torchax"`` when imported): PyTorch on JAX. Global tensors
are torchax tensors, torch tensors whose values are ``jax.Array``s laid out by a
``NamedSharding``, which a torchax model consumes as they are.

One process drives several devices (as torch_xla), and several JAX processes form a job
(``jax.distributed.initialize``): process ``p`` supplies the blocks of its own devices. Placing
is JAX's own ``jax.make_array_from_callback`` (what ``jax.make_array_from_process_local_data``
calls) with each local device's block from torchshard's plan: no collective and no JAX
computation, so a loader's thread places batches under ``jax.thread_guard``. Reading back is
each addressable shard's data (``jax.device_get``) with its index; the whole value of an array
other processes hold parts of is JAX's ``process_allgather``, after a size check between the
processes. In the step, ``annotate`` is ``jax.lax.with_sharding_constraint`` (a reshard when
called eagerly), and dispatch gathers rows with ``jnp.take``.

The processes are compared through torchshard's exchange tree (``collective.py``,
``checks.py``), bootstrapped through JAX's coordination service: the agreement check, a loader
epoch's outcome and end-of-data exchanges, and the value check raise the DTensor backend's
errors on every process, within ``TORCHSHARD_JAX_TIMEOUT``.

This module is imported only when a mesh names the ``"torchax"`` backend (or a torchax tensor
meets dispatch or read-back). JAX and torchax themselves are reached through ``runtime.py``,
their meshes through ``mesh.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend.protocols import Backend, LocalShard, MakeGlobal
from torchshard._backend.registry import register
from torchshard._backend.torchax import collective
from torchshard._backend.torchax.checks import TorchaxChecks, check_sizes
from torchshard._backend.torchax.mesh import TorchaxMeshes, named_sharding, to_jax_mesh
from torchshard._backend.torchax.runtime import (
    array_of,
    as_tensor,
    cpu_devices,
    device_index,
    fetch,
    host_converter,
    is_torchax_tensor,
    jax,
    local_devices,
    to_torch,
    topology,
)
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes
from torchshard._core.topology import Topology

Ranges = tuple[tuple[int, int], ...]


def _ranges(index: Any, shape: Sequence[int]) -> Ranges:
    return tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(index, shape, strict=True))


def _is_tracer(array: Any) -> bool:
    return isinstance(array, jax().core.Tracer)


@functools.lru_cache(maxsize=4096)
def _positions(mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]) -> dict[Ranges, int]:
    """Per block (its global ranges) of the layout ``axes`` on ``mesh``, the position in
    ``local_devices`` order of the first local device that holds it: where the callback of
    ``make_array_from_callback`` finds a device's block among the shards torchshard passes."""
    sharding = named_sharding(mesh, axes)
    index = device_index()
    order = {d: p for p, d in enumerate(local_devices_of(mesh))}
    out: dict[Ranges, int] = {}
    for device, idx in sharding.devices_indices_map(global_shape).items():
        p = order.get(index[device])
        if p is not None:
            out.setdefault(_ranges(idx, global_shape), p)
    return out


def local_devices_of(mesh: Mesh | None) -> tuple[int, ...]:
    """The devices whose shards ``make_global`` takes: this process's (every device under a
    ``virtual_hosts`` emulation, where this process is every host)."""
    return local_devices()


class _Maker:
    """``make_global`` with the mesh, layout and shape bound (``global_maker``).

    JAX asks the callback for each addressable device's block by its index (a tuple of
    slices), taken from ``addressable_devices_indices_map``, which JAX caches per sharding and
    shape: the maker keeps that map's index tuples, so it finds a block's position by the
    tuple's identity (a dict lookup), and by its ranges only for a tuple it has not seen."""

    __slots__ = ("by_id", "indices", "positions", "shape", "sharding")

    def __init__(self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]) -> None:
        self.sharding = named_sharding(mesh, axes)
        self.shape = global_shape
        self.positions = _positions(mesh, axes, global_shape)
        # kept alive, so that no other object takes one of their ids
        self.indices = tuple(self.sharding.addressable_devices_indices_map(global_shape).values())
        self.by_id = {id(i): self.positions[_ranges(i, global_shape)] for i in self.indices}

    def __call__(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        positions, shape, by_id = self.positions, self.shape, self.by_id
        made: dict[int, np.ndarray] = {}
        host_array = host_converter(shards[0].dtype) if shards else _no_shards

        def block(index: Any) -> np.ndarray:
            p = by_id.get(id(index))
            if p is None:
                p = positions[_ranges(index, shape)]
            a = made.get(p)
            if a is None:
                a = made[p] = host_array(shards[p])
            return a

        return as_tensor(jax().make_array_from_callback(shape, self.sharding, block))

    def from_whole(self, t: torch.Tensor) -> torch.Tensor:
        """The global array from a host tensor that is all of it (one process, or a
        replicated leaf): JAX takes each device's block by its index (a numpy view)."""
        a = host_converter(t.dtype)(t)
        return as_tensor(jax().make_array_from_callback(self.shape, self.sharding, a.__getitem__))


def _no_shards(t: torch.Tensor) -> np.ndarray:
    raise AssertionError("a block asked of a maker given no shards")


# The integer dtype of each floating dtype's width, for take_rows (gathered bit for bit).
_SAME_WIDTH_INT = {
    "float16": "int16",
    "bfloat16": "int16",
    "float32": "int32",
    "float64": "int64",
}


@functools.cache
def _take() -> Any:
    j = jax()
    jnp, lax = j.numpy, j.lax

    def take(x: Any, index: Any) -> Any:
        ints = _SAME_WIDTH_INT.get(str(x.dtype))
        if ints is not None:  # integers add exactly in the partitioned gather's all-reduce
            y = jnp.take(lax.bitcast_convert_type(x, ints), index, axis=0)
            return lax.bitcast_convert_type(y, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            parts = _SAME_WIDTH_INT["float32" if x.dtype == jnp.complex64 else "float64"]
            re = jnp.take(lax.bitcast_convert_type(jnp.real(x), parts), index, axis=0)
            im = jnp.take(lax.bitcast_convert_type(jnp.imag(x), parts), index, axis=0)
            real = x.real.dtype
            return lax.complex(
                lax.bitcast_convert_type(re, real), lax.bitcast_convert_type(im, real)
            )
        return jnp.take(x, index, axis=0)

    return j.jit(take)


def _replicated_index(index: torch.Tensor, like: Any) -> Any:
    """The plain index tensor as a global array replicated over ``like``'s devices (the same on
    every process: it is the key's whole value)."""
    j = jax()
    values = index.detach().to("cpu", torch.int32).numpy()
    mesh = getattr(like.sharding, "mesh", None)
    if mesh is None:
        return j.numpy.asarray(values)
    sharding = j.sharding.NamedSharding(mesh, j.sharding.PartitionSpec())
    return j.make_array_from_callback(values.shape, sharding, lambda i: values[i])


class TorchaxRuntime:
    """PyTorch on JAX (one process per host, every local device driven by it): its
    ``Placement``, ``ReadBack`` and ``InStep``."""

    keeps_unconstrained_dims = True  # PartitionSpec.UNCONSTRAINED

    def topology(self) -> Topology:
        return topology()

    def local_devices(self, mesh: Mesh | None) -> Sequence[int]:
        return local_devices_of(mesh)

    def devices_in_host_memory(self) -> bool:
        return cpu_devices()

    def is_global(self, x: Any) -> bool:
        return is_torchax_tensor(x)  # inside a jitted step too (its value a tracer)

    def make_global(
        self,
        mesh: Mesh,
        axes: DimAxes,
        global_shape: tuple[int, ...],
        shards: Sequence[torch.Tensor],
        *,
        background: bool = False,
    ) -> torch.Tensor:
        # `background` changes nothing: JAX's transfers run without the GIL, and no JAX
        # computation runs here (jax.thread_guard allows a loader's thread to place).
        return _Maker(mesh, axes, global_shape)(shards)

    def global_maker(self, mesh: Mesh, axes: DimAxes, global_shape: tuple[int, ...]) -> MakeGlobal:
        return _Maker(mesh, axes, global_shape)

    def local_ranges(self, x: torch.Tensor) -> dict[int, Ranges] | None:
        array = array_of(x)
        shape = tuple(array.shape)
        index = device_index()
        return {
            index[d]: _ranges(idx, shape)
            for d, idx in array.sharding.addressable_devices_indices_map(shape).items()
        }

    # -- ReadBack ------------------------------------------------------------------------------

    def is_sharded(self, x: torch.Tensor) -> bool:
        return True  # a jax.Array always has a sharding

    def local_shards(self, tensors: Sequence[torch.Tensor]) -> list[list[LocalShard]]:
        index = device_index()
        per: list[list[tuple[int, Ranges]]] = []
        datas: list[Any] = []
        for x in tensors:
            array = array_of(x)
            shape = tuple(array.shape)
            mine = []
            for shard in array.addressable_shards:
                mine.append((index[shard.device], _ranges(shard.index, shape)))
                datas.append(shard.data)
            per.append(mine)
        hosts = iter(fetch(datas))  # every shard's copy started at once
        return [[LocalShard(d, r, to_torch(next(hosts))) for d, r in mine] for mine in per]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        what = "replicate_to_local_data"
        array = array_of(x)
        if array.is_fully_addressable:
            return to_torch(np.asarray(jax().device_get(array)))
        check_sizes(array, what)  # before the computation, whatever the agreement switch says
        from jax.experimental import multihost_utils

        with collective.guarded(f"{what}: gathering an array of shape {tuple(array.shape)}"):
            return to_torch(np.asarray(multihost_utils.process_allgather(array, tiled=True)))

    # -- InStep ----------------------------------------------------------------------------------

    def annotate(
        self, x: torch.Tensor, mesh: Mesh, axes: DimAxes, *, keep: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        if not is_torchax_tensor(x):
            raise TypeError(
                f"the torchax backend constrains torchax tensors, but got {type(x).__name__}; "
                "make global tensors with host_to_global_array (or torchax.interop.torch_view "
                f"of a jax.Array) on {mesh!r}."
            )
        array = array_of(x)
        j = jax()
        if _is_tracer(array):  # in a jitted step: a constraint the compiler meets
            out = j.lax.with_sharding_constraint(array, named_sharding(mesh, axes, keep))
            return as_tensor(out)
        native = to_jax_mesh(mesh)
        if set(array.sharding.device_set) != set(native.devices.flat):
            have = sorted(device_index()[d] for d in array.sharding.device_set)
            raise ShardingError(
                f"the tensor lives on devices {have}, not on the current mesh {mesh!r} "
                f"(devices {sorted(mesh.device_ids)}); constrain it inside the `with mesh:` of "
                "the mesh it was made on, or make it on the current mesh."
            )
        target = named_sharding(mesh, self._kept(array, mesh, axes, keep))
        if array.sharding.is_equivalent_to(target, array.ndim):
            return x
        try:  # JAX reshards eagerly only what divides evenly (a jitted step pads)
            target.shard_shape(tuple(array.shape))
        except ValueError as e:
            raise ShardingError(
                f"JAX cannot lay out an array of shape {tuple(array.shape)} as {target.spec} "
                f"outside a jitted step ({str(e).split(' (full shape')[0]}): every split "
                "dimension must divide evenly. Constrain it inside the jitted step, or split "
                "it over fewer devices."
            ) from None
        return as_tensor(j.device_put(array, target))

    def _kept(self, array: Any, mesh: Mesh, axes: DimAxes, keep: frozenset[int]) -> DimAxes:
        """``axes`` where each kept dimension keeps the mesh axes that split it now (those
        the spec does not use elsewhere): an eager reshard has no UNCONSTRAINED."""
        if not keep:
            return axes
        spec = getattr(array.sharding, "spec", None)
        if spec is None or getattr(array.sharding, "mesh", None) != to_jax_mesh(mesh):
            return tuple(() if d in keep else a for d, a in enumerate(axes))
        used = {a for d, dim in enumerate(axes) if d not in keep for a in dim}
        out = []
        for d, dim in enumerate(axes):
            if d not in keep:
                out.append(dim)
                continue
            entry = spec[d] if d < len(spec) else None
            now = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            out.append(tuple(a for a in now if a not in used))
        return tuple(out)

    def full_local(self, x: torch.Tensor) -> torch.Tensor:
        if not is_torchax_tensor(x) or _is_tracer(array_of(x)):
            return x  # traced into the step: the compiler moves what the index maths needs
        return self.gather(x)  # eagerly: the key's whole value, the same on every process

    # JAX lays out an array eagerly only where the mesh axes divide it (a jitted step pads):
    # dispatch asks for P() where they do not divide the logical rows.
    splits_unevenly = False

    def move_rows(
        self,
        x: torch.Tensor,
        targets: torch.Tensor,
        logical: int,
        mesh: Mesh,
        axes: tuple[str, ...],
    ) -> torch.Tensor | None:
        return None  # take_rows: one jitted jnp.take on integer views, the partitioner's gather

    def take_rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if not is_torchax_tensor(x):
            return x.index_select(0, index.to(x.device))
        array = array_of(x)
        if is_torchax_tensor(index):
            idx = array_of(index)
        else:
            idx = _replicated_index(index, array)
        if _is_tracer(array) or _is_tracer(idx):
            return as_tensor(jax().numpy.take(array, idx, axis=0))
        with collective.guarded(f"dispatch: gathering rows of an array of shape {array.shape}"):
            return as_tensor(_take()(array, idx))


_TORCHAX = TorchaxRuntime()
BACKEND = Backend(
    "torchax",
    place=_TORCHAX,
    read=_TORCHAX,
    step=_TORCHAX,
    meshes=TorchaxMeshes(),
    processes=TorchaxChecks(),
)
register(BACKEND)
