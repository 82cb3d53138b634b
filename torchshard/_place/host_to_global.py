"""Host -> global: ``host_to_global_array``, its deprecated alias, and ``host_to_global_specs``.

Data flow of ``host_to_global_array``: the current mesh, its backend and topology; the call
(``call.py``) of this host's tree; the backend's agreement step (DTensor: one exchange over
the tree, overlapping the rest and judged at the result's first use or the next call;
torch_xla has none); the call's plans (``cache.py``: kept from
an earlier call, else validated and planned by ``validate.py``); ``place.py`` hands one view
per local device to the backend. Nothing moves before every leaf is validated.
"""

from __future__ import annotations

from typing import Any

import torch

from torchshard._backend.registry import lookup
from torchshard._core.agreement import judged_in_the_call, value_check_enabled
from torchshard._core.context import current_mesh, require_mesh
from torchshard._core.deprecation import warn_once
from torchshard._core.errors import ShardingError
from torchshard._core.mesh import topology_of
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.sharding import NamedSharding
from torchshard._core.spec import DataPartitionType
from torchshard._core.tensor_spec import TensorSpec
from torchshard._core.topology import emulated
from torchshard._core.tree import LazyPaths, flatten, unflatten
from torchshard._place.call import HostCall
from torchshard._place.guard import check_caller, eagerly
from torchshard._place.host_data import check_supported_dtype, shape_dtype
from torchshard._place.place import to_global
from torchshard._place.validate import (
    check_full_batch,
    global_shapes,
    plan_leaf,
    spec_tree_of,
    specs_for,
)


def warn_partition_type(partition: Any, *, stacklevel: int) -> None:
    """The deprecation warning of a ``DataPartitionType`` passed as ``partition=``, pointing
    ``stacklevel`` frames above the caller of this function (1: the caller's caller)."""
    if isinstance(partition, DataPartitionType):
        warn_once(
            "partition-type",
            "Passing a DataPartitionType to host_to_global_array is deprecated; pass a "
            "PartitionSpec (e.g. torchshard.input_partition_spec()) instead.",
            stacklevel=stacklevel + 3,  # warn_once, this function, its caller, ...
        )


def host_to_global_array(
    host_arrays: Any, /, *, partition: Any = DEFAULT_PARTITION, global_shape: Any = None
) -> Any:
    """Turns each host's block of a batch into global tensors sharded over the current mesh.

    Every process passes its own block (a tree of numpy arrays or CPU tensors); the global
    shape is inferred from the mesh and the device -> process map, as in JAX's
    ``make_array_from_process_local_data``, or given (``global_shape``). Each device receives
    only its shard. A leaf that is already a global tensor laid out as its spec asks is
    returned as it is (as JAX does); one laid out otherwise is an error.

    Args:
        host_arrays: a tree (dicts, lists, tuples, namedtuples, dataclasses; ``None`` passes
            through) of numpy arrays or CPU tensors (or global tensors, see above).
        partition: a ``PartitionSpec``, a prefix tree of them, or (deprecated) a
            ``DataPartitionType``. Default: ``FULL``, dim 0 split over every mesh axis.
        global_shape: ``None`` (inferred), one shape (a tuple of ints) for every leaf, or a
            prefix tree of shapes and ``None``s. As in JAX, along each dimension the host's
            block is then either the whole dimension (every host passes the same values and
            each slices what its devices need, e.g. the full width of a dimension that is
            split only within hosts) or the host's own part (the inferred case).

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

    Example (mesh ``(4, 2)``, one host): 8 rows split over all 8 devices, one row each:

        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> with mesh:
        ...     g = torchshard.host_to_global_array({"x": np.arange(16).reshape(8, 2)})
        >>> g["x"].shape, g["x"].device.type
        (torch.Size([8, 2]), 'xla')
    """
    # The hot path of a training loop: every frame counts here (after a transfer the caches
    # are cold), so the steps up to the engine are written out (docs/design.md, "Engine").
    if torch.compiler.is_compiling():  # torch.compile traces the call: place eagerly
        return eagerly(_judged_in_the_call)(host_arrays, partition, global_shape)
    check_caller("host_to_global_array")
    mesh = current_mesh()
    if mesh is None:
        mesh = require_mesh("host_to_global_array")  # raises NoMeshError
    backend = lookup(mesh)
    topology = emulated(mesh.backend) or backend.place.topology()
    if len(topology.data_hosts) != 1:
        raise ShardingError(
            f"host_to_global_array inside virtual_hosts({topology.process_count}) has only this "
            "host's data; use torchshard.testing.host_to_global_array_per_host with one tree "
            "per host."
        )
    if isinstance(partition, DataPartitionType):
        warn_partition_type(partition, stacklevel=1)
    call = HostCall((host_arrays,), partition, False, global_shape)  # one tree: as `read` checks
    # The agreement step overlaps planning and placement (no collective there; DTensor's
    # from_local is local): its end runs first on failure too, so a disagreement is the error
    # every process raises, whatever failed locally.
    checks = backend.processes
    if checks is None:  # a runtime without cross-process checks (torch_xla)
        return to_global(mesh, backend, topology, call)
    agreed = checks.agree_begin(mesh, call, what="host_to_global_array")
    try:
        out = to_global(mesh, backend, topology, call)
    except BaseException:
        agreed()
        raise
    # Judged now, or off the step's path: at the result's first use or the next call
    # (set_agreement_deferred); the value check below is a call, so it judges it first.
    out = checks.agree_after(mesh, agreed, call, out, what="host_to_global_array")
    if value_check_enabled():  # opt-in: processes that hold the same block pass equal values
        checks.check_values(mesh, out, argname="host_arrays", what="host_to_global_array")
    return out


def host_to_global_device_array(
    host_arrays: Any, /, *, partition: Any = DEFAULT_PARTITION, global_shape: Any = None
) -> Any:
    """Deprecated alias of ``host_to_global_array`` (axlearn compatibility)."""
    warn_once(
        "host_to_global_device_array",
        "host_to_global_device_array is deprecated; use host_to_global_array.",
    )
    if isinstance(partition, DataPartitionType):  # warned here, at our caller's line (once)
        warn_partition_type(partition, stacklevel=1)
    return host_to_global_array(host_arrays, partition=partition, global_shape=global_shape)


def host_to_global_specs(
    host_specs: Any, /, *, partition: Any = DEFAULT_PARTITION, global_shape: Any = None
) -> Any:
    """The ``TensorSpec`` tree that ``host_to_global_array`` would return; nothing moves.

    Args:
        host_specs: a tree whose leaves are ``TensorSpec``s or objects with ``.shape`` and
            ``.dtype`` (numpy arrays, tensors), each a host's block.
        partition: as for ``host_to_global_array``.
        global_shape: as for ``host_to_global_array`` (checked against each block the same
            way; the given shape is the spec's shape).

    Example (8 devices, one host):

        >>> with torchshard.Mesh(np.arange(8), ("data",)):
        ...     specs = torchshard.host_to_global_specs({"x": torchshard.TensorSpec((8, 2), torch.int64)})
        >>> specs["x"].shape
        (8, 2)
    """  # noqa: E501
    mesh = require_mesh("host_to_global_specs")
    backend = lookup(mesh)
    topology = topology_of(mesh)
    warn_partition_type(partition, stacklevel=1)
    spec_tree, full = spec_tree_of(partition)
    # Anything with .shape and .dtype is a leaf, even a dataclass or namedtuple (which would
    # otherwise be a node); the partition is then matched against a tree of TensorSpecs.
    leaves, treespec = flatten(host_specs, is_leaf=_has_shape_and_dtype)
    where = LazyPaths(treespec, "host_specs")  # computed only for an error
    shapes_dtypes = [shape_dtype(leaf, where.at(i)) for i, leaf in enumerate(leaves)]
    for i, (_, dtype) in enumerate(shapes_dtypes):
        check_supported_dtype(dtype, where.at(i))
    as_specs = unflatten(treespec, [TensorSpec(s, d) for s, d in shapes_dtypes])
    specs = specs_for(spec_tree, as_specs, len(leaves), "host_specs")
    given = global_shapes(global_shape, as_specs, len(leaves), "host_specs", where)
    if full:
        check_full_batch(where, [s for s, _ in shapes_dtypes])
    out = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        # The plan of the leaf, for no device: the same validation and global shape as placing.
        p = plan_leaf(mesh, backend, specs[i], shape, given[i], topology, (), where.at(i))
        out.append(TensorSpec(p.global_shape, dtype, NamedSharding(mesh, specs[i])))
    return unflatten(treespec, out)


def _has_shape_and_dtype(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _judged_in_the_call(host_arrays: Any, partition: Any, global_shape: Any) -> Any:
    """``host_to_global_array`` with its agreement check judged in the call: run eagerly for a
    call that torch.compile traces (the graph gets the result: no tensor that waits; the
    context variable is set outside Dynamo's tracing)."""
    with judged_in_the_call():
        return host_to_global_array(host_arrays, partition=partition, global_shape=global_shape)
