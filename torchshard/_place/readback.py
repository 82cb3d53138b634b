"""Global -> host: ``global_to_host_array`` (this host's block) and ``replicate_to_local_data``
(the whole value).

Reading back asks the backend for the local shards with their global ranges (torch_xla: one
``_get_local_shards`` call for the whole tree, no compilation; DTensor: ``to_local()`` with
DTensor's own offsets) and concatenates the distinct ranges along each dimension. It does not
depend on how the tensor was sharded, so step outputs read back too; nor on a current mesh: a
global tensor carries its sharding (torch_xla's sharding spec, a DTensor's mesh and placements),
so outside ``with mesh:`` the tensors' own backend reads them (as axlearn's needs no mesh
context). An XLA tensor that was never annotated (moved with ``.to()``) is whole on every
device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torchshard._backend.protocols import Backend, LocalShard
from torchshard._backend.registry import lookup
from torchshard._core.blocks import block_offsets
from torchshard._core.context import current_mesh
from torchshard._core.deprecation import warn_once
from torchshard._core.errors import ProcessDisagreementError, ShardingError, at
from torchshard._core.topology import Topology
from torchshard._core.tree import LazyPaths, Where, flatten, unflatten
from torchshard._mesh.context import current_topology
from torchshard._place.guard import eagerly

_NOT_GIVEN: Any = object()  # global_to_host_array's deprecated ``partition``, when not passed


def _check_global(backend: Backend, x: Any, where: Where) -> None:
    if not backend.place.is_global(x):
        on = f" on {x.device}" if isinstance(x, torch.Tensor) else ""
        raise TypeError(
            at(
                where,
                f"expected a global tensor of the {backend.name} backend (e.g. from "
                f"host_to_global_array), but got {type(x).__name__}{on}.",
            )
        )


def _volume(ranges: tuple[tuple[int, int], ...]) -> int:
    return math.prod(b - a for a, b in ranges)


def _block(shards: Sequence[LocalShard], ndim: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The block spanned by ``shards``: along each dimension their distinct global ranges,
    concatenated in order. ``None`` when the shards do not fill it (a non-grid set).

    The distinct ranges of a tiled sharding are disjoint along each dimension, so the shards
    fill the block exactly when their distinct volumes add up to its volume.
    """
    unique: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
    for s in shards:
        unique.setdefault(s.ranges, s.data)
    if len(unique) == 1:
        return next(iter(unique.values()))
    ranges = list(unique)
    shape, local = block_offsets(ranges, ndim)
    if sum(_volume(r) for r in ranges) != math.prod(shape):
        return None
    out = torch.empty(shape, dtype=dtype)
    for sl, data in zip(local, unique.values(), strict=True):
        out[sl] = data
    return out


def _non_grid_block(
    mine: Sequence[LocalShard],
    addressable: Sequence[LocalShard],
    ndim: int,
    dtype: torch.dtype,
    where: Where,
    host: int,
) -> torch.Tensor:
    """A host's block when its own devices do not fill it (a non-grid layout: the block is
    the cross product of its devices' slices, and other hosts' devices hold some of it).

    The missing parts are read from the other addressable shards: in the ``virtual_hosts``
    emulation every device is addressable; on a real multi-host run they are not, and this
    raises.
    """
    held = [{s.ranges[i] for s in mine} for i in range(ndim)]
    inside = [s for s in addressable if all(s.ranges[i] in held[i] for i in range(ndim))]
    block = _block(inside, ndim, dtype)
    if block is not None:
        return block
    span = [sorted(h) for h in held]
    have = sum(_volume(r) for r in {s.ranges for s in mine})
    total = math.prod(sum(b - a for a, b in h) for h in span)
    raise ShardingError(
        at(
            where,
            f"host {host}'s block spans the ranges {span} (one list per dimension), but "
            f"this process can read only {have} of its {total} elements: the layout is not a grid "
            "per host (the host's devices do not hold the whole cross product of their slices; "
            "other hosts' devices hold the rest). Read the whole value with "
            "replicate_to_local_data, or use a mesh whose device order follows host boundaries "
            "(e.g. create_device_mesh with a HybridMeshShape).",
        )
    )


def _runtime(leaves: Sequence[Any]) -> tuple[Backend, Topology]:
    """The backend and topology that read ``leaves``: the current mesh's; outside a mesh, the
    first leaf's own backend (a global tensor carries its sharding) and that backend's
    topology (an installed emulation's under ``virtual_hosts``)."""
    mesh = current_mesh()
    if mesh is not None:
        return lookup(mesh), current_topology(mesh)
    backend = lookup(leaves[0])
    return backend, current_topology(backend=backend.name)


def host_blocks(global_arrays: Any, hosts: Sequence[int] | None) -> list[Any]:
    """For each host in ``hosts`` (``None``: this process), its block of every leaf."""
    argname = "global_arrays"
    leaves, treespec = flatten(global_arrays, name=argname)
    if not leaves:  # nothing to read: no mesh or backend needed
        return [unflatten(treespec, []) for _ in ([None] if hosts is None else hosts)]
    backend, topology = _runtime(leaves)
    where = LazyPaths(treespec, argname)
    for i, leaf in enumerate(leaves):
        if not backend.place.is_global(leaf):
            _check_global(backend, leaf, where.at(i))
    all_shards = backend.read.local_shards(leaves)
    owner = topology.device_process
    wanted = [topology.process_index] if hosts is None else list(hosts)
    out = []
    for h in wanted:
        blocks = []
        for i, (leaf, shards) in enumerate(zip(leaves, all_shards, strict=True)):
            mine = [s for s in shards if owner[s.device] == h]
            if not mine:
                raise ShardingError(
                    at(
                        where[i],
                        f"host {h} holds no shard of this tensor; expected shards on "
                        f"its devices {topology.devices_of(h)}, got shards on devices "
                        f"{sorted(s.device for s in shards)}.",
                    )
                )
            block = _block(mine, leaf.dim(), leaf.dtype)
            if block is None:
                block = _non_grid_block(mine, shards, leaf.dim(), leaf.dtype, where.at(i), h)
            blocks.append(block)
        out.append(unflatten(treespec, blocks))
    return out


def global_to_host_array(global_arrays: Any, /, *, partition: Any = _NOT_GIVEN) -> Any:
    """This process's block of each global tensor, as CPU tensors (inverse of
    ``host_to_global_array``).

    It reads the local shards (no compilation, no all-gather) and concatenates the distinct
    slices this process's devices hold along each dimension. No mesh is needed: each tensor
    carries its sharding. A tensor that was never annotated (an XLA tensor moved with
    ``.to()``) is whole on every device, so its block is its value.

    Args:
        global_arrays: a tree of global tensors (XLA tensors, ``XLAShardedTensor``s,
            ``DTensor``s).
        partition: deprecated and ignored (as in axlearn): the block follows each tensor's own
            sharding. Passing anything but ``None`` warns once (``DeprecationWarning``).

    Example (one host: its block is the whole array):
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> x = np.arange(16).reshape(8, 2)
        >>> with mesh:
        ...     back = torchshard.global_to_host_array(torchshard.host_to_global_array({"x": x}))
        >>> back["x"].device, torch.equal(back["x"], torch.as_tensor(x))
        (device(type='cpu'), True)
    """
    if torch.compiler.is_compiling():  # torch.compile traces the call: read back eagerly
        return eagerly(global_to_host_array)(global_arrays, partition=partition)
    if partition is not _NOT_GIVEN and partition is not None:
        warn_once(
            "global_to_host_array-partition",
            "global_to_host_array: partition= is deprecated and ignored; each tensor's block "
            "follows its own sharding. Drop the argument.",
        )
    return host_blocks(global_arrays, None)[0]


def replicate_to_local_data(x: Any, /) -> Any:
    """The full global value of every global tensor in ``x``, on the host.

    Built from local shards when this process holds every block (one host, or the
    emulation); otherwise the backend gathers (torch_xla: ``.cpu()``, an all-gather; DTensor
    on several processes always gathers, ``to_local()`` of a replicated one, so that every
    process takes the same path). As for
    ``global_to_host_array``, no mesh is needed, and a tensor that was never annotated gives
    its value (as JAX's ``process_allgather``).

    Example:
        >>> with torchshard.Mesh(np.arange(8), ("data",)):
        ...     g = torchshard.host_to_global_array(np.arange(8))
        ...     torchshard.replicate_to_local_data({"y": g * 10})
        {'y': tensor([ 0, 10, 20, 30, 40, 50, 60, 70])}
    """
    if torch.compiler.is_compiling():  # torch.compile traces the call: read back eagerly
        return eagerly(replicate_to_local_data)(x)
    leaves, treespec = flatten(x)
    if not leaves:
        return unflatten(treespec, [])
    backend, topology = _runtime(leaves)
    where = LazyPaths(treespec, "x")
    for i, leaf in enumerate(leaves):
        if not backend.place.is_global(leaf):
            _check_global(backend, leaf, where.at(i))
    # Where processes gather together (DTensor), every process must take the same branch: one
    # whose block happens to be the whole value (an uneven split: 1 row over 4 ranks) still
    # gathers with the others, or they would wait for it.
    together = backend.processes is not None and topology.process_count > 1
    every = [None] * len(leaves) if together else backend.read.local_shards(leaves)
    out = []
    for i, (leaf, shards) in enumerate(zip(leaves, every, strict=True)):
        block = None if shards is None else _block(shards, leaf.dim(), leaf.dtype)
        if block is not None and tuple(block.shape) == tuple(leaf.shape):
            out.append(block)
            continue
        try:  # DTensor: checks first that every process gathers the same shape and dtype
            out.append(backend.read.gather(leaf))
        except ProcessDisagreementError as e:
            raise ProcessDisagreementError(at(where[i], str(e))) from None
    return unflatten(treespec, out)
