"""Local views of global batches, for the steps of stacks that compute per process:
``to_local`` (DTensor leaves -> their local blocks: FSDP2, DDP, torchtitan) and ``to_submesh``
(DTensor leaves re-homed on a sub-mesh such as ``device_mesh["tp"]``: tensor and sequence
parallel modules live there).

Each leaf's backend decides (``lookup(tensor)``): a backend with ``LocalViews`` (DTensor)
answers; one without (torch_xla, whose SPMD step takes the global tensors themselves) leaves its
tensors as they are, as every leaf that is no tensor. Trees are rebuilt, never mutated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchshard._backend.protocols import LocalViews
from torchshard._backend.registry import lookup
from torchshard._core.errors import ShardingError, at
from torchshard._core.mesh import Mesh as MeshValue
from torchshard._core.tree import LazyPaths, flatten, unflatten
from torchshard._mesh.mesh import Mesh


def _views_of(leaf: Any) -> LocalViews | None:
    """The ``LocalViews`` of ``leaf``'s backend, or ``None`` (not a tensor, or a backend whose
    step takes global tensors)."""
    if not isinstance(leaf, torch.Tensor):
        return None
    return lookup(leaf).views


def to_local(tree: Any, /) -> Any:
    """``tree`` with every DTensor leaf replaced by this process's local block
    (``DTensor.to_local()``: a plain tensor on the process's device, no copy, differentiable);
    every other leaf is unchanged: plain tensors, numpy arrays, Python values and XLA tensors
    (torch_xla's SPMD step takes the global tensors themselves).

    For the steps of stacks that compute on per-process tensors: FSDP2's ``fully_shard`` and
    DDP modules, torchtitan's ``train_step``, torch's ``context_parallel`` buffers. A global
    batch made with ``P("dp")`` on a 1-D mesh gives each process exactly the rows a
    ``DistributedSampler`` feed would. No mesh is needed: each DTensor carries its own.

    Args:
        tree: a tensor or a tree (dicts, lists, tuples, namedtuples, dataclasses) of them.

    Returns:
        A new tree of the same structure.

    Raises:
        ShardingError: naming the leaf, for a DTensor holding partial sums (``Partial``): its
            local tensor is no block of its value (reduce it first).

    Example (a DTensor batch of 2 processes, on each of them)::

        batch = torchshard.host_to_global_array({"x": x, "y": y}, partition=P("dp"))
        loss = loss_fn(fsdp_model(torchshard.to_local(batch)["x"]), ...)
    """
    return _map_views(tree, lambda views, leaf: views.to_local(leaf))


def _map_views(tree: Any, view: Callable[[Any, Any], Any]) -> Any:
    """``tree`` with ``view(views, leaf)`` for each leaf whose backend has local views (every
    other leaf unchanged); a ``ShardingError`` gets the leaf's path."""
    leaves, treespec = flatten(tree)
    where = LazyPaths(treespec, "tree")
    out = []
    for i, leaf in enumerate(leaves):
        views = _views_of(leaf)
        if views is None:
            out.append(leaf)
            continue
        try:
            out.append(view(views, leaf))
        except ShardingError as e:
            raise type(e)(at(where[i], str(e))) from None
    return unflatten(treespec, out)


def _submesh(submesh: Any) -> Mesh:
    """``submesh`` as a bound ``torchshard.Mesh`` of a backend with local views."""
    if isinstance(submesh, MeshValue):
        mesh = Mesh.of(submesh)
    else:
        try:
            mesh = Mesh.from_device_mesh(submesh)
        except TypeError:
            raise TypeError(
                "to_submesh: submesh must be a torch.distributed DeviceMesh (a sub-mesh of the "
                "DTensors' mesh, e.g. device_mesh['tp']) or a torchshard.Mesh over one, but got "
                f"{type(submesh).__name__}."
            ) from None
        except ShardingError as e:
            raise type(e)(f"to_submesh: submesh: {e}") from None
    if lookup(mesh).views is None:
        raise TypeError(
            f"to_submesh: submesh {mesh!r} is a mesh of the {mesh.backend} backend, whose step "
            "takes global tensors (there is nothing to re-home); to change a layout in the "
            "step use with_sharding_constraint."
        )
    return mesh


def to_submesh(tree: Any, /, submesh: Any) -> Any:
    """``tree`` with every DTensor leaf re-homed on ``submesh``, a sub-mesh of its mesh that
    holds this process (e.g. ``device_mesh["tp"]`` of a ``(dp, tp)`` mesh), with the
    placements it has on ``submesh``'s axes; every other leaf is unchanged.

    For modules that live on a sub-mesh: tensor and sequence parallel
    (``parallelize_module(model, device_mesh["tp"], ...)``) take inputs on ``mesh["tp"]``, not
    on the ``(dp, tp)`` mesh a batch is made on. The re-homed tensor is the block that this
    process's peers along ``submesh``'s axes hold together: ``P("dp")`` on ``(dp, tp)`` becomes
    the dp row's rows, ``Replicate()`` on ``mesh["tp"]`` (what ``ColwiseParallel`` expects);
    ``P("dp", "tp")`` on a ``[batch, seq, ...]`` leaf becomes ``Shard(1)`` on ``mesh["tp"]``
    (sequence parallel's input). The local block is the same tensor (no copy, no collective;
    differentiable).

    Args:
        tree: a tensor or a tree of them.
        submesh: a ``torch.distributed`` ``DeviceMesh`` sub-mesh (``device_mesh["tp"]``,
            ``device_mesh["dp", "cp"]``), used as it is (the modules' own mesh object), or a
            ``torchshard.Mesh`` of the dtensor backend over one (its ``native`` DeviceMesh when
            it has one, else the DTensor's mesh sliced by its axis names). A DTensor already on
            it is returned as it is.

    Returns:
        A new tree of the same structure.

    Raises:
        TypeError: ``submesh`` is neither (or a mesh of a backend whose step takes global
            tensors).
        ShardingError: naming the leaf: its mesh does not contain ``submesh`` (an axis it
            lacks, another slice, axes out of order), or its placements cannot be expressed on
            ``submesh``: partial sums over an axis ``submesh`` drops, a dim split over an axis
            of ``submesh`` before one it drops (strided parts), a ``_StridedShard``.

    Example (4 processes, mesh ``(dp=2, tp=2)``; on each of them)::

        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, dm["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        with torchshard.Mesh.from_device_mesh(dm):
            batch = torchshard.host_to_global_array(rows, partition=P("dp"))
        out = model(torchshard.to_submesh(batch, dm["tp"]))
    """
    mesh = _submesh(submesh)
    return _map_views(tree, lambda views, leaf: views.to_submesh(leaf, mesh))
