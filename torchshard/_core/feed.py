"""Feeds from the mesh: which shard of the source each process reads (``feed_read_config``) and
which slice of every dimension of the global batch it supplies (``feed_slices``).

Pure index maths on the mesh and its topology (``NamedSharding``'s per-process feeds): the
processes whose devices hold the same block of dim 0 get the same shard, on any mesh (dp x tp,
dp x cp, hybrid, permuted device orders), and under ``virtual_hosts`` the emulated topology
decides. ``process_count()``/``process_index()`` are the feed only when every process holds its
own block of dim 0; on a (dp, tp) mesh with ``P("dp")`` the tp peers share a block.
"""

from __future__ import annotations

from typing import Any

from torchshard._core.checks import shape as as_shape
from torchshard._core.context import require_mesh
from torchshard._core.errors import IndivisibleError, NonUniformShardingError, ShardingError
from torchshard._core.mesh import Mesh, topology_of
from torchshard._core.partition import batch_spec
from torchshard._core.sharding import (
    check_device_process,
    check_divisible,
    dim_axes,
    dim_feeds,
    shard_counts,
)
from torchshard._core.spec import UNCONSTRAINED, DataPartitionType, PartitionSpec
from torchshard._core.topology import Topology


def resolve_mesh(mesh: Any, caller: str) -> Mesh:
    """``mesh``, or the current mesh when it is ``None``; a clear error for anything else."""
    if mesh is None:
        return require_mesh(caller)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{caller}: mesh must be a torchshard.Mesh (or None: the current mesh), but got "
            f"{type(mesh).__name__}; wrap a torch.distributed DeviceMesh with "
            "torchshard.Mesh.from_device_mesh(device_mesh)."
        )
    return mesh


def resolve_spec(partition: Any, mesh: Mesh, caller: str) -> PartitionSpec:
    """The spec ``partition`` stands for on ``mesh``: a ``PartitionSpec`` as it is, a
    ``DataPartitionType`` as ``data_partition_type_to_spec`` reads it (on ``mesh``)."""
    if isinstance(partition, PartitionSpec):
        return partition
    if partition is DataPartitionType.FULL:
        return PartitionSpec(mesh.axis_names)
    if partition is DataPartitionType.REPLICATED:
        return PartitionSpec()
    if partition is DataPartitionType.BATCH:
        return batch_spec(mesh)
    tree = isinstance(partition, (dict, list, tuple))
    raise TypeError(
        f"{caller}: partition must be one PartitionSpec (e.g. P('dp')) or a DataPartitionType, "
        f"but got {partition!r:.80} of type {type(partition).__name__}"
        + (
            "; a tree of specs has one layout per leaf: pass the spec of the batch leaves "
            "(e.g. partition['tokens'])."
            if tree
            else "; for a batch every process reads whole (replicated), pass P()."
        )
    )


def process_topology(mesh: Mesh, caller: str) -> Topology:
    """The topology of ``mesh`` (its runtime's, or an installed emulation's), checked: the mesh
    covers every device and this process owns one of them."""
    topology = topology_of(mesh)
    try:
        check_device_process(mesh, topology.device_process)
    except ShardingError as e:
        raise ShardingError(f"{caller}: {e}") from None
    if topology.process_index not in topology.device_process:
        raise ShardingError(
            f"{caller}: process {topology.process_index} owns no device of {mesh!r}, so it "
            "supplies no block of the batch."
        )
    return topology


def _not_uniform(caller: str, spec: PartitionSpec, mesh: Mesh, dim: int, sets: Any) -> Exception:
    return NonUniformShardingError(
        f"{caller}: {spec!r} on {mesh!r} is not process-uniform along dim {dim}: the processes "
        f"hold the shard sets {dict(sorted(sets.items()))} of it, which are not equal, disjoint "
        "groups, so no split of the data into shards gives every process its block. Lay the "
        "mesh out so that each process's devices hold whole blocks along the axes that split "
        f"dim {dim} (create_device_mesh does), or split dim {dim} over other axes."
    )


def feed_read_config(partition: Any, *, mesh: Mesh | None = None) -> dict[str, int]:
    """Which shard of the source this process reads: ``{"num_shards", "shard_index"}`` for
    dim 0 of ``partition`` on ``mesh`` (default: the current mesh).

    The processes whose devices hold the same block of dim 0 get the same shard (the same
    examples), and each distinct block is one shard, numbered by its position in the global
    batch; on any mesh (dp x tp, dp x cp, hybrid, permuted device orders) and under
    ``torchshard.testing.virtual_hosts``. The answer is what ``host_sampler`` (or a
    ``DistributedSampler(num_replicas=num_shards, rank=shard_index)``) takes. On a
    ``(dp=2, tp=2)`` mesh with ``P("dp")``, the two tp peers of each dp row get the same shard:
    ``{"num_shards": process_count(), "shard_index": process_index()}`` would give them
    different examples under a layout that says they hold the same block.

    Args:
        partition: the batch's ``PartitionSpec`` (only its dim 0 matters here; see
            ``feed_slices`` for the other dims) or a ``DataPartitionType``.
        mesh: a ``torchshard.Mesh`` (``Mesh.from_device_mesh(dm)`` for a DeviceMesh); ``None``:
            the current mesh.

    Raises:
        NoMeshError: no ``mesh`` and no current mesh.
        TypeError: a ``partition`` that is not one spec (a tree, ``None``, a str), or a
            ``mesh`` that is not a ``torchshard.Mesh``.
        ShardingError: dim 0 is ``UNCONSTRAINED`` (the feed is undefined), or names an axis
            the mesh lacks.
        NonUniformShardingError: the processes' blocks of dim 0 are not equal, disjoint groups
            (no split of the source serves them).

    Example (mesh ``(dp=2, tp=4)`` over 8 devices, 4 hosts of 2 devices: hosts 0 and 1 hold
    the first block of the batch, hosts 2 and 3 the second):
        >>> from torchshard.testing import virtual_hosts
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
        >>> with virtual_hosts(4, process_index=1), mesh:
        ...     torchshard.feed_read_config(torchshard.P("dp"))
        {'num_shards': 2, 'shard_index': 0}
        >>> with virtual_hosts(4, process_index=2), mesh:
        ...     torchshard.feed_read_config(torchshard.P("dp"))
        {'num_shards': 2, 'shard_index': 1}
    """
    caller = "feed_read_config"
    mesh = resolve_mesh(mesh, caller)
    spec = resolve_spec(partition, mesh, caller)
    if len(spec) and spec[0] is UNCONSTRAINED:
        raise ShardingError(
            f"{caller}: dim 0 of {spec!r} is UNCONSTRAINED, which leaves the feed undefined "
            "(the layout of the batch is the compiler's choice); name the mesh axes that split "
            "the batch, e.g. P('dp')."
        )
    dim0 = PartitionSpec(spec[0]) if len(spec) else PartitionSpec()
    try:
        axes = dim_axes(mesh, dim0, 1)
    except ShardingError as e:
        raise ShardingError(f"{caller}: {e}") from None
    topology = process_topology(mesh, caller)
    f = dim_feeds(mesh, axes, topology.device_process, (topology.process_index,))[0]
    if f.count is None:
        raise _not_uniform(caller, spec, mesh, 0, f.sets)
    return {"num_shards": f.count, "shard_index": f.feed(topology.process_index)}


def feed_processes(partition: Any, *, mesh: Mesh | None, caller: str) -> tuple[int, ...]:
    """The processes that read this process's feed (``feed_read_config``'s shard), itself
    included, ascending: the peers that hold the same block of dim 0 (a tp or cp axis the
    partition does not split). Errors as ``feed_read_config``'s, naming ``caller``."""
    mesh = resolve_mesh(mesh, caller)
    spec = resolve_spec(partition, mesh, caller)
    mine = feed_read_config(spec, mesh=mesh)["shard_index"]
    dim0 = PartitionSpec(spec[0]) if len(spec) else PartitionSpec()
    topology = process_topology(mesh, caller)
    f = dim_feeds(mesh, dim_axes(mesh, dim0, 1), topology.device_process)[0]
    return tuple(p for p in sorted(set(topology.device_process)) if f.feed(p) == mine)


def feed_slices(
    partition: Any, global_shape: Any, *, mesh: Mesh | None = None
) -> tuple[slice, ...]:
    """This process's slice of every dimension of a global array of ``global_shape`` laid out
    by ``partition`` on ``mesh`` (default: the current mesh): the block it passes to
    ``host_to_global_array`` is ``global_value[feed_slices(...)]``.

    For specs that split more than the batch (``P("dp", "cp")`` on a sequence dim,
    ``P("dp", "tp")``): dim 0's slice is the shard ``feed_read_config`` names (the batch's
    rows ``shard_index * b`` to ``(shard_index + 1) * b`` for ``b = global_shape[0] //
    num_shards``), and every other dim's slice says which part of each example this process
    reads (processes whose devices hold the same part get the same slice). A dim the spec does
    not split is whole.

    Args:
        partition: a ``PartitionSpec`` (or a ``DataPartitionType``) for an array of rank
            ``len(global_shape)``.
        global_shape: the global array's shape (ints >= 0).
        mesh: a ``torchshard.Mesh``; ``None``: the current mesh.

    Raises:
        NoMeshError, TypeError: as ``feed_read_config``.
        ShardingError: a spec longer than the shape, an ``UNCONSTRAINED`` entry or an unknown
            axis; a dimension whose blocks on this process are not one slice (its devices hold
            shards that are not neighbours: ``host_to_global_array`` takes their concatenation,
            which no slice describes).
        IndivisibleError: a split dimension not divisible by its shard count.
        NonUniformShardingError: a split dimension whose per-process blocks are not equal,
            disjoint groups.

    Example (mesh ``(dp=2, cp=4)`` over 8 devices, 4 hosts of 2 devices; host 1 holds rows 0:2
    and the second half of each sequence):
        >>> from torchshard.testing import virtual_hosts
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(2, 4), ("dp", "cp"))
        >>> with virtual_hosts(4, process_index=1), mesh:
        ...     torchshard.feed_slices(torchshard.P("dp", "cp"), (4, 16))
        (slice(0, 2, None), slice(8, 16, None))
    """
    caller = "feed_slices"
    mesh = resolve_mesh(mesh, caller)
    spec = resolve_spec(partition, mesh, caller)
    shape = as_shape(global_shape, "global_shape")
    try:
        axes = dim_axes(mesh, spec, len(shape))
        check_divisible(mesh, spec, axes, shape)
    except IndivisibleError as e:
        raise IndivisibleError(f"{caller}: {e}") from None
    except ShardingError as e:
        raise ShardingError(f"{caller}: {e}") from None
    topology = process_topology(mesh, caller)
    return tuple(
        process_slice(caller, mesh, spec, axes, i, n, topology) for i, n in enumerate(shape)
    )


def process_slice(
    caller: str,
    mesh: Mesh,
    spec: PartitionSpec,
    axes: Any,
    dim: int,
    n: int,
    topology: Topology,
) -> slice:
    """This process's slice of dim ``dim`` (size ``n``, divisible by its shard count) of an
    array laid out by ``axes`` (``dim_axes`` of ``spec``) on ``mesh``; errors name ``caller``."""
    k = shard_counts(mesh, axes)[dim]
    if k == 1:
        return slice(0, n)
    f = dim_feeds(mesh, axes, topology.device_process, (topology.process_index,))[dim]
    if f.count is None:
        raise _not_uniform(caller, spec, mesh, dim, f.sets)
    held = f.held(topology.process_index)
    if list(held) != list(range(held[0], held[0] + len(held))):
        raise ShardingError(
            f"{caller}: along dim {dim} this process's devices hold the shards {list(held)} of "
            f"{k} under {spec!r} on {mesh!r}, which are not neighbours, so its block is no "
            "slice of the global array (host_to_global_array takes their concatenation, in "
            "order). Read those shards by NamedSharding(mesh, spec).devices_indices_map("
            "global_shape), or lay the mesh out so that each process's devices are neighbours "
            "along the axes that split the dimension."
        )
    chunk = n // k
    return slice(held[0] * chunk, (held[-1] + 1) * chunk)
