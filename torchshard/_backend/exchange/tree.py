"""The shape of the exchange tree: who is whose parent.

Two levels, as the network is: the processes of one host (``local_size`` consecutive ranks,
as torchrun numbers them: ``LOCAL_WORLD_SIZE``) hang off the host's first rank, its *leader*,
over loopback; the leaders form a ``fanout``-ary tree in rank order (host ``h``'s parent is host
``(h - 1) // fanout``), rooted at rank 0. Every rank has the lowest rank of its subtree, so
merging a node's value before its children's, children in rank order, keeps the values in rank
order at the root. Pure arithmetic: nothing here talks to anyone.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Rank ``rank``'s place in the tree of ``world`` processes (hosts of ``local_size``
    consecutive ranks, leaders in a ``fanout``-ary tree)."""

    rank: int
    world: int
    fanout: int = 8
    local_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"TreeShape: rank {self.rank} is not in range({self.world}).")
        if self.fanout < 2:
            raise ValueError(f"TreeShape: fanout must be >= 2, but got {self.fanout}.")
        if self.local_size < 1 or self.world % self.local_size:
            raise ValueError(
                f"TreeShape: local_size must divide world ({self.world}), but got "
                f"{self.local_size}."
            )

    @property
    def host(self) -> int:
        return self.rank // self.local_size

    @property
    def hosts(self) -> int:
        return self.world // self.local_size

    def leader(self, host: int) -> int:
        return host * self.local_size

    @property
    def parent(self) -> int | None:
        """The rank this one reports to (``None`` at the root, rank 0)."""
        return parent_of(self.rank, self.fanout, self.local_size)

    @property
    def children(self) -> tuple[int, ...]:
        """The ranks that report to this one, in rank order: the host's other processes (a
        leader's), then the leaders of the child hosts."""
        return children_of(self.rank, self.world, self.fanout, self.local_size)

    def subtree_size(self, rank: int | None = None) -> int:
        """How many processes report through ``rank`` (default this one), itself included."""
        r = self.rank if rank is None else rank
        kids = children_of(r, self.world, self.fanout, self.local_size)
        return 1 + sum(self.subtree_size(c) for c in kids)

    @property
    def depth(self) -> int:
        """Links from the deepest rank to the root: the hops of one way up."""
        return depth(self.world, self.fanout, self.local_size)


def parent_of(rank: int, fanout: int, local_size: int) -> int | None:
    host, local = divmod(rank, local_size)
    if local:
        return host * local_size
    if host == 0:
        return None
    return ((host - 1) // fanout) * local_size


def children_of(rank: int, world: int, fanout: int, local_size: int) -> tuple[int, ...]:
    host, local = divmod(rank, local_size)
    if local:
        return ()
    hosts = world // local_size
    local_kids = range(rank + 1, rank + local_size)
    host_kids = range(host * fanout + 1, min(host * fanout + fanout, hosts - 1) + 1)
    return (*local_kids, *(h * local_size for h in host_kids))


def depth(world: int, fanout: int, local_size: int = 1) -> int:
    """Links from the deepest rank of ``world`` to the root."""
    hosts = world // local_size
    levels, reach, width = 0, 1, 1
    while reach < hosts:
        width *= fanout
        reach += width
        levels += 1
    return levels + (1 if local_size > 1 else 0)
