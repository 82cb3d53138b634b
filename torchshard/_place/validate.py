"""Validation: everything checked about a call before anything moves, and the per-leaf plan.

``validated_plan`` checks every leaf of a call (the hosts' trees and leaves agree, the spec of
each leaf, a given global shape, already-global leaves, FULL batch agreement) and plans each
with ``plan_leaf`` (the core's pure ``plan_from_local``, and whether the backend can express
the layout). ``host_to_global_specs`` validates its specs with the same functions, so both
report the same errors. Errors name the leaf's path.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchshard._backend.protocols import Backend
from torchshard._core import checks
from torchshard._core.blocks import (
    HostPlan,
    SharedBlock,
    merge_plans,
    plan_from_local,
    shared_blocks,
)
from torchshard._core.errors import Float64Warning, ShardingError, TreeStructureError, at
from torchshard._core.mesh import Mesh
from torchshard._core.partition import DEFAULT_PARTITION, data_partition_type_to_spec
from torchshard._core.sharding import DimAxes, NamedSharding
from torchshard._core.spec import DataPartitionType, PartitionSpec
from torchshard._core.topology import Topology
from torchshard._core.tree import Where, broadcast_prefix
from torchshard._place.call import CallPlan, HostCall
from torchshard._place.host_data import host_tensors
from torchshard._place.memory import check_fits

_REPLICATED = PartitionSpec()


def validated_plan(mesh: Mesh, backend: Backend, topology: Topology, call: HostCall) -> CallPlan:
    """Validates and plans every leaf of ``call``; raises before anything moves.

    Raises ``ShardingError``/``TreeStructureError``/``TypeError`` naming the leaf's path:
    hosts whose trees differ, an unsupported leaf, hosts whose leaves differ in shape or
    dtype, FULL leaves that disagree on the batch size, a spec the leaf or mesh cannot take.
    """
    spec_tree, full = spec_tree_of(call.partition)
    check_host_structures(call)
    n = len(call.leaves[0])
    paths = call.paths[0]
    specs = specs_for(spec_tree, call.trees[0], n, call.argname)
    given = global_shapes(call.global_shape, call.trees[0], n, call.argname, paths)
    devices = tuple(backend.place.local_devices(mesh))
    check_local_owner(topology, devices)
    done = already_global(mesh, backend, call, specs, given)
    tensors = call.tensors = host_tensors(call, done)
    differ = check_host_leaves(call, tensors, done, given)
    if mesh.backend == "xla":
        warn_float64(tensors[0], paths)
    shapes = [tuple(t.shape) for t in tensors[0]]
    if full:  # under FULL each host's leaves share one batch size (hosts' shapes may differ)
        for h, leaves in enumerate(tensors if differ else tensors[:1]):
            where = call.paths[h]
            sizes = shapes if h == 0 else [tuple(t.shape) for t in leaves]
            if done:  # a global leaf is not a host batch
                host = [i for i in range(n) if i not in done]
                check_full_batch([where.at(i) for i in host], [sizes[i] for i in host])
            else:
                check_full_batch(where, sizes)
    plans: list[HostPlan | None] = []
    for i in range(n):
        if i in done:
            plans.append(None)
            continue
        if given[i] is not None and len(tensors) > 1:  # each host's block, over its devices
            plans.append(
                plan_hosts(mesh, backend, call, tensors, i, specs[i], given[i], topology, devices)
            )
            continue
        plans.append(
            plan_leaf(mesh, backend, specs[i], shapes[i], given[i], topology, devices, paths.at(i))
        )
    if backend.place.devices_in_host_memory():
        itemsizes = [t.element_size() for t in tensors[0]]
        check_fits(call.argname, plans, itemsizes, paths.__getitem__)
    slot = {h: k for k, h in enumerate(topology.data_hosts)}
    shared: tuple[tuple[int, PartitionSpec, tuple[SharedBlock, ...]], ...] = ()
    if len(slot) > 1:  # virtual hosts: one process supplies the blocks hosts may share
        found = (  # leaves already global (no plan) are one tensor on every host
            (i, specs[i], shared_blocks(mesh, p)) for i, p in enumerate(plans) if p is not None
        )
        shared = tuple(entry for entry in found if entry[2])
    return CallPlan(plans, slot, shared)


_WIDE = (torch.float64, torch.complex128)
_warned_float64 = False


def warn_float64(tensors: Sequence[torch.Tensor], paths: Any) -> None:
    """Warns once per process (``Float64Warning``) when a leaf placed on a torch_xla mesh is
    float64 or complex128: TPUs have no 64-bit floats (docs/design.md, "float64 on torch_xla")."""
    global _warned_float64
    if _warned_float64:
        return
    for i, t in enumerate(tensors):
        if t.dtype in _WIDE:
            _warned_float64 = True
            narrow = "float32" if t.dtype == torch.float64 else "complex64"
            warnings.warn(
                at(
                    paths[i],
                    f"{t.dtype} data on a torch_xla mesh; TPUs have no 64-bit floats, so "
                    f"torch_xla emulates them slowly or computes in {narrow}. Cast on the host "
                    f"(x.astype(np.{narrow}), or x.to(torch.{narrow})) unless 64 bits are meant; "
                    "then filter this warning: warnings.filterwarnings('ignore', "
                    "category=torchshard.errors.Float64Warning). Warned once per process.",
                ),
                Float64Warning,
                stacklevel=2,
            )
            return


def plan_leaf(
    mesh: Mesh,
    backend: Backend,
    spec: PartitionSpec,
    shape: tuple[int, ...],
    given: tuple[int, ...] | None,
    topology: Topology,
    devices: tuple[int, ...],
    path: Where,
) -> HostPlan:
    """The plan of one leaf whose every host passes a block of ``shape`` (``given``: its global
    shape, else inferred), for ``devices``; ``ShardingError`` naming ``path`` (a ``LeafPath``
    is computed only then) when the spec, the mesh or the backend cannot take it."""
    try:
        p = plan_from_local(mesh, spec, shape, topology.device_process, devices, given)
        check_layout(backend, mesh, p.axes)
    except ShardingError as e:
        raise type(e)(at(path, str(e))) from None
    return p


def plan_hosts(
    mesh: Mesh,
    backend: Backend,
    call: HostCall,
    tensors: Sequence[Sequence[torch.Tensor]],
    i: int,
    spec: PartitionSpec,
    given: tuple[int, ...] | None,
    topology: Topology,
    devices: tuple[int, ...],
) -> HostPlan:
    """The plan of leaf ``i``, whose hosts pass blocks of different shapes under the global
    shape ``given`` (as in JAX: each its own part, or the whole dimension): each host's block
    planned over its own devices (an error names that host's path), then merged."""
    owners = topology.device_process
    plans = []
    for k, h in enumerate(topology.data_hosts):
        mine = tuple(d for d in devices if owners[d] == h)
        if mine:
            shape = tuple(tensors[k][i].shape)
            plans.append(
                plan_leaf(mesh, backend, spec, shape, given, topology, mine, call.paths[k].at(i))
            )
    return merge_plans(plans, devices)


def check_layout(backend: Backend, mesh: Mesh, axes: DimAxes) -> None:
    """Raises ``ShardingError`` (without a path) when ``backend`` cannot express the sharding
    ``axes`` on ``mesh`` (its ``LayoutLimits``; a backend without limits expresses every
    spec torchshard accepts)."""
    if backend.limits is not None:
        backend.limits.check_layout(mesh, axes)


def check_host_structures(call: HostCall) -> None:
    """Every host's tree must have the first host's structure."""
    treespec = call.treespec
    for h, other in enumerate(call.treespecs[1:], start=1):
        if other != treespec:
            raise TreeStructureError(
                f"{call.argname}[{h}] has a different structure from {call.argname}[0]: "
                f"expected {treespec}, got {other}."
            )


def check_host_leaves(
    call: HostCall,
    tensors: Sequence[Sequence[torch.Tensor]],
    done: frozenset[int],
    given: Sequence[tuple[int, ...] | None] | None = None,
) -> frozenset[int]:
    """Every host must pass the first host's dtype for each leaf (but the already global ones,
    ``done``), and its shape unless the leaf's global shape is ``given`` (as in JAX, each host
    then passes its own part, or the whole dimension, checked when planned). Returns the leaves
    whose hosts pass blocks of different shapes."""
    differ = set()
    for i in range(len(tensors[0])):
        if i in done:
            continue
        ref = tensors[0][i]
        for h in range(1, len(tensors)):
            t = tensors[h][i]
            if t.dtype == ref.dtype and t.shape != ref.shape and given and given[i] is not None:
                differ.add(i)
            elif t.shape != ref.shape or t.dtype != ref.dtype:
                hint = ""
                if t.dtype == ref.dtype:
                    hint = (
                        " Hosts whose parts differ in size pass global_shape=: each host then "
                        "passes its own part, or the whole dimension."
                    )
                raise ShardingError(
                    at(
                        call.paths[h][i],
                        f"every host must pass the same shape and dtype for a "
                        f"leaf; expected {tuple(ref.shape)} {ref.dtype} (host 0), got "
                        f"{tuple(t.shape)} {t.dtype}.{hint}",
                    )
                )
    return frozenset(differ)


def spec_tree_of(partition: Any) -> tuple[Any, bool]:
    """The spec tree ``partition`` stands for, and whether it is the FULL partition."""
    if partition is DEFAULT_PARTITION:
        partition = DataPartitionType.FULL
    return data_partition_type_to_spec(partition), partition is DataPartitionType.FULL


def specs_for(spec_tree: Any, tree: Any, n: int, argname: str) -> list[PartitionSpec]:
    """The spec of each of ``tree``'s ``n`` leaves: ``spec_tree`` broadcast over ``tree`` as a
    prefix (``None`` covers its subtree and means replicated); ``TreeStructureError`` naming
    ``argname`` when it is not a prefix."""
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


def check_full_batch(paths: Any, shapes: Sequence[tuple[int, ...]]) -> None:
    """Under FULL every leaf is a batch split along dim 0: they must share its size."""
    first = next((i for i, s in enumerate(shapes) if s), None)
    if first is None:
        return
    batch = shapes[first][0]
    for i, s in enumerate(shapes):
        if s and s[0] != batch:
            raise ShardingError(
                at(
                    paths[i],
                    f"under DataPartitionType.FULL every leaf is a per-host batch split "
                    f"along dim 0, so all leaves must have the same batch size; expected {batch} "
                    f"(the size of {paths[first]}), got {s[0]} (shape {s}).",
                )
            )


@functools.lru_cache(maxsize=64)
def check_local_owner(topology: Topology, devices: tuple[int, ...]) -> None:
    """The backend's local devices must belong to the hosts this process supplies data for
    (checked once per pair)."""
    owners = {topology.device_process[d] for d in devices}
    if not owners <= set(topology.data_hosts):
        raise RuntimeError(
            f"the backend's local devices {devices} belong to processes {sorted(owners)}, "
            f"not to this process ({topology.process_index})."
        )


def _is_shape(x: Any) -> bool:
    """A shape, or a sequence meant as one: every entry an int, or any entry a number or a
    string, which no subtree is (``(8, 2.0)``, ``(True, 2)``, ``(8, "2")``). Such a sequence is
    a leaf of the prefix tree, checked as a shape (``checks.shape`` names the entry), not a
    subtree that fails to match the data."""
    return isinstance(x, (tuple, list, torch.Size)) and (
        all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in x)
        or any(isinstance(n, (numbers.Number, np.generic, str, bytes)) for n in x)
    )


def global_shapes(
    given: Any, tree: Any, n: int, argname: str, paths: Any
) -> list[tuple[int, ...] | None]:
    """The given global shape of each of ``tree``'s ``n`` leaves (``None``: inferred):
    ``given`` is one shape for every leaf, or a prefix tree of shapes and ``None``s."""
    if given is None:
        return [None] * n
    if _is_shape(given):  # one shape for every leaf: its errors name global_shape itself
        return [checks.shape(given, "global_shape")] * n
    else:
        if isinstance(given, (str, bytes, int, float)):
            raise TypeError(
                f"global_shape: expected a shape (a tuple of ints), or a tree of them (and None) "
                f"matching {argname}, but got {type(given).__name__} {given!r}."
            )
        shapes = broadcast_prefix(
            given, tree, is_prefix_leaf=_is_shape, prefix_name="global_shape", full_name=argname
        )
    out: list[tuple[int, ...] | None] = []
    for k, s in enumerate(shapes):
        if s is None:
            out.append(None)
            continue
        try:
            out.append(checks.shape(s, "global_shape"))
            continue
        except (TypeError, ValueError):
            pass
        checks.shape(s, at(paths[k], "global_shape"))  # raises again, naming the leaf's path
    return out


def already_global(
    mesh: Mesh,
    backend: Backend,
    call: HostCall,
    specs: Sequence[PartitionSpec],
    given: Sequence[tuple[int, ...] | None],
) -> frozenset[int]:
    """The leaves that are already global tensors of ``backend`` whose layout is their spec's
    on ``mesh`` (JAX's ``make_array_from_process_local_data`` returns such an array as it
    is); ``ShardingError`` naming the path for one whose layout (or shape) differs."""
    done = set()
    for i, x in enumerate(call.leaves[0]):
        if not backend.place.is_global(x):
            continue
        path = call.paths[0].at(i)  # computed only for an error
        for h in range(1, len(call.leaves)):
            if call.leaves[h][i] is not x:
                raise ShardingError(
                    at(
                        call.paths[h][i],
                        f"{path} is already a global tensor, so every host must "
                        "pass that same tensor here; got something else. Pass host blocks on every "
                        "host, or the global tensor on every host.",
                    )
                )
        shape = tuple(x.shape)
        if given[i] is not None and given[i] != shape:
            raise ShardingError(
                at(
                    path,
                    f"already a global tensor of shape {shape}, but global_shape is "
                    f"{given[i]}. Drop global_shape for it, or give {shape}.",
                )
            )
        spec = specs[i]
        try:
            want = NamedSharding(mesh, spec).devices_indices_map(shape)
        except ShardingError as e:
            raise type(e)(at(path, str(e))) from None
        have = backend.place.local_ranges(x)
        if have is None or any(
            tuple((s.start, s.stop) for s in want.get(d, ())) != r for d, r in have.items()
        ):
            found = (
                "partial sums (Partial placements)"
                if have is None
                else "per device (global [start, stop) per dimension) "
                + ", ".join(f"{d}: {list(r)}" for d, r in sorted(have.items()))
            )
            raise ShardingError(
                at(
                    path,
                    f"already a global tensor, but not laid out as {spec!r} on "
                    f"{mesh!r} asks; found {found}. host_to_global_array returns a global tensor "
                    "as it is only when its layout matches: pass the partition it has, or "
                    "reshard it in the step (torchshard.maybe_shard), or read it back first "
                    "(global_to_host_array).",
                )
            )
        done.add(i)
    return frozenset(done)
