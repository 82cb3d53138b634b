"""The call: the host trees of one call, flattened (``HostCall``, made by ``read``), and the
plan that validation makes of it (``CallPlan``).

``read(trees, topology, partition, per_host=...)`` takes one tree per host this process
supplies (``topology.data_hosts``: its own; every host under ``virtual_hosts``). Paths are
named after the argument (``host_arrays[...]``, or ``per_host_arrays[h][...]`` for a list of
per-host trees; a caller names its own: the loader's ``batch[...]``) and computed only for
errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torchshard._core.agreement import describe
from torchshard._core.errors import ShardingError, at
from torchshard._core.topology import Topology
from torchshard._core.tree import LazyPaths, flatten

if TYPE_CHECKING:
    import optree
    import torch

    from torchshard._core.blocks import HostPlan, SharedBlock
    from torchshard._core.spec import PartitionSpec


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
        "argname",
        "global_shape",
        "leaves",
        "partition",
        "parts",
        "per_host",
        "tensors",
        "trees",
        "treespecs",
    )

    def __init__(
        self,
        trees: Sequence[Any],
        partition: Any,
        per_host: bool,
        global_shape: Any = None,
        *,
        name: str | None = None,
        parts: tuple[str, ...] | None = None,
    ) -> None:
        self.partition = partition
        self.per_host = per_host
        self.global_shape = global_shape  # None: inferred; else a shape, or a prefix tree
        self.argname = name or ("per_host_arrays" if per_host else "host_arrays")
        """The argument the trees were passed as (errors name it)."""
        self.parts = parts
        """Each tree is a tuple of parts named so (the loader's ``("batch", "mask")``)."""
        self.trees = trees
        if len(trees) == 1:  # the common case, without the generic bookkeeping
            leaves, treespec = flatten(
                trees[0], name=f"{self.argname}[0]" if per_host else self.argname
            )
            self.leaves = [leaves]
            self.treespecs: tuple[optree.PyTreeSpec, ...] = (treespec,)
        else:
            flat = [flatten(t, name=self._root(h)) for h, t in enumerate(trees)]
            self.leaves = [f[0] for f in flat]
            self.treespecs = tuple(f[1] for f in flat)
        self._paths: list[LazyPaths] | None = None
        self.tensors: list[list[torch.Tensor]] | None = None

    def _root(self, h: int) -> str:
        return f"{self.argname}[{h}]" if self.per_host else self.argname

    @property
    def paths(self) -> list[LazyPaths]:
        """Per host, its leaves' paths as code (``host_arrays['x']``,
        ``per_host_arrays[1]['x']``; with ``parts``, ``batch['x']``, ``host_batches[1]['x']``)."""
        if self._paths is None:
            self._paths = []
            for h, spec in enumerate(self.treespecs):
                parts = self.parts
                if parts is not None and self.per_host:
                    parts = tuple(f"{p}[{h}]" for p in parts)
                self._paths.append(LazyPaths(spec, self._root(h), parts))
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
    name: str | None = None,
    parts: tuple[str, ...] | None = None,
) -> HostCall:
    """The call of ``trees``: one per host in ``topology.data_hosts``, in that order.

    ``per_host``: the trees were given as a list of per-host trees (``per_host_arrays``), not as
    this host's one tree (``host_arrays``); it names the paths of errors. ``global_shape``: see
    ``host_to_global_array``. ``name``: the argument the paths of errors start with (default
    ``per_host_arrays`` or ``host_arrays``); ``parts``: each tree is a tuple of parts named so.
    """
    count = len(topology.data_hosts)
    if len(trees) != count:
        name = name or ("per_host_arrays" if per_host else "host_arrays")
        raise ShardingError(
            at(name, f"expected one tree per host, {count} in all, but got {len(trees)}.")
        )
    return HostCall(trees, partition, per_host, global_shape, name=name, parts=parts)


class CallPlan:
    """A call's plans: per leaf its ``HostPlan`` (``None``: the leaf is already global and is
    placed as it is), which tree each host's is, and the blocks hosts share.

    Planning fills every field but ``bound``; placing binds a cached plan to its backend at its
    first reuse and keeps the result in ``bound`` (``place.bind``), so later calls skip it.
    """

    __slots__ = ("bound", "plans", "shared", "slot")

    def __init__(
        self,
        plans: list[HostPlan | None],
        slot: dict[int, int],
        shared: tuple[tuple[int, PartitionSpec, tuple[SharedBlock, ...]], ...] = (),
    ) -> None:
        self.plans = plans
        self.slot = slot  # host -> index of its tree in the call
        self.shared = shared
        """With several hosts' trees: ``(leaf, spec, blocks)`` for each leaf some of whose
        blocks more than one host supplies; placing compares those hosts' values first."""
        self.bound: Any = None  # placement's binding (``place.Bound``), once bound
