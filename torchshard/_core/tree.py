"""Pytree handling on optree, with JAX's semantics and precise error messages.

- ``None`` is an empty subtree of a data tree (it is passed through, never a leaf).
- dicts, lists, tuples, namedtuples and dataclasses are nodes and keep their types; plain
  dataclasses are registered (in torchshard's optree namespace) the first time they are seen.
- Spec trees are prefixes of data trees: a spec (or ``None``) at a node applies to every leaf
  under it. A spec tree that is not a prefix raises ``TreeStructureError`` naming the key path,
  and showing both trees.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import optree

from torchshard._core.errors import TreeStructureError

NAMESPACE = "torchshard"
_LEAF_TYPES: set[type] = set()
_REGISTERED: set[type] = set()
_REG_LOCK = threading.Lock()


def register_leaf_type(cls: type) -> type:
    """Marks a dataclass type as a leaf (never flattened), e.g. ``TensorSpec``."""
    _LEAF_TYPES.add(cls)
    return cls


_UNSET = object()


def _register_dataclass(cls: type) -> None:
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields if f.init)
    # Fields with init=False are children too (set after construction, e.g. in __post_init__
    # or by hand): the node is rebuilt with its init fields, then they are set on it
    # (object.__setattr__, so frozen dataclasses too). The ones set on this instance are part
    # of the node's metadata, so an unset one stays unset.
    late = tuple(f.name for f in fields if not f.init)

    def flatten(obj: Any) -> tuple[list[Any], Any, tuple[str, ...]]:
        children = [getattr(obj, n) for n in names]
        if not late:
            return children, names, names
        set_late = tuple(n for n in late if getattr(obj, n, _UNSET) is not _UNSET)
        children.extend(getattr(obj, n) for n in set_late)
        return children, (names, set_late), names + set_late

    def unflatten(meta: Any, children: Iterable[Any]) -> Any:  # meta: flatten's names
        if not late:
            return cls(**dict(zip(meta, children, strict=True)))
        init_names, set_late = meta
        values = list(children)
        obj = cls(**dict(zip(init_names, values[: len(init_names)], strict=True)))
        for n, v in zip(set_late, values[len(init_names) :], strict=True):
            object.__setattr__(obj, n, v)
        return obj

    optree.register_pytree_node(
        cls, flatten, unflatten, path_entry_type=optree.GetAttrEntry, namespace=NAMESPACE
    )


_PLAIN_LEAF_TYPES: set[type] = set()  # leaf types seen that are not dataclasses (cache)


def _is_node_dataclass(x: Any) -> bool:
    cls = type(x)
    if cls in _PLAIN_LEAF_TYPES:  # the hot path: tensors and arrays, seen before
        return False
    if not dataclasses.is_dataclass(cls):
        _PLAIN_LEAF_TYPES.add(cls)
        return False
    return cls not in _LEAF_TYPES and cls not in _REGISTERED


def _optree_flatten(
    tree: Any, is_leaf: Callable[[Any], bool] | None, name: str
) -> tuple[list[Any], optree.PyTreeSpec]:
    try:
        return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=False, namespace=NAMESPACE)
    except RecursionError:
        raise _too_deep(tree, is_leaf, name) from None


def _too_deep(tree: Any, is_leaf: Callable[[Any], bool] | None, name: str) -> TreeStructureError:
    """Why optree could not flatten ``tree``: a container that contains itself, or nesting
    deeper than optree's limit (found without recursion, on the error path only)."""
    limit = optree.MAX_RECURSION_DEPTH
    # Depth-first, one level at a time: (node, its path's entries, its ancestors' ids -> depth).
    stack: list[tuple[Any, tuple[Any, ...], dict[int, int]]] = [(tree, (), {})]
    while stack:
        node, where, ancestors = stack.pop()
        if node is None or (is_leaf is not None and is_leaf(node)):
            continue
        if id(node) in ancestors:
            return TreeStructureError(
                f"{name} contains itself: {_code(name, where)} is "
                f"{_code(name, where[: ancestors[id(node)]])} (a cycle), and a tree must be "
                "acyclic. Pass a tree without the back reference."
            )
        if len(where) >= limit:
            shown = _code(name, where[:3]) + "..." if len(where) > 3 else _code(name, where)
            return TreeStructureError(
                f"{name} is nested more than {limit} levels deep (at {shown}, {len(where)} "
                f"levels), deeper than optree flattens ({limit} levels). Flatten the "
                "structure (e.g. a list or a dict of leaves) before passing it."
            )
        try:
            level = optree.tree_flatten_one_level(node, none_is_leaf=False, namespace=NAMESPACE)
        except ValueError:  # a leaf
            continue
        inside = {**ancestors, id(node): len(where)}
        for child, entry in zip(level.children, level.entries, strict=True):
            stack.append((child, (*where, entry), inside))
    return TreeStructureError(  # pragma: no cover - optree's limit reached another way
        f"{name} could not be flattened: optree reached its recursion limit ({limit})."
    )


def _code(name: str, where: tuple[Any, ...]) -> str:
    return name + "".join(f"[{e!r}]" for e in where)


def _flatten_raw(
    tree: Any, is_leaf: Callable[[Any], bool] | None, name: str = "tree"
) -> tuple[Any, ...]:
    while True:
        leaves, treespec = _optree_flatten(tree, is_leaf, name)
        # Register the dataclasses found as leaves, except those ``is_leaf`` keeps as leaves
        # (e.g. a dataclass used as a spec in a spec tree), then flatten again.
        new = {
            type(x) for x in leaves if _is_node_dataclass(x) and (is_leaf is None or not is_leaf(x))
        }
        if not new:
            return leaves, treespec
        with _REG_LOCK:
            for cls in new - _REGISTERED:
                _register_dataclass(cls)
                _REGISTERED.add(cls)


# Flat dicts of arrays seen before, by their keys in insertion order: their treespec and the keys
# in optree's leaf order. Flattening one again is a dict lookup and a list, not an optree call:
# a training loop's batch is such a dict, and ``host_to_global_array`` flattens it on every step
# (docs/design.md, "Engine"). Only values of the array types below take this path: they are
# leaves under any registry (a type seen as a leaf once need not be one: ``is_leaf`` may have
# said so, e.g. of ``None``).
_FLAT_DICTS: dict[tuple[Any, ...], tuple[optree.PyTreeSpec, tuple[Any, ...]]] = {}
_FLAT_DICTS_BOUND = 256
_ARRAY_TYPES: set[type] = {np.ndarray}


def register_array_type(cls: type) -> None:
    """Lets flat dicts of ``cls`` values (exact type) flatten from their keys; ``cls`` must be
    an array type, never a tree node (``torchshard._place.host_data`` registers
    ``torch.Tensor``)."""
    _ARRAY_TYPES.add(cls)


def flatten(
    tree: Any, *, is_leaf: Callable[[Any], bool] | None = None, name: str = "tree"
) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treespec)`` (``None`` is an empty subtree; dataclasses are nodes).

    ``name`` is the tree's name in the error for a tree that contains itself or is nested
    deeper than optree flattens (``TreeStructureError``)."""
    flat_dict = is_leaf is None and type(tree) is dict
    if flat_dict:
        known = _FLAT_DICTS.get(tuple(tree))
        if known is not None:
            treespec, order = known
            # Only exact-str keys are recorded, and keys that compare equal are not the same
            # key (True == 1, 2.0 == 2, np.str_("a") == "a"): a hit needs exact-str keys.
            for k in tree:
                if type(k) is not str:
                    break
            else:
                leaves = [tree[k] for k in order]
                arrays = _ARRAY_TYPES
                for x in leaves:  # every value an array: the structure recorded for these keys
                    if type(x) not in arrays:
                        break
                else:
                    return leaves, treespec
    leaves, treespec = _optree_flatten(tree, is_leaf, name)
    plain = _PLAIN_LEAF_TYPES
    for x in leaves:  # every leaf of a type seen before that is no dataclass
        if type(x) not in plain:
            # registers new dataclasses and flattens again
            return _flatten_raw(tree, is_leaf, name)
    if (
        flat_dict
        and treespec.num_leaves == len(tree)
        and treespec.num_nodes == len(tree) + 1
        and all(type(k) is str for k in tree)
    ):
        if len(_FLAT_DICTS) >= _FLAT_DICTS_BOUND:
            _FLAT_DICTS.clear()
        _FLAT_DICTS[tuple(tree)] = (treespec, tuple(treespec.entries()))
    return leaves, treespec


def paths(
    treespec: optree.PyTreeSpec, name: str, parts: tuple[str, ...] | None = None
) -> list[str]:
    """Each leaf's path as code, e.g. ``host_arrays['x'][0]`` (computed on demand: it is only
    needed for error messages). ``parts``: the tree is a tuple whose element ``i`` is named
    ``parts[i]`` (``("batch", "mask")``: ``batch['x']``, not ``name[0]['x']``)."""
    if parts is None:
        return [a.codify(name) for a in treespec.accessors()]
    return [a[1:].codify(parts[a[0].entry]) for a in treespec.accessors()]


class LazyPaths:
    """``paths(treespec, name, parts)``, computed the first time an entry is read; ``at(i)``
    is entry ``i`` unread (a ``LeafPath``), for a check that names it only when it fails."""

    __slots__ = ("_name", "_parts", "_paths", "_treespec")

    def __init__(
        self, treespec: optree.PyTreeSpec, name: str, parts: tuple[str, ...] | None = None
    ) -> None:
        self._treespec = treespec
        self._name = name
        self._parts = parts
        self._paths: list[str] | None = None

    def __getitem__(self, i: int) -> str:
        if self._paths is None:
            self._paths = paths(self._treespec, self._name, self._parts)
        return self._paths[i]

    def at(self, i: int) -> LeafPath:
        """Leaf ``i``'s path, computed when an error message formats it."""
        return LeafPath(self, i)


class LeafPath:
    """One leaf's path of a ``LazyPaths``, computed when formatted (``str``, an f-string,
    ``errors.at``): a check takes it where it would take the path, and only its error reads it
    (paths are for errors: a large tree's cost, ~1 us per leaf, on every call otherwise)."""

    __slots__ = ("_i", "_paths")

    def __init__(self, paths: LazyPaths, i: int) -> None:
        self._paths = paths
        self._i = i

    def __str__(self) -> str:
        return self._paths[self._i]

    def __repr__(self) -> str:
        return repr(str(self))


Where = str | LeafPath  # a leaf's path, or one computed when an error formats it


def unflatten(treespec: optree.PyTreeSpec, leaves: list[Any]) -> Any:
    """The tree of ``treespec`` with ``leaves``."""
    return optree.tree_unflatten(treespec, leaves)


def structure(tree: Any) -> optree.PyTreeSpec:
    """The treespec of ``tree`` (``None`` an empty subtree)."""
    return _flatten_raw(tree, None)[1]


class _NoneSpec:
    """Stands in for ``None`` in a spec tree, where ``None`` is a leaf ("no spec")."""

    def __repr__(self) -> str:
        return "None"


_NONE = _NoneSpec()


def broadcast_prefix(
    prefix_tree: Any,
    full_tree: Any,
    *,
    is_prefix_leaf: Callable[[Any], bool],
    prefix_name: str,
    full_name: str,
) -> list[Any]:
    """For each leaf of ``full_tree`` (in ``flatten`` order), the leaf of ``prefix_tree`` that
    covers it.

    ``None`` in ``prefix_tree`` is a leaf that covers its whole subtree and comes back as
    ``None``. ``is_prefix_leaf`` applies to ``prefix_tree`` only: ``full_tree`` keeps its own
    structure (its dataclasses stay nodes even when the prefix's leaves are dataclasses).
    Raises ``TreeStructureError`` when ``prefix_tree`` is not a prefix of ``full_tree``.
    """
    leaf_test = lambda x: x is _NONE or is_prefix_leaf(x)  # noqa: E731
    prefix = _none_to_proxy(prefix_tree, is_prefix_leaf)
    prefix_leaves, prefix_spec = _flatten_raw(prefix, leaf_test, prefix_name)
    # registers the full tree's dataclasses before matching against them
    full_spec = flatten(full_tree, name=full_name)[1]
    try:
        prefix_spec.flatten_up_to(full_tree)  # checks the structure, matching dicts by key
    except ValueError:
        raise _prefix_error(prefix, full_tree, leaf_test, prefix_name, full_name) from None
    # Matched by key path, not by position: dict flavours order their keys differently (a
    # dict sorts them, an OrderedDict or a defaultdict keeps insertion order; optree's own
    # flatten_up_to and broadcast_prefix return the prefix's order), so the i-th subtree of
    # the prefix need not hold the full tree's i-th leaves.
    prefix_paths = prefix_spec.paths()
    full_paths = full_spec.paths()
    values = [None if leaf is _NONE else leaf for leaf in prefix_leaves]
    if prefix_paths == full_paths:  # the prefix is the full structure, in the same order
        return values
    by_path = dict(zip(prefix_paths, values, strict=True))
    out: list[Any] = []
    for path in full_paths:
        for k in range(len(path) + 1):
            head = path[:k]
            if head in by_path:
                out.append(by_path[head])
                break
        else:  # pragma: no cover - flatten_up_to checked that the prefix covers every leaf
            raise _prefix_error(prefix, full_tree, leaf_test, prefix_name, full_name)
    return out


def _none_to_proxy(tree: Any, is_leaf: Callable[[Any], bool]) -> Any:
    if tree is None:
        return _NONE
    flatten(tree, is_leaf=is_leaf)  # registers the dataclass nodes of the prefix first
    return optree.tree_map(
        lambda x: _NONE if x is None else x,
        tree,
        is_leaf=lambda x: x is None or is_leaf(x),
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def _prefix_error(
    prefix: Any,
    full: Any,
    leaf_test: Callable[[Any], bool],
    prefix_name: str,
    full_name: str,
) -> TreeStructureError:
    found = _first_difference(prefix, full, leaf_test, prefix_name, full_name, "")
    if found is not None:
        return TreeStructureError(found)
    errors = optree.prefix_errors(
        prefix, full, is_leaf=leaf_test, none_is_leaf=False, namespace=NAMESPACE
    )
    detail = errors[0](prefix_name) if errors else "structures differ"
    prefix_spec = optree.tree_structure(
        prefix, is_leaf=leaf_test, none_is_leaf=False, namespace=NAMESPACE
    )
    return TreeStructureError(
        f"{prefix_name} must be a tree prefix of {full_name}, but it is not.\n{detail}\n"
        f"{prefix_name} tree: {prefix_spec}\n{full_name} tree: {structure(full)}"
    )


def _first_difference(
    prefix: Any,
    full: Any,
    leaf_test: Callable[[Any], bool],
    prefix_name: str,
    full_name: str,
    path: str,
) -> str | None:
    """The first place where ``prefix`` is not a prefix of ``full``, said in one sentence with
    the fix (dicts: the keys one has and the other lacks; lists and tuples: the lengths), or
    ``None`` where the difference is of another kind (then the trees are printed)."""
    if leaf_test(prefix):
        return None
    where = f"{prefix_name}{path}" if path else prefix_name
    if isinstance(prefix, dict) and isinstance(full, dict):
        extra = [k for k in prefix if k not in full]
        missing = [k for k in full if k not in prefix]
        if extra or missing:
            parts = []
            if extra:
                parts.append(f"has {_keys(extra)} that {full_name}{path} lacks")
            if missing:
                parts.append(f"lacks {_keys(missing)}")
            hint = ""
            if extra and missing:
                import difflib

                close = difflib.get_close_matches(str(extra[0]), [str(k) for k in missing], n=1)
                if close:
                    hint = f" (did you mean {close[0]!r} for {extra[0]!r}?)"
            return (
                f"{where} must be a tree prefix of {full_name}{path}, but it {' and '.join(parts)}"
                f"{hint}. A dict of specs names exactly the keys of the data "
                f"({full_name}{path} has {_keys(list(full))}); to give a whole dict one spec, "
                "pass that spec instead of the dict."
            )
        for k in prefix:
            sub = _first_difference(
                prefix[k], full[k], leaf_test, prefix_name, full_name, f"{path}[{k!r}]"
            )
            if sub is not None:
                return sub
        return None
    plain = (list, tuple)
    if (
        isinstance(prefix, plain)
        and isinstance(full, plain)
        and not optree.is_namedtuple(prefix)
        and not optree.is_namedtuple(full)
    ):
        if type(prefix) is not type(full) or len(prefix) != len(full):
            return (
                f"{where} must be a tree prefix of {full_name}{path}, but it is a "
                f"{type(prefix).__name__} of {len(prefix)} where {full_name}{path} is a "
                f"{type(full).__name__} of {len(full)}; give one spec per element, in a "
                f"{type(full).__name__}, or one spec for the whole {type(full).__name__}."
            )
        for i, (a, b) in enumerate(zip(prefix, full, strict=True)):
            sub = _first_difference(a, b, leaf_test, prefix_name, full_name, f"{path}[{i}]")
            if sub is not None:
                return sub
        return None
    if isinstance(prefix, dict) != isinstance(full, dict):
        return (
            f"{where} must be a tree prefix of {full_name}{path}, but it is a "
            f"{type(prefix).__name__} where {full_name}{path} is a {type(full).__name__}; give "
            f"the specs in a {type(full).__name__} of the same structure, or one spec for the "
            "whole subtree."
        )
    return None


def _keys(keys: list[Any]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8])
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    return f"key{'s' if len(keys) != 1 else ''} {shown}{more}"
