"""In-step sharding annotations: ``with_sharding_constraint`` (strict) and ``maybe_shard``
(best effort).

Both annotate global (lazy) tensors with a spec on the current mesh through the mesh's backend
(torch_xla: a custom-sharding node on a clone of the tensor; the compiler inserts whatever
collective the new layout needs). The input tensors are never modified; the result is a new
tree. The only no-ops are the documented ones: ``spec is None``, no current mesh, or a mesh of
one device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from torchshard._backend.protocols import Backend
from torchshard._backend.registry import lookup
from torchshard._core.context import current_mesh
from torchshard._core.errors import ShardingError, at
from torchshard._core.mesh import Mesh
from torchshard._core.sharding import DimAxes, dim_axes
from torchshard._core.spec import UNCONSTRAINED, PartitionSpec, as_partition_spec
from torchshard._core.tree import LazyPaths, broadcast_prefix, flatten, unflatten
from torchshard._place.validate import check_layout

_LOG = logging.getLogger("torchshard")
_LOGGED: set[str] = set()
_LOG_LOCK = threading.Lock()


def _debug_once(message: str) -> None:
    with _LOG_LOCK:
        if message in _LOGGED:
            return
        _LOGGED.add(message)
    _LOG.debug(message)


def _active_mesh() -> Mesh | None:
    """The mesh to annotate on, or None when annotating is a documented no-op."""
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return None
    return mesh


def _is_spec_leaf(s: Any) -> bool:
    # None is an empty subtree here (broadcast_prefix turns a None prefix into "no spec").
    return isinstance(s, PartitionSpec) or (
        s is not None and not isinstance(s, (dict, list, tuple))
    )


def _specs_per_leaf(spec: Any, x: Any, n: int) -> list[Any]:
    if isinstance(spec, PartitionSpec):
        return [spec] * n
    if isinstance(spec, str):
        raise TypeError(
            f"spec: expected a PartitionSpec or a tree prefix of them, but got the str {spec!r}; "
            f"write P({spec!r})."
        )
    specs = broadcast_prefix(
        spec,
        x,
        is_prefix_leaf=_is_spec_leaf,
        prefix_name="spec",
        full_name="x",
    )
    return specs


def with_sharding_constraint(x: Any, /, spec: Any) -> Any:
    """Constrains every tensor of ``x`` to ``spec`` on the current mesh (strict).

    Use it inside a step, on lazy or device tensors of the mesh's backend. Nothing is modified
    in place: the result is a new tree of new tensors with the same values.

    Args:
        x: a tensor or a tree (dicts, lists, tuples, namedtuples, dataclasses) of them.
        spec: a ``PartitionSpec`` for every leaf, or a tree prefix of ``x`` whose leaves are
            ``PartitionSpec`` or ``None`` (``None``: that subtree is left unconstrained).
            Shorter specs leave the trailing dimensions unsplit.

    Returns:
        ``x`` itself when ``spec is None``, when there is no current mesh, or on a mesh of one
        device; otherwise the constrained tree.

    Raises:
        ShardingError: (a ``ValueError``) naming the leaf: a spec longer than its rank, an axis
            that is not in the mesh, or an ``UNCONSTRAINED`` entry (only ``maybe_shard`` takes
            it). ``TypeError`` for a leaf that is not a tensor of the mesh's backend. Nothing
            is annotated when any leaf is bad.

    Example (a product's rows over ``data``, its columns over ``model``):
        >>> from torchshard.testing import assert_sharded
        >>> from torchshard import P
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> with mesh:
        ...     x = torchshard.host_to_global_array(np.ones((8, 4), np.float32))
        ...     y = torchshard.with_sharding_constraint(x @ x.T, P("data", "model"))
        ...     assert_sharded(y, P("data", "model"))
        >>> y.shape
        torch.Size([8, 8])
    """
    if spec is None:
        return x
    mesh = _active_mesh()
    if mesh is None:
        return x
    backend = lookup(mesh)
    leaves, treespec = flatten(x, name="x")
    specs = _specs_per_leaf(spec, x, len(leaves))
    where = LazyPaths(treespec, "x")
    plan: list[DimAxes | None] = []
    for i, (leaf, s) in enumerate(zip(leaves, specs, strict=True)):
        if s is None:
            plan.append(None)
            continue
        if not isinstance(s, PartitionSpec):
            raise TypeError(
                f"spec (for {where[i]}): expected a PartitionSpec or None, but got {s!r} of "
                f"type {type(s).__name__}; wrap axis names in P(...)."
            )
        if not backend.place.is_global(leaf):
            raise TypeError(
                at(
                    where[i],
                    f"with_sharding_constraint annotates tensors of the {backend.name} "
                    f"backend (inside a step), but got {_describe(leaf)}. Move host data with "
                    "host_to_global_array first.",
                )
            )
        axes = dim_axes(mesh, s, leaf.dim(), where=where[i])
        try:
            check_layout(backend, mesh, axes)
        except ShardingError as e:
            raise type(e)(at(where[i], str(e))) from None
        plan.append(axes)
    out = []
    for i, (leaf, planned) in enumerate(zip(leaves, plan, strict=True)):
        try:
            out.append(leaf if planned is None else backend.step.annotate(leaf, mesh, planned))
        except ShardingError as e:  # e.g. a DTensor of another DeviceMesh
            raise type(e)(at(where[i], str(e))) from None
    return unflatten(treespec, out)


def maybe_shard(x: Any, /, spec: PartitionSpec | Sequence[Any] | None) -> Any:
    """Best-effort sharding hint: like ``with_sharding_constraint``, but never fails.

    A leaf the annotation cannot apply to is left as it is, and the reason is logged once at
    debug level (logger ``"torchshard"``): a spec longer than the leaf's rank, an axis not in
    the mesh, a leaf that is not a tensor of the mesh's backend, a sharding the backend cannot
    express (DTensor: a tuple of axes out of mesh order), or, on torch_xla, ``UNCONSTRAINED``
    entries mixed with constrained ones (its shardings cannot leave single dimensions to the
    compiler). On DTensor an ``UNCONSTRAINED`` dimension keeps the placements it has (the mesh
    axes that split it stay, unless the spec uses them for another dimension). A spec whose
    entries are all ``UNCONSTRAINED`` asks for nothing and returns the leaf unchanged; an empty
    spec ``P()`` replicates, as in ``with_sharding_constraint``.

    Args:
        x: a tensor or a tree of them.
        spec: one ``PartitionSpec`` or a plain sequence of entries (``None``, an axis name, a
            tuple of names, ``PartitionSpec.UNCONSTRAINED``), applied to every leaf.

    Returns:
        ``x`` itself when ``spec is None``, with no current mesh, or on a one-device mesh;
        otherwise a new tree.

    Raises:
        TypeError: (with or without a mesh) a ``spec`` that is not one spec: a dict or a
            sequence holding ``PartitionSpec``s (a tree of specs: use
            ``with_sharding_constraint``, which takes one), or malformed entries.

    Example (a hint for 3-D activations; a 2-D leaf it cannot apply to is left as it is):
        >>> from torchshard.testing import assert_sharded
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> with mesh:
        ...     h = torchshard.host_to_global_array(np.ones((8, 3, 4), np.float32))
        ...     w = torchshard.host_to_global_array(np.ones((8, 4), np.float32))
        ...     h2, w2 = torchshard.maybe_shard((h * 2, w), ("data", None, "model"))
        ...     assert_sharded(h2, torchshard.P("data", None, "model"))
        >>> w2 is w
        True
    """
    if spec is None:
        return x
    spec = _single_spec(spec)  # checked with or without a mesh: a wrong spec is a bug anywhere
    mesh = _active_mesh()
    if mesh is None:
        return x
    backend = lookup(mesh)
    leaves, treespec = flatten(x, name="x")
    out = []
    for leaf in leaves:
        out.append(_maybe_annotate(backend, mesh, spec, leaf))
    return unflatten(treespec, out)


def _single_spec(spec: Any) -> PartitionSpec:
    """``maybe_shard``'s one spec: a ``PartitionSpec``, an axis name, or a tuple/list of
    entries. Raises ``TypeError`` for anything else, in particular for what looks like a tree
    of specs (a dict, or a sequence holding specs), which ``as_partition_spec`` would otherwise
    read as entries (a dict's keys, a spec's axes)."""
    if isinstance(spec, (PartitionSpec, str)):
        return as_partition_spec(spec)
    fix = (
        "maybe_shard applies one spec to every leaf of x. For a spec per subtree, call "
        "maybe_shard on each subtree, or use with_sharding_constraint(x, spec_tree), which "
        "takes a tree prefix of x whose leaves are PartitionSpecs or None (and raises where a "
        "spec cannot apply)."
    )
    if isinstance(spec, (tuple, list)):
        inner = [i for i, e in enumerate(spec) if isinstance(e, PartitionSpec)]
        if inner:
            raise TypeError(
                f"spec: expected one PartitionSpec (or a sequence of its entries: None, an axis "
                f"name, a tuple of axis names), but got a {type(spec).__name__} whose entry "
                f"{inner[0]} is the PartitionSpec {spec[inner[0]]!r}, which looks like a tree of "
                f"specs. {fix}"
            )
        try:
            return as_partition_spec(spec)
        except (TypeError, ValueError) as e:
            raise type(e)(f"spec: {e}") from None
    raise TypeError(
        f"spec: expected one PartitionSpec (or a sequence of its entries), but got "
        f"{type(spec).__name__} {spec!r:.80}. {fix}"
    )


def _maybe_annotate(backend: Backend, mesh: Mesh, spec: PartitionSpec, leaf: Any) -> Any:
    if not backend.place.is_global(leaf):
        _debug_once(
            f"maybe_shard: left {_describe(leaf)} as it is: {spec!r} applies to tensors of the "
            f"{backend.name} backend."
        )
        return leaf
    keep = frozenset(i for i, e in enumerate(spec) if e is UNCONSTRAINED)
    if spec and len(keep) == len(spec):
        return leaf
    if keep and not backend.step.keeps_unconstrained_dims:
        _debug_once(
            f"maybe_shard: left a tensor of shape {tuple(leaf.shape)} as it is: {spec!r} mixes "
            f"UNCONSTRAINED with constrained dimensions, which the {backend.name} backend "
            "cannot express."
        )
        return leaf
    if keep:
        spec = PartitionSpec(*(None if i in keep else e for i, e in enumerate(spec)))
    try:
        axes = dim_axes(mesh, spec, leaf.dim())
        # Validation only raises, the same way on every process, before anything moves.
        check_layout(backend, mesh, axes)
        return backend.step.annotate(leaf, mesh, axes, keep=keep)
    except ShardingError as e:
        _debug_once(f"maybe_shard: left a tensor of shape {tuple(leaf.shape)} as it is: {e}")
        return leaf


def _describe(x: Any) -> str:
    device = getattr(x, "device", None)
    return f"{type(x).__name__}" + (f" on {device}" if device is not None else "")
