"""The engine of host -> global: ``read`` the host trees, ``plan`` every leaf, ``place`` them.

Everything that turns host data into global tensors goes through these three functions:
``host_to_global_array``, the per-host emulation (``torchshard.testing``) and
``GlobalBatchLoader`` (on its thread). Nothing here knows which of them called, whether the hosts
are emulated, or whether processes are compared:

- ``read(trees, topology, partition, per_host=...)``: the call's host trees, one per host this
  process supplies (``topology.data_hosts``: its own; every host under ``virtual_hosts``),
  flattened. Paths are named after the argument (``host_arrays[...]``, or
  ``per_host_arrays[h][...]`` for a list of per-host trees) and computed only for errors.
- ``plan(mesh, backend, topology, call)``: validates every leaf and plans it (pure index maths,
  ``torchshard._core.plan``; the backend only says whether it can express a layout) before
  anything moves. Plans are kept, keyed by everything they depend on (mesh, topology,
  partition, tree structures, each leaf's type, shape and dtype), so a training loop's repeated
  calls skip validation and planning.
- ``place(backend, mesh, plan, call, background=...)``: one view per planned device of each
  leaf, handed to the backend, which builds the global tensor.

``to_global`` is ``plan`` then ``place``, what every caller does once it holds a ``HostCall``.

The cross-process agreement step is the backend's (``Backend.agree``), called by the entry
points before ``plan``; a loader calls it on its consumer's thread instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from torchshard._backend import Backend
from torchshard._core.agreement import describe
from torchshard._core.errors import ShardingError, TreeStructureError, at
from torchshard._core.mesh import Mesh
from torchshard._core.partition import DEFAULT_PARTITION, data_partition_type_to_spec
from torchshard._core.plan import HostPlan, SharedBlock, plan_from_local, shared_blocks
from torchshard._core.sharding import NamedSharding
from torchshard._core.spec import DataPartitionType, PartitionSpec
from torchshard._core.topology import Topology
from torchshard._core.tree import LazyPaths, broadcast_prefix, flatten, unflatten
from torchshard._host_data import HAS_NAMED_TENSORS, SUPPORTED_DTYPES, as_host_tensor

_REPLICATED = PartitionSpec()
_STRIDED = torch.strided
SUPPORTED = frozenset(SUPPORTED_DTYPES)
MakeGlobal = Callable[[list[torch.Tensor]], torch.Tensor]


class HostCall:
    """The host data of one call: one tree per host this process supplies, flattened.

    ``leaves[h][i]`` is leaf ``i`` of host ``h``'s tree (``h`` counts the trees given, in
    ``topology.data_hosts`` order); ``paths[h][i]`` its path (computed on first use: only
    errors need it); ``tensors[h][i]`` the leaf as a CPU tensor once ``plan`` has validated it
    (``None`` when a cached plan skipped that: the cache key then guarantees the leaves need no
    checks).
    """

    __slots__ = (
        "_paths",
        "global_shape",
        "leaves",
        "partition",
        "per_host",
        "tensors",
        "trees",
        "treespecs",
    )

    def __init__(
        self, trees: Sequence[Any], partition: Any, per_host: bool, global_shape: Any = None
    ) -> None:
        self.partition = partition
        self.per_host = per_host
        self.global_shape = global_shape  # None: inferred; else a shape, or a prefix tree
        self.trees = trees
        if len(trees) == 1:  # the common case, without the generic bookkeeping
            leaves, treespec = flatten(trees[0])
            self.leaves = [leaves]
            self.treespecs = (treespec,)
        else:
            flat = [flatten(t) for t in trees]
            self.leaves = [f[0] for f in flat]
            self.treespecs = tuple(f[1] for f in flat)
        self._paths: list[LazyPaths] | None = None
        self.tensors: list[list[torch.Tensor]] | None = None

    @property
    def argname(self) -> str:
        """The argument the trees were passed as (errors name it)."""
        return "per_host_arrays" if self.per_host else "host_arrays"

    @property
    def paths(self) -> list[LazyPaths]:
        """Per host, its leaves' paths as code (``host_arrays['x']``,
        ``per_host_arrays[1]['x']``)."""
        if self._paths is None:
            names = (
                [f"per_host_arrays[{h}]" for h in range(len(self.treespecs))]
                if self.per_host
                else ["host_arrays"] * len(self.treespecs)
            )
            self._paths = [
                LazyPaths(spec, name) for spec, name in zip(self.treespecs, names, strict=True)
            ]
        return self._paths

    @property
    def treespec(self) -> Any:
        """The structure of the first host's tree (every host's must be the same)."""
        return self.treespecs[0]

    # -- what the agreement step compares (``Backend.agree``) -------------------------------
    def describe(self) -> list[str]:
        """The structure and partition (and a given global shape), then each leaf's shape and
        dtype (first host)."""
        lines = describe(self.treespecs[0], self.leaves[0], self.partition)
        if self.global_shape is not None:
            lines[0] += f", global_shape {self.global_shape!r}"
        return lines

    def path(self, i: int) -> str:
        """Leaf ``i``'s path in the first host's tree."""
        return self.paths[0][i]


def read(
    trees: Sequence[Any],
    topology: Topology,
    partition: Any,
    *,
    per_host: bool,
    global_shape: Any = None,
) -> HostCall:
    """The call of ``trees``: one per host in ``topology.data_hosts``, in that order.

    ``per_host``: the trees were given as a list of per-host trees (``per_host_arrays``), not as
    this host's one tree (``host_arrays``); it names the paths of errors. ``global_shape``: see
    ``host_to_global_array``.
    """
    count = len(topology.data_hosts)
    if len(trees) != count:
        name = "per_host_arrays" if per_host else "host_arrays"
        raise ShardingError(
            f"{name}: expected one tree per host, {count} in all, but got {len(trees)}."
        )
    return HostCall(trees, partition, per_host, global_shape)


class CallPlan(NamedTuple):
    """A call's plans, and per leaf the backend's ``make_global`` with all but shards bound
    (``None`` until the call is cached: a first call goes through ``make_global``)."""

    plans: list[HostPlan | None]  # None: the leaf is already global, placed as it is
    makers: list[MakeGlobal] | None
    slot: dict[int, int]  # host -> index of its tree in the call
    placers: list[Callable[[torch.Tensor], torch.Tensor]] | None = None
    """With ``makers``, on one host: per leaf, the host tensor -> its global tensor (the views
    cut and handed to the maker in one step)."""
    shared: tuple[tuple[int, PartitionSpec, tuple[SharedBlock, ...]], ...] = ()
    """With several hosts' trees: ``(leaf, spec, blocks)`` for each leaf some of whose blocks
    more than one host supplies; ``place`` compares those hosts' values before anything moves."""


# The plans of earlier calls (see ``_key``); cleared when it grows past the bound. Reads and
# writes are single dict operations (atomic under the GIL): threads at worst plan twice.
_CALLS: dict[tuple[Any, ...], CallPlan] = {}
_CALLS_BOUND = 512
# The last hit, ``(key, plan)``: a training loop repeats one key, and comparing it with the last
# one (identity first, element by element) costs less than hashing it for the dict.
_LAST: list[tuple[tuple[Any, ...], CallPlan] | None] = [None]


def _key(mesh: Mesh, topology: Topology, call: HostCall) -> tuple[Any, ...] | None:
    """What a call's plans depend on, or ``None`` when the call is not cached (a partition
    given as a tree of specs, a leaf that is not a CPU tensor or a numpy array, a tensor that
    is sparse, named, needs grad or has an unsupported dtype). The leaf's type is part of the
    key: a tensor that needs no conversion is used as it is on a hit."""
    partition = call.partition
    if not (
        partition is DEFAULT_PARTITION
        or type(partition) is PartitionSpec
        or isinstance(partition, DataPartitionType)
    ):
        return None
    shape = call.global_shape
    if shape is not None and not (type(shape) is tuple and all(type(n) is int for n in shape)):
        return None
    # Equal meshes may stand for different native meshes (two equal DeviceMeshes, say): the
    # makers are bound to the key's mesh, so its native mesh is part of the key, by identity
    # (the kept key's mesh keeps its native alive, so an id is never reused while kept).
    sig: list[Any] = [mesh, id(mesh.native), topology, partition, call.treespecs, shape]
    for leaves in call.leaves:
        for x in leaves:
            cls = type(x)
            if cls is torch.Tensor:
                if (
                    not x.is_cpu
                    or x.requires_grad
                    or x.dtype not in SUPPORTED
                    or x.layout is not _STRIDED
                    or (HAS_NAMED_TENSORS and x.has_names())
                ):
                    return None
                sig.append((x.shape, x.dtype))
            elif cls is np.ndarray:
                sig.append((cls, x.shape, x.dtype))
            else:
                return None
    return tuple(sig)


def plan(mesh: Mesh, backend: Backend, topology: Topology, call: HostCall) -> CallPlan:
    """Validates and plans every leaf of ``call`` (cached); raises before anything moves.

    Raises ``ShardingError``/``TreeStructureError``/``TypeError`` naming the leaf's path:
    hosts whose trees differ, an unsupported leaf, hosts whose leaves differ in shape or
    dtype, FULL leaves that disagree on the batch size, a spec the leaf or mesh cannot take.
    """
    key = _key(mesh, topology, call)
    if key is not None:
        last = _LAST[0]
        if last is not None and last[0] == key:
            return last[1]
        cached = _CALLS.get(key)
        if cached is not None:
            _LAST[0] = (key, cached)
            return cached
    planned = _plan(mesh, backend, topology, call)
    if key is not None:
        if len(_CALLS) >= _CALLS_BOUND:
            _CALLS.clear()
            _LAST[0] = None
        makers = [backend.global_maker(mesh, p.axes, p.global_shape) for p in planned.plans]
        placers = None
        if len(planned.slot) == 1:
            placers = [one_host_placer(p, m) for p, m in zip(planned.plans, makers, strict=True)]
        _CALLS[key] = planned._replace(makers=makers, placers=placers)
    return planned


def _plan(mesh: Mesh, backend: Backend, topology: Topology, call: HostCall) -> CallPlan:
    spec_tree, full = spec_tree_of(call.partition)
    treespec = call.treespec
    for h, other in enumerate(call.treespecs[1:], start=1):
        if other != treespec:
            raise TreeStructureError(
                f"{call.argname}[{h}] has a different structure from {call.argname}[0]: "
                f"expected {treespec}, got {other}."
            )
    n = len(call.leaves[0])
    paths = call.paths[0]
    specs = specs_for(spec_tree, call.trees[0], n, call.argname)
    given = global_shapes(call.global_shape, call.trees[0], n, call.argname, paths)
    devices = tuple(backend.local_devices(mesh))
    _check_local_owner(topology, devices)
    done = already_global(mesh, backend, call, specs, given)
    tensors = call.tensors = host_tensors(call, done)
    for i in range(n):
        if i in done:
            continue
        ref = tensors[0][i]
        for h in range(1, len(tensors)):
            t = tensors[h][i]
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise ShardingError(
                    f"{call.paths[h][i]}: every host must pass the same shape and dtype for a "
                    f"leaf; expected {tuple(ref.shape)} {ref.dtype} (host 0), got "
                    f"{tuple(t.shape)} {t.dtype}."
                )
    shapes = [tuple(t.shape) for t in tensors[0]]
    if full and done:  # a global leaf is not a host batch
        host = [i for i in range(n) if i not in done]
        check_full_batch([paths[i] for i in host], [shapes[i] for i in host])
    elif full:
        check_full_batch(paths, shapes)
    plans: list[HostPlan | None] = []
    for i in range(n):
        if i in done:
            plans.append(None)
            continue
        try:
            p = plan_from_local(
                mesh, specs[i], shapes[i], topology.device_process, devices, given[i]
            )
            backend.check_layout(mesh, p.axes)
        except ShardingError as e:
            raise type(e)(at(paths[i], str(e))) from None
        plans.append(p)
    slot = {h: k for k, h in enumerate(topology.data_hosts)}
    shared: tuple[tuple[int, PartitionSpec, tuple[SharedBlock, ...]], ...] = ()
    if len(slot) > 1:  # virtual hosts: one process supplies the blocks hosts may share
        found = (  # leaves already global (no plan) are one tensor on every host
            (i, specs[i], shared_blocks(mesh, p)) for i, p in enumerate(plans) if p is not None
        )
        shared = tuple(entry for entry in found if entry[2])
    return CallPlan(plans, None, slot, shared=shared)


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
                f"{paths[i]}: under DataPartitionType.FULL every leaf is a per-host batch split "
                f"along dim 0, so all leaves must have the same batch size; expected {batch} "
                f"(the size of {paths[first]}), got {s[0]} (shape {s})."
            )


@functools.lru_cache(maxsize=64)
def _check_local_owner(topology: Topology, devices: tuple[int, ...]) -> None:
    """The backend's local devices must belong to the hosts this process supplies data for
    (checked once per pair)."""
    owners = {topology.device_process[d] for d in devices}
    if not owners <= set(topology.data_hosts):
        raise RuntimeError(
            f"the backend's local devices {devices} belong to processes {sorted(owners)}, "
            f"not to this process ({topology.process_index})."
        )


def _host_tensor(x: Any, paths: LazyPaths, i: int) -> torch.Tensor:
    """Leaf ``i`` as a CPU tensor (its path is computed only for an error)."""
    if (
        type(x) is torch.Tensor
        and x.is_cpu
        and not x.requires_grad
        and x.dtype in SUPPORTED
        and x.layout is _STRIDED
        and not (HAS_NAMED_TENSORS and x.has_names())
    ):
        return x
    return as_host_tensor(x, paths[i])


def host_tensors(call: HostCall, done: Container[int] = ()) -> list[list[torch.Tensor]]:
    """Every host's leaves as CPU tensors (numpy zero-copy); ``TypeError`` naming the path.
    The leaves in ``done`` (already global) stay as they are."""
    return [
        [x if i in done else _host_tensor(x, paths, i) for i, x in enumerate(leaves)]
        for leaves, paths in zip(call.leaves, call.paths, strict=True)
    ]


def _is_shape(x: Any) -> bool:
    return isinstance(x, (tuple, list, torch.Size)) and all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in x
    )


def global_shapes(
    given: Any, tree: Any, n: int, argname: str, paths: Any
) -> list[tuple[int, ...] | None]:
    """The given global shape of each of ``tree``'s ``n`` leaves (``None``: inferred):
    ``given`` is one shape for every leaf, or a prefix tree of shapes and ``None``s."""
    if given is None:
        return [None] * n
    if _is_shape(given):
        shapes = [given] * n
    else:
        if isinstance(given, (str, bytes, int, float)):
            raise TypeError(
                f"global_shape: expected a shape (a tuple of ints), or a tree of them (and None) "
                f"matching {argname}, but got {type(given).__name__} {given!r}."
            )
        shapes = broadcast_prefix(
            given, tree, is_prefix_leaf=_is_shape, prefix_name="global_shape", full_name=argname
        )
    out = []
    for s in shapes:
        if s is None:
            out.append(None)
            continue
        shape = tuple(int(k) for k in s)
        if any(k < 0 for k in shape):
            raise ValueError(
                f"{paths[len(out)]}: global_shape {shape} has a negative size; give the global "
                "array's shape (sizes >= 0), or None to infer it."
            )
        out.append(shape)
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
        if not backend.is_global(x):
            continue
        path = call.paths[0][i]
        for h in range(1, len(call.leaves)):
            if call.leaves[h][i] is not x:
                raise ShardingError(
                    f"{call.paths[h][i]}: {path} is already a global tensor, so every host must "
                    "pass that same tensor here; got something else. Pass host blocks on every "
                    "host, or the global tensor on every host."
                )
        shape = tuple(x.shape)
        if given[i] is not None and given[i] != shape:
            raise ShardingError(
                f"{path}: already a global tensor of shape {shape}, but global_shape is "
                f"{given[i]}. Drop global_shape for it, or give {shape}."
            )
        spec = specs[i]
        try:
            want = NamedSharding(mesh, spec).devices_indices_map(shape)
        except ShardingError as e:
            raise type(e)(at(path, str(e))) from None
        have = backend.local_ranges(x)
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
                f"{path}: already a global tensor, but not laid out as {spec!r} on "
                f"{mesh!r} asks; found {found}. host_to_global_array returns a global tensor "
                "as it is only when its layout matches: pass the partition it has, or "
                "reshard it in the step (torchshard.maybe_shard), or read it back first "
                "(global_to_host_array)."
            )
        done.add(i)
    return frozenset(done)


def place(
    backend: Backend, mesh: Mesh, planned: CallPlan, call: HostCall, *, background: bool = False
) -> Any:
    """The output tree: each leaf's global tensor, from one view per planned device.

    ``background``: the caller is a loader's thread (see ``Backend.make_global``).
    """
    slot, makers, placers = planned.slot, planned.makers, planned.placers
    hosts = call.tensors
    if hosts is None and placers is not None and not background:
        # The hot path (a training loop's repeated call): a cached plan, one host. The key
        # says the leaves need no checks: numpy leaves are converted, tensors used as they are.
        # (Every frame counts here: after a transfer the caches are cold; docs/design.md.)
        out = []
        for i, x in enumerate(call.leaves[0]):
            if type(x) is not torch.Tensor:
                x = _host_tensor(x, call.paths[0], i)
            out.append(placers[i](x))
        return call.treespecs[0].unflatten(out)
    if hosts is None:  # a cached plan: the key says these leaves need no checks
        hosts = host_tensors(call)
    if planned.shared:
        check_shared_values(call, planned, hosts)
    per_leaf = [list(t) for t in zip(*hosts, strict=True)]
    if any(p is None for p in planned.plans):  # leaves already global (never cached)
        out = [
            per[0]
            if p is None
            else backend.make_global(
                mesh, p.axes, p.global_shape, device_shards(p, per, slot), background=background
            )
            for per, p in zip(per_leaf, planned.plans, strict=True)
        ]
        return unflatten(call.treespec, out)
    if makers is not None and not background:
        out = [
            make(device_shards(p, per, slot))
            for per, p, make in zip(per_leaf, planned.plans, makers, strict=True)
        ]
    else:
        make_global = functools.partial(backend.make_global, background=True) if background else (
            backend.make_global
        )
        out = [
            make_global(mesh, p.axes, p.global_shape, device_shards(p, per, slot))
            for per, p in zip(per_leaf, planned.plans, strict=True)
        ]
    return unflatten(call.treespec, out)


def check_shared_values(call: HostCall, planned: CallPlan, hosts: list[list[torch.Tensor]]) -> None:
    """Raises ``ShardingError`` naming the leaf's path when hosts that supply the same block
    (``CallPlan.shared``) pass different values for it: each replica of the block would hold
    another host's values. Compares only the blocks hosts share."""
    slot = planned.slot
    for i, spec, blocks in planned.shared:
        for block in blocks:
            (first, first_cuts, first_devices), *others = block.owners
            ref = _narrowed(hosts[slot[first]][i], first_cuts)
            for owner, cuts, devices in others:
                got = _narrowed(hosts[slot[owner]][i], cuts)
                diff = _differ(ref, got)
                if diff is None:
                    continue
                at_ = tuple(r[0] + j for r, j in zip(block.ranges, diff, strict=True))
                rng = ", ".join(f"{a}:{b}" for a, b in block.ranges)
                raise ShardingError(
                    f"{call.paths[slot[owner]][i]}: hosts {first} and {owner} supply the same "
                    f"block [{rng}] of this leaf under {spec!r} (devices {list(first_devices)} "
                    f"take host {first}'s values, devices {list(devices)} host {owner}'s), so "
                    "they must pass equal values for it, but they differ: at global index "
                    f"{at_} host {first} has {ref[diff].item()!r} and host {owner} has "
                    f"{got[diff].item()!r}. Pass the same values on every host that shares a "
                    "block (every host, for a replicated leaf), or use a spec under which each "
                    "host feeds its own rows (e.g. torchshard.input_partition_spec())."
                )


def _narrowed(t: torch.Tensor, cuts: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    for dim, start, length in cuts:
        t = t.narrow(dim, start, length)
    return t


def _differ(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...] | None:
    """The first index at which ``a`` and ``b`` differ (NaN equals NaN), or ``None``."""
    if torch.equal(a, b):
        return None
    unequal = a != b
    if a.is_floating_point():
        unequal &= ~(a.isnan() & b.isnan())
    where = unequal.nonzero()
    if where.shape[0] == 0:
        return None
    return tuple(int(j) for j in where[0])


def to_global(
    mesh: Mesh, backend: Backend, topology: Topology, call: HostCall, *, background: bool = False
) -> Any:
    """``call``'s global tensors: ``plan`` (validated, or the cached plans), then ``place``."""
    return place(backend, mesh, plan(mesh, backend, topology, call), call, background=background)


def one_host_placer(plan: HostPlan, make: MakeGlobal) -> Callable[[torch.Tensor], torch.Tensor]:
    """The host tensor -> its global tensor, for a plan whose pieces all come from one host,
    specialised once: one ``tensor_split`` when it gives the pieces in order (dim 0 split over
    the devices in their order, the common case), else ``device_shards``; then ``make``."""
    split = plan.single_split
    if split is not None and plan.split_parts == tuple(range(len(plan.pieces))):
        dim, chunk = split
        parts = plan.local_shape[dim] // chunk
        if parts == len(plan.pieces):
            return lambda t: make(t.tensor_split(parts, dim))
    slot = {plan.pieces[0].owner: 0} if plan.pieces else {}
    return lambda t: make(device_shards(plan, [t], slot))


def device_shards(plan: HostPlan, per: list[torch.Tensor], slot: dict[int, int]) -> list[Any]:
    """The view of its owner's tensor that each planned device receives (``per[slot[h]]`` is
    host ``h``'s tensor)."""
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
