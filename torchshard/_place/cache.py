"""The plan cache: a call's plans, kept and keyed by everything they depend on.

The key is the mesh (and, by identity, its native mesh), the topology, the partition, the tree
structures, a given global shape, and each leaf's type, shape and dtype. A training loop
repeats one key, so its calls skip validation and planning. The cache holds plans only:
placing binds a plan to its backend (``place.bind``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchshard._backend.protocols import Backend
from torchshard._core.mesh import Mesh
from torchshard._core.partition import DEFAULT_PARTITION
from torchshard._core.spec import DataPartitionType, PartitionSpec
from torchshard._core.topology import Topology
from torchshard._place.call import CallPlan, HostCall
from torchshard._place.host_data import is_host_tensor
from torchshard._place.validate import validated_plan

# The plans of earlier calls (see ``key``); cleared when it grows past the bound. Reads and
# writes are single dict operations (atomic under the GIL): threads at worst plan twice.
_CALLS: dict[tuple[Any, ...], CallPlan] = {}
_CALLS_BOUND = 512
# The last hit, ``(key, plan)``: a training loop repeats one key, and comparing it with the last
# one (identity first, element by element) costs less than hashing it for the dict.
_LAST: list[tuple[tuple[Any, ...], CallPlan] | None] = [None]


def key(mesh: Mesh, topology: Topology, call: HostCall) -> tuple[Any, ...] | None:
    """What a call's plans depend on, or ``None`` when the call is not cached (a partition
    given as a tree of specs, a given global shape that is not a tuple of ints, a leaf that is
    neither a numpy array nor a tensor used as it is, ``host_data.is_host_tensor``). The
    leaf's type is part of the key: a tensor that needs no conversion is used as it is on a
    hit."""
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
    # bindings are made for the key's mesh, so its native mesh is part of the key, by identity
    # (the kept key's mesh keeps its native alive, so an id is never reused while kept).
    sig: list[Any] = [mesh, id(mesh.native), topology, partition, call.treespecs, shape]
    for leaves in call.leaves:
        for x in leaves:
            cls = type(x)
            if cls is np.ndarray:
                sig.append((cls, x.shape, x.dtype))
            elif is_host_tensor(x):
                sig.append((x.shape, x.dtype))
            else:
                return None
    return tuple(sig)


def plan_call(mesh: Mesh, backend: Backend, topology: Topology, call: HostCall) -> CallPlan:
    """``call``'s plans: the kept ones for its key, else validated and planned now (and kept
    when the call has a key); raises before anything moves (``validate.validated_plan``)."""
    k = key(mesh, topology, call)
    if k is not None:
        last = _LAST[0]
        if last is not None and last[0] == k:
            return last[1]
        cached = _CALLS.get(k)
        if cached is not None:
            _LAST[0] = (k, cached)
            return cached
    planned = validated_plan(mesh, backend, topology, call)
    if k is not None:
        if len(_CALLS) >= _CALLS_BOUND:
            _CALLS.clear()
            _LAST[0] = None
        _CALLS[k] = planned
    return planned


def clear() -> None:
    """Forgets every kept plan."""
    _CALLS.clear()
    _LAST[0] = None
