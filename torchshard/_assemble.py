"""Host <-> global: ``host_to_global_array``, ``host_to_global_specs``,
``global_to_host_array`` and ``replicate_to_local_data``.

Data flow of ``host_to_global_array``: resolve the partition to a spec per leaf (prefix
broadcast), convert every leaf to a CPU tensor (zero-copy for numpy), validate everything and
plan every leaf (global shape, which slice of which host's block each local device gets) before
anything moves, then hand one view per local device to the backend. The plans of a call are
kept, keyed by everything they depend on (mesh, topology, partition, tree structure, each
leaf's type, shape and dtype), so a training loop's repeated calls skip straight to the views.
Reading back asks the backend for the local shards (with their global ranges) and concatenates
the distinct ranges.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from torchshard._agreement import describe, disagreement
from torchshard._backend import Backend, LocalShard, get_backend
from torchshard._deprecation import warn_once
from torchshard._errors import ShardingError, TreeStructureError, at
from torchshard._host_data import SUPPORTED_DTYPES, as_host_tensor, shape_dtype
from torchshard._index import NamedSharding, dim_axes
from torchshard._layout import HostPlan, block_offsets, infer_global_shape, plan_from_local
from torchshard._mesh import Mesh, require_mesh
from torchshard._partition import data_partition_type_to_spec
from torchshard._spec import DataPartitionType, PartitionSpec
from torchshard._tensor_spec import TensorSpec
from torchshard._topology import Topology, current_topology
from torchshard._tree import LazyPaths, broadcast_prefix, flatten, paths, unflatten

_REPLICATED = PartitionSpec()
SUPPORTED = frozenset(SUPPORTED_DTYPES)


class _Cached(NamedTuple):
    """A call's plans, and per leaf the backend's ``make_global`` with all but shards bound."""

    plans: list[HostPlan]
    makers: list[Callable[[list[torch.Tensor]], torch.Tensor]]


# The plans of earlier calls (see ``_call_key``); cleared when it grows past the bound. Reads
# and writes are single dict operations (atomic under the GIL): threads at worst plan twice.
_CALLS: dict[tuple[Any, ...], _Cached] = {}
_CALLS_BOUND = 512


def _call_key(
    mesh: Mesh, topology: Topology, partition: Any, treespec: Any, leaves: Sequence[Any]
) -> tuple[Any, ...] | None:
    """What a call's plans depend on, or ``None`` when the call is not cached (a partition
    given as a tree of specs, a leaf that is not a CPU tensor or a numpy array). The leaf's
    type is part of the key: a tensor that needs no conversion is used as it is on a hit."""
    if not (
        partition is DEFAULT_PARTITION
        or type(partition) is PartitionSpec
        or isinstance(partition, DataPartitionType)
    ):
        return None
    sig: list[Any] = []
    for x in leaves:
        cls = type(x)
        if cls is torch.Tensor:
            if not x.is_cpu or x.requires_grad or x.dtype not in SUPPORTED:
                return None
            sig.append((x.shape, x.dtype))
        elif cls is np.ndarray:
            sig.append((cls, x.shape, x.dtype))
        else:
            return None
    return (mesh, topology, partition, treespec, *sig)


class _DefaultPartition:
    def __repr__(self) -> str:
        return "DataPartitionType.FULL"


DEFAULT_PARTITION: Any = _DefaultPartition()


def _resolve_partition(partition: Any, *, depth: int) -> tuple[Any, bool]:
    """The spec tree and whether it is the FULL partition.

    ``depth``: the number of torchshard frames above this call's caller, so that the
    deprecation warning points at the user's line (1 when called from a public function).
    """
    if partition is DEFAULT_PARTITION:
        partition = DataPartitionType.FULL
    elif isinstance(partition, DataPartitionType):
        warn_once(
            "partition-type",
            "Passing a DataPartitionType to host_to_global_array is deprecated; pass a "
            "PartitionSpec (e.g. torchshard.input_partition_spec()) instead.",
            stacklevel=3 + depth,  # warn_once, this function, its caller, ..., the user
        )
    return data_partition_type_to_spec(partition), partition is DataPartitionType.FULL


def _specs_for(spec_tree: Any, tree: Any, n: int, argname: str) -> list[PartitionSpec]:
    if spec_tree is None or isinstance(spec_tree, PartitionSpec):
        specs = [spec_tree] * n
    else:
        specs = broadcast_prefix(
            spec_tree,
            tree,
            is_prefix_leaf=lambda x: isinstance(x, PartitionSpec),
            prefix_name="partition",
            full_name=argname,
        )
    return [_REPLICATED if s is None else s for s in specs]


def _plan(
    backend: Backend,
    mesh: Mesh,
    spec: PartitionSpec,
    local_shape: tuple[int, ...],
    topology: Topology,
    devices: tuple[int, ...],
    where: str | LazyPaths,
    i: int,
) -> HostPlan:
    try:
        plan = plan_from_local(mesh, spec, local_shape, topology.device_process, devices)
        backend.check_layout(mesh, plan.axes)
    except ShardingError as e:
        raise type(e)(at(where[i] if isinstance(where, LazyPaths) else where, str(e))) from None
    return plan


def _check_full_batch(paths: Any, shapes: list[tuple[int, ...]]) -> None:
    first = next((i for i, s in enumerate(shapes) if s), None)
    if first is None:
        return
    batch = shapes[first][0]
    for i, s in enumerate(shapes):
        if s and s[0] != batch:
            raise ShardingError(
                f"{paths[i]}: under DataPartitionType.FULL every leaf is a per-host batch split "
                f"along dim 0, so all leaves must have the same batch size; expected {batch} "
                f"(the size of {paths[first]}), got {s[0]} (shape {s})."
            )


def _host_tensor(x: Any, paths: LazyPaths, i: int) -> torch.Tensor:
    if type(x) is torch.Tensor and x.is_cpu and not x.requires_grad:
        if x.dtype in SUPPORTED:
            return x
    return as_host_tensor(x, paths[i])


def _device_shards(plan: HostPlan, per: list[torch.Tensor], slot: dict[int, int]) -> list[Any]:
    """The view of its owner's tensor that each planned device receives."""
    split = plan.single_split
    if split is not None:  # one C++ call per owner instead of one narrow per device
        dim, chunk = split
        if len(slot) == 1:  # one host (the real path): no per-owner lookups
            t = per[0]
            parts = t.tensor_split(t.shape[dim] // chunk, dim)
            return [parts[i] for i in plan.split_parts]
        by_owner = {
            o: per[s].tensor_split(per[s].shape[dim] // chunk, dim) for o, s in slot.items()
        }
        return [by_owner[p.owner][i] for p, i in zip(plan.pieces, plan.split_parts, strict=True)]
    out = []
    for p in plan.pieces:
        t = per[slot[p.owner]]
        for dim, start, length in p.cuts:
            t = t.narrow(dim, start, length)
        out.append(t)
    return out


@functools.lru_cache(maxsize=64)
def _check_local_owner(topology: Topology, devices: tuple[int, ...]) -> None:
    """The backend's local devices must belong to this process (checked once per pair)."""
    owners = {topology.device_process[d] for d in devices}
    if owners != {topology.process_index}:
        raise RuntimeError(
            f"the backend's local devices {devices} belong to processes {sorted(owners)}, "
            f"not to this process ({topology.process_index})."
        )


def _assemble(
    per_host: Sequence[Any] | None,
    tree: Any,
    partition: Any,
    *,
    caller: str,
    argname: str,
    background: bool = False,
    check: bool = True,
) -> Any:
    """Shared by the real path (``tree``) and the emulation (``per_host``: one tree per host).

    ``background``: called from a loader thread; see ``Backend.make_global``. ``check``: run
    the cross-process agreement check (a collective; ``False`` when the caller runs it)."""
    mesh = require_mesh(caller)
    backend = get_backend(mesh)
    topology = current_topology(mesh)
    if per_host is None and topology.virtual and topology.process_count > 1:
        raise ShardingError(
            f"{caller} inside virtual_hosts({topology.process_count}) has only this host's data"
            "; use torchshard.testing.host_to_global_array_per_host with one tree per host."
        )
    hosts = [tree] if per_host is None else list(per_host)
    if per_host is not None and len(hosts) != topology.process_count:
        raise ShardingError(
            f"{argname}: expected one tree per host, {topology.process_count} in all, but got "
            f"{len(hosts)}."
        )
    leaves, treespec = flatten(hosts[0])
    host_paths = [LazyPaths(treespec, argname if per_host is None else f"{argname}[0]")]
    # Before anything that could fail on one process only. A loader checks on its consumer's
    # thread instead (``check=False`` here, on its background thread).
    if per_host is None and check and backend.agreement_active(mesh):
        every = backend.exchange_agreement(mesh, describe(treespec, leaves, partition))
        if every is not None:
            raise disagreement(argname, every, host_paths[0].__getitem__)
    key = None if per_host is not None else _call_key(mesh, topology, partition, treespec, leaves)
    if key is not None:
        cached = _CALLS.get(key)
        if cached is not None:  # validated and planned before: only the per-call work is left
            if isinstance(partition, DataPartitionType):
                _resolve_partition(partition, depth=2)  # its deprecation warning, if due
            slot = {topology.process_index: 0}
            tensors = [
                [x if type(x) is torch.Tensor else _host_tensor(x, host_paths[0], i)]
                for i, x in enumerate(leaves)
            ]
            if background:
                return _transfer(backend, mesh, cached.plans, tensors, slot, True, treespec)
            out = [
                make(_device_shards(plan, per, slot))
                for per, plan, make in zip(tensors, cached.plans, cached.makers, strict=True)
            ]
            return unflatten(treespec, out)
    spec_tree, full = _resolve_partition(partition, depth=2)  # _assemble <- public function
    host_leaves = [leaves]
    for h, other in enumerate(hosts[1:], start=1):
        o_leaves, o_spec = flatten(other)
        if o_spec != treespec:
            raise TreeStructureError(
                f"{argname}[{h}] has a different structure from {argname}[0]: expected "
                f"{treespec}, got {o_spec}."
            )
        host_leaves.append(o_leaves)
        host_paths.append(LazyPaths(treespec, f"{argname}[{h}]"))
    paths = host_paths[0]
    specs = _specs_for(spec_tree, hosts[0], len(leaves), argname)
    devices = tuple(backend.local_devices(mesh))
    if per_host is None:
        _check_local_owner(topology, devices)
        slot = {topology.process_index: 0}
    else:
        slot = {h: h for h in range(len(hosts))}

    # Validate and plan every leaf before anything is transferred.
    tensors = [
        [_host_tensor(hl[i], hp, i) for hl, hp in zip(host_leaves, host_paths, strict=True)]
        for i in range(len(leaves))
    ]
    for i, per in enumerate(tensors):
        ref = per[0]
        for h, t in enumerate(per[1:], start=1):
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise ShardingError(
                    f"{host_paths[h][i]}: every host must pass the same shape and dtype for a "
                    f"leaf; expected {tuple(ref.shape)} {ref.dtype} (host 0), got "
                    f"{tuple(t.shape)} {t.dtype}."
                )
    shapes = [tuple(per[0].shape) for per in tensors]
    if full:
        _check_full_batch(paths, shapes)
    plans = [
        _plan(backend, mesh, specs[i], shapes[i], topology, devices, paths, i)
        for i in range(len(leaves))
    ]

    if key is not None:
        if len(_CALLS) >= _CALLS_BOUND:
            _CALLS.clear()
        makers = [backend.global_maker(mesh, p.axes, p.global_shape) for p in plans]
        _CALLS[key] = _Cached(plans, makers)
    return _transfer(backend, mesh, plans, tensors, slot, background, treespec)


def _transfer(
    backend: Backend,
    mesh: Mesh,
    plans: Sequence[HostPlan],
    tensors: Sequence[list[torch.Tensor]],
    slot: dict[int, int],
    background: bool,
    treespec: Any,
) -> Any:
    """One view per planned device of each leaf, handed to the backend; the output tree."""
    make_global = (
        functools.partial(backend.make_global, background=True)
        if background
        else backend.make_global
    )
    out = []
    for per, plan in zip(tensors, plans, strict=True):
        shards = _device_shards(plan, per, slot)
        out.append(make_global(mesh, plan.axes, plan.global_shape, shards))
    return unflatten(treespec, out)


def host_to_global_array(host_arrays: Any, /, *, partition: Any = DEFAULT_PARTITION) -> Any:
    """Turns each host's block of a batch into global tensors sharded over the current mesh.

    Every process passes its own block (a tree of numpy arrays or CPU tensors); the global
    shape is inferred from the mesh and the device -> process map, as in JAX's
    ``make_array_from_process_local_data``. Each device receives only its shard.

    Args:
        host_arrays: a tree (dicts, lists, tuples, namedtuples, dataclasses; ``None`` passes
            through) of numpy arrays or CPU tensors.
        partition: a ``PartitionSpec``, a prefix tree of them, or (deprecated) a
            ``DataPartitionType``. Default: ``FULL``, dim 0 split over every mesh axis.

    Returns:
        The same tree with global tensors of the mesh's backend at the leaves (XLA tensors;
        ``DTensor``s on a mesh of the ``"dtensor"`` backend).

    Raises:
        ShardingError: (a ``ValueError``) naming the leaf's path: no mesh, a spec longer than
            the rank, an unknown axis, an indivisible dimension, FULL leaves that disagree on
            the batch size. ``TypeError`` for unsupported leaf types or dtypes. Nothing is
            transferred when any leaf is bad.
        ProcessDisagreementError: (DTensor backend, on every process) the processes passed
            different structures, shapes or dtypes; see ``set_agreement_check``.

    Example (mesh ``(4, 2)``, one host): 8 rows split over all 8 devices, one row each::

        >>> with mesh:
        ...     g = host_to_global_array({"x": np.arange(16).reshape(8, 2)})
        >>> g["x"].shape
        torch.Size([8, 2])
    """
    return _assemble(
        None, host_arrays, partition, caller="host_to_global_array", argname="host_arrays"
    )


def host_to_global_device_array(host_arrays: Any, /, *, partition: Any = DEFAULT_PARTITION) -> Any:
    """Deprecated alias of ``host_to_global_array``."""
    warn_once(
        "host_to_global_device_array",
        "host_to_global_device_array is deprecated; use host_to_global_array.",
    )
    return _assemble(
        None, host_arrays, partition, caller="host_to_global_array", argname="host_arrays"
    )


def host_to_global_specs(host_specs: Any, /, *, partition: Any = DEFAULT_PARTITION) -> Any:
    """The ``TensorSpec`` tree that ``host_to_global_array`` would return; nothing moves.

    Args:
        host_specs: a tree whose leaves are ``TensorSpec``s or objects with ``.shape`` and
            ``.dtype`` (numpy arrays, tensors), each a host's block.
        partition: as for ``host_to_global_array``.

    Example:
        >>> with mesh:  # 8 devices, 1 host
        ...     host_to_global_specs({"x": TensorSpec((8, 2), torch.int64)})["x"].shape
        (8, 2)
    """
    mesh = require_mesh("host_to_global_specs")
    backend = get_backend(mesh)
    topology = current_topology(mesh)
    spec_tree, full = _resolve_partition(partition, depth=1)
    # Anything with .shape and .dtype is a leaf, even a dataclass or namedtuple (which would
    # otherwise be a node); the partition is then matched against a tree of TensorSpecs.
    leaves, treespec = flatten(host_specs, is_leaf=_has_shape_and_dtype)
    where = paths(treespec, "host_specs")
    shapes_dtypes = [shape_dtype(leaf, path) for leaf, path in zip(leaves, where, strict=True)]
    as_specs = unflatten(treespec, [TensorSpec(s, d) for s, d in shapes_dtypes])
    specs = _specs_for(spec_tree, as_specs, len(leaves), "host_specs")
    if full:
        _check_full_batch(where, [s for s, _ in shapes_dtypes])
    out = []
    for (shape, dtype), path, spec in zip(shapes_dtypes, where, specs, strict=True):
        axes = dim_axes(mesh, spec, len(shape), where=path)
        try:
            global_shape = infer_global_shape(mesh, spec, axes, shape, topology.device_process)
            backend.check_layout(mesh, axes)
        except ShardingError as e:
            raise type(e)(at(path, str(e))) from None
        out.append(TensorSpec(global_shape, dtype, NamedSharding(mesh, spec)))
    return unflatten(treespec, out)


def _has_shape_and_dtype(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_global(backend: Backend, x: Any, where: str) -> None:
    if not backend.is_global(x):
        raise TypeError(
            f"{where}: expected a global tensor of the {backend.name} backend (e.g. from "
            f"host_to_global_array), but got {type(x).__name__}"
            + (f" on {x.device}" if isinstance(x, torch.Tensor) else "")
            + "."
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
    where: str,
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
        f"{where}: host {host}'s block spans the ranges {span} (one list per dimension), but "
        f"this process can read only {have} of its {total} elements: the layout is not a grid "
        "per host (the host's devices do not hold the whole cross product of their slices; "
        "other hosts' devices hold the rest). Read the whole value with "
        "replicate_to_local_data, or use a mesh whose device order follows host boundaries "
        "(e.g. create_device_mesh with a HybridMeshShape)."
    )


def _host_blocks(global_arrays: Any, hosts: Sequence[int] | None, argname: str) -> list[Any]:
    """For each host in ``hosts`` (None: this process), its block of every leaf."""
    mesh = require_mesh("global_to_host_array")
    backend = get_backend(mesh)
    topology = current_topology(mesh)
    leaves, treespec = flatten(global_arrays)
    where = LazyPaths(treespec, argname)
    for i, leaf in enumerate(leaves):
        if not backend.is_global(leaf):
            _check_global(backend, leaf, where[i])
    all_shards = backend.local_shards(leaves)
    owner = topology.device_process
    wanted = [topology.process_index] if hosts is None else list(hosts)
    out = []
    for h in wanted:
        blocks = []
        for i, (leaf, shards) in enumerate(zip(leaves, all_shards, strict=True)):
            mine = [s for s in shards if owner[s.device] == h]
            if not mine:
                raise ShardingError(
                    f"{where[i]}: host {h} holds no shard of this tensor; expected shards on "
                    f"its devices {topology.devices_of(h)}, got shards on devices "
                    f"{sorted(s.device for s in shards)}."
                )
            block = _block(mine, leaf.dim(), leaf.dtype)
            if block is None:
                block = _non_grid_block(mine, shards, leaf.dim(), leaf.dtype, where[i], h)
            blocks.append(block)
        out.append(unflatten(treespec, blocks))
    return out


def global_to_host_array(global_arrays: Any, /) -> Any:
    """This process's block of each global tensor, as CPU tensors (inverse of
    ``host_to_global_array``).

    It reads the local shards (no compilation, no all-gather) and concatenates the distinct
    slices this process's devices hold along each dimension.

    Example:
        >>> with mesh:
        ...     back = global_to_host_array(host_to_global_array({"x": x}))
        >>> torch.equal(back["x"], torch.as_tensor(x))
        True
    """
    return _host_blocks(global_arrays, None, "global_arrays")[0]


def replicate_to_local_data(x: Any, /) -> Any:
    """The full global value of every global tensor in ``x``, on the host.

    Built from local shards when this process holds every block (one host, or the
    emulation); otherwise the backend gathers (torch_xla: ``.cpu()``, an all-gather).

    Example:
        >>> with mesh:
        ...     full = replicate_to_local_data(host_to_global_array(x))
    """
    mesh = require_mesh("replicate_to_local_data")
    backend = get_backend(mesh)
    leaves, treespec = flatten(x)
    where = LazyPaths(treespec, "x")
    for i, leaf in enumerate(leaves):
        if not backend.is_global(leaf):
            _check_global(backend, leaf, where[i])
    out = []
    for leaf, shards in zip(leaves, backend.local_shards(leaves), strict=True):
        block = _block(shards, leaf.dim(), leaf.dtype)
        if block is not None and tuple(block.shape) == tuple(leaf.shape):
            out.append(block)
        else:
            out.append(backend.gather(leaf))
    return unflatten(treespec, out)
