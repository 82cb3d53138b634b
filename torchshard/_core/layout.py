"""``describe_layout``: which host and which device own which block of a global array.

Pure maths from the mesh's index maps (``sharding.device_ranges``, numpy) and a device -> host
map (the runtime topology, or ``num_hosts`` contiguous, equal groups of device ids as
``virtual_hosts`` splits them), for planning a pod layout without a pod. A ``ShardingLayout``
holds its blocks as arrays (one row per device) and makes its ``LayoutBlock`` objects only when
they are read, so a pod's layout costs numpy work, not an object per device; its text is
``torchshard._core.layout_text``'s. ``torchshard._visualize.layout_of_tensor`` builds the same
object from the blocks the runtime reports for a placed tensor, and draws it with ``rich`` or
into a PNG (matplotlib); the PNG drawer reaches ``ShardingLayout.save_png`` through a slot
(``install_png_drawer``) that ``torchshard._visualize`` fills when imported, so this module
imports no drawing library.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from torchshard._core import checks
from torchshard._core.layout_text import MAX_LINES, host_table, render_plain
from torchshard._core.mesh import Mesh, topology_of
from torchshard._core.sharding import (
    NamedSharding,
    check_device_process,
    device_ranges,
    dim_axes,
)
from torchshard._core.spec import PartitionSpec, as_partition_spec

Ranges = tuple[tuple[int, int], ...]
Span = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class LayoutBlock:
    """One device's block: its id, its host, and its global ``[start, stop)`` per dimension."""

    device: int
    host: int
    ranges: Ranges

    @property
    def index(self) -> tuple[slice, ...]:
        """The block as slices of the global array."""
        return tuple(slice(a, b) for a, b in self.ranges)


class LayoutArrays(NamedTuple):
    """A layout's blocks as arrays, one row per device, ascending ids: ``ids``, ``hosts``
    (``[devices]``), ``starts`` and ``stops`` (``[devices, dims]``: the global ``[start,
    stop)`` of each dimension)."""

    ids: np.ndarray
    hosts: np.ndarray
    starts: np.ndarray
    stops: np.ndarray

    @classmethod
    def of_blocks(cls, blocks: Sequence[LayoutBlock], ndim: int) -> LayoutArrays:
        """The arrays of ``blocks`` (sorted by device id)."""
        blocks = sorted(blocks, key=lambda b: b.device)
        ranges = np.zeros((len(blocks), ndim, 2), dtype=np.int64)
        if ndim and blocks:
            ranges[:] = [b.ranges for b in blocks]
        return cls(
            np.asarray([b.device for b in blocks], dtype=np.int64),
            np.asarray([b.host for b in blocks], dtype=np.int64),
            ranges[:, :, 0],
            ranges[:, :, 1],
        )


class ShardingLayout:
    """Who owns which block of a global array: one ``LayoutBlock`` per device, ascending ids.

    ``str(layout)`` is a plain-text grid (1-D and 2-D arrays) or table (other ranks), with a
    line per host; a large layout's text is a summary of runs of blocks and hosts, whose length
    follows the layout's regularity, not its devices (``layout.to_text(full=True)``: every
    block and host). ``torchshard.visualize_sharding(layout)`` prints it (with ``rich`` when
    installed) and ``layout.save_png(path)`` draws it with matplotlib. Immutable; equal when
    every field is.

    Attributes:
        global_shape: the shape of the global array.
        blocks: every (known) device's block; a tensor read on one host of many lists only that
            host's devices.
        num_hosts: the number of hosts of the device -> host map.
        mesh: the mesh, when known.
        spec: the partition spec, when the layout was described from one.
    """

    def __init__(
        self,
        global_shape: tuple[int, ...],
        blocks: Sequence[LayoutBlock],
        num_hosts: int,
        mesh: Mesh | None = None,
        spec: PartitionSpec | None = None,
    ) -> None:
        self._global_shape = tuple(global_shape)
        self._blocks: tuple[LayoutBlock, ...] | None = tuple(blocks)
        self._arrays: LayoutArrays | None = None
        self._num_hosts = num_hosts
        self._mesh = mesh
        self._spec = spec

    @classmethod
    def of_arrays(
        cls,
        global_shape: tuple[int, ...],
        arrays: LayoutArrays,
        num_hosts: int,
        mesh: Mesh | None = None,
        spec: PartitionSpec | None = None,
    ) -> ShardingLayout:
        """The layout of ``arrays`` (ascending ids); its ``blocks`` are made when read."""
        layout = cls(global_shape, (), num_hosts, mesh, spec)
        layout._blocks = None
        layout._arrays = arrays
        return layout

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The shape of the global array."""
        return self._global_shape

    @property
    def num_hosts(self) -> int:
        """The number of hosts of the device -> host map."""
        return self._num_hosts

    @property
    def mesh(self) -> Mesh | None:
        """The mesh, when known."""
        return self._mesh

    @property
    def spec(self) -> PartitionSpec | None:
        """The partition spec, when the layout was described from one."""
        return self._spec

    @property
    def arrays(self) -> LayoutArrays:
        """The blocks as arrays (``LayoutArrays``), one row per device, ascending ids."""
        if self._arrays is None:
            assert self._blocks is not None
            self._arrays = LayoutArrays.of_blocks(self._blocks, len(self._global_shape))
        return self._arrays

    @property
    def blocks(self) -> tuple[LayoutBlock, ...]:
        """Every (known) device's block, ascending ids (made on first read from the arrays)."""
        if self._blocks is None:
            ids, hosts, starts, stops = self.arrays
            spans = []  # per dim, each device's (start, stop): one tuple per distinct span
            for i in range(len(self._global_shape)):
                known: dict[Span, Span] = {}
                pairs = zip(starts[:, i].tolist(), stops[:, i].tolist(), strict=True)
                spans.append([known.setdefault(p, p) for p in pairs])
            devices = ids.tolist()
            ranges = list(zip(*spans, strict=True)) if spans else [()] * len(devices)
            self._blocks = tuple(map(LayoutBlock, devices, hosts.tolist(), ranges))
        return self._blocks

    def _key(self) -> tuple[Any, ...]:
        return (self._global_shape, self._num_hosts, self._mesh, self._spec)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingLayout):
            return NotImplemented
        if self._key() != other._key():
            return False
        if self._blocks is not None and other._blocks is not None:
            return self._blocks == other._blocks
        return all(np.array_equal(a, b) for a, b in zip(self.arrays, other.arrays, strict=True))

    def __hash__(self) -> int:
        return hash((*self._key(), len(self.arrays.ids)))

    def __repr__(self) -> str:
        return (
            f"ShardingLayout(global_shape={self._global_shape!r}, blocks={self.blocks!r}, "
            f"num_hosts={self._num_hosts!r}, mesh={self._mesh!r}, spec={self._spec!r})"
        )

    def devices_indices_map(self) -> dict[int, tuple[slice, ...]]:
        """``{device id: slices}``, as ``NamedSharding.devices_indices_map``."""
        return {b.device: b.index for b in self.blocks}

    def host_of(self, device: int) -> int:
        """The host that owns ``device``."""
        ids = self.arrays.ids
        n = int(np.searchsorted(ids, device)) if ids.size else 0
        if n < ids.size and ids[n] == device:
            return int(self.arrays.hosts[n])
        raise KeyError(f"device {device} is not in this layout (devices {self.devices}).")

    @property
    def devices(self) -> tuple[int, ...]:
        """The device ids of the layout, ascending."""
        return tuple(self.arrays.ids.tolist())

    @functools.cached_property
    def distinct_blocks(self) -> dict[Ranges, tuple[LayoutBlock, ...]]:
        """Each distinct block (sorted by position) and the devices holding it (replicas)."""
        out: dict[Ranges, list[LayoutBlock]] = {}
        for b in self.blocks:
            out.setdefault(b.ranges, []).append(b)
        return {r: tuple(out[r]) for r in sorted(out)}

    def host_blocks(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per host: its devices and the shape of its local block (the distinct slices of its
        devices, concatenated per dimension, as ``NamedSharding.process_local_shape``)."""
        table = host_table(self.arrays)
        ids, bounds = table.ids.tolist(), table.bounds.tolist()
        return {
            h: (tuple(ids[bounds[k] : bounds[k + 1]]), tuple(s))
            for k, (h, s) in enumerate(
                zip(table.hosts.tolist(), table.shapes.tolist(), strict=True)
            )
        }

    def title(self) -> str:
        """One line: spec, mesh, global shape, hosts (a large mesh's device order abridged)."""
        mesh = mesh_text(self.mesh) if self.mesh is not None else ""
        what = (
            f"{self.spec!r} on {mesh}"
            if self.spec is not None
            else (f"tensor on {mesh}" if self.mesh is not None else "tensor")
        )
        hosts = f"{self.num_hosts} host" + ("s" if self.num_hosts != 1 else "")
        return f"{what}: global shape {self.global_shape}, {hosts}"

    def to_text(self, *, full: bool = False) -> str:
        """The plain-text grid or table (no colours); a large layout's runs, or with ``full``
        every block and host (``layout_text.MAX_LINES``)."""
        return render_plain(self, full=full)

    def __str__(self) -> str:
        return self.to_text()

    def save_png(self, path: str, *, dpi: int = 120) -> None:
        """Draws the layout into a PNG file (needs matplotlib: the extra ``plot``).

        Blocks are drawn to scale in array coordinates (dim 0 down, dim 1 across), coloured
        by host and labelled with their devices; ranks other than 1 and 2 become a table.
        """
        draw = _DRAWERS.png
        if draw is None:
            raise RuntimeError(
                "ShardingLayout.save_png: no PNG drawer is installed; import torchshard (its "
                "torchshard._visualize module installs the matplotlib drawer)."
            )
        draw(self, path, dpi)


def mesh_text(mesh: Mesh) -> str:
    """``repr(mesh)``, with the device ids of a mesh of more than ``MAX_LINES`` devices in
    another order than ``0..n-1`` abridged to their first and last few."""
    flat = mesh.devices.reshape(-1)
    if flat.size <= MAX_LINES or np.array_equal(flat, np.arange(flat.size)):
        return repr(mesh)
    shape = ", ".join(f"{k!r}: {v}" for k, v in mesh.shape.items())
    head = ", ".join(str(d) for d in flat[:8].tolist())
    tail = ", ".join(str(d) for d in flat[-2:].tolist())
    return f"Mesh({{{shape}}}, devices=[{head}, ..., {tail}] ({flat.size:,} ids))"


class _Drawers:
    """The slot of the PNG drawer (``torchshard._visualize`` fills it when imported)."""

    def __init__(self) -> None:
        self.png: Callable[[ShardingLayout, str, int], None] | None = None


_DRAWERS = _Drawers()


def install_png_drawer(draw: Callable[[ShardingLayout, str, int], None]) -> None:
    """Installs the function behind ``ShardingLayout.save_png(path, dpi=...)``."""
    _DRAWERS.png = draw


def describe_layout(
    mesh: Mesh,
    spec: PartitionSpec | Sequence[Any] | str | None,
    global_shape: Sequence[int],
    *,
    num_hosts: int | None = None,
) -> ShardingLayout:
    """Which host and which device own which block of a ``global_shape`` array under ``spec``.

    Pure index maths (no transfer, no runtime unless ``num_hosts`` is None): the blocks are
    ``NamedSharding(mesh, spec).devices_indices_map(global_shape)``; uneven splits are
    described as torch_xla places them (the last blocks short or empty).

    Args:
        mesh: the mesh (its device ids must be ``0..size-1``).
        spec: the partition spec (``None``: replicated).
        global_shape: the global array's shape.
        num_hosts: ``None`` takes the device -> host map from the runtime topology (emulated
            inside ``virtual_hosts``); ``n`` splits the device ids into ``n`` equal,
            contiguous groups, as ``virtual_hosts(n)`` and TPU pods do.

    Returns:
        A ``ShardingLayout``; ``print(layout)`` shows the grid.

    Example (rows: dim 0; replicated over ``model``, so device pairs share a block):
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> layout = torchshard.describe_layout(mesh, torchshard.P("data"), (16, 8), num_hosts=2)
        >>> layout.blocks[2]
        LayoutBlock(device=2, host=0, ranges=((4, 8), (0, 8)))
        >>> print(layout)
        P('data',) on Mesh({'data': 4, 'model': 2}): global shape (16, 8), 2 hosts
        <BLANKLINE>
                    0:8
              +-------------+
          0:4 | devices 0,1 |
              | host 0      |
              +-------------+
          4:8 | devices 2,3 |
              | host 0      |
              +-------------+
         8:12 | devices 4,5 |
              | host 1      |
              +-------------+
        12:16 | devices 6,7 |
              | host 1      |
              +-------------+
        <BLANKLINE>
        host 0: devices 0-3, local block shape (8, 8)
        host 1: devices 4-7, local block shape (8, 8)
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"describe_layout: mesh must be a torchshard.Mesh, but got {mesh!r}.")
    spec = as_partition_spec(() if spec is None else spec)
    shape = checks.shape(global_shape, "describe_layout: global_shape")
    if num_hosts is None:
        topo = topology_of(mesh)
        owners, count = topo.device_process, topo.process_count
    else:
        owners = checks.contiguous_hosts(mesh.size, num_hosts)
        count = owners[-1] + 1  # hosts 0..num_hosts-1
    check_device_process(mesh, owners)
    NamedSharding(mesh, spec)  # checks the spec's axes (then its length, below)
    # The blocks as arrays (``device_ranges``): no object per device until ``blocks`` is read
    ids, starts, stops = device_ranges(mesh, dim_axes(mesh, spec, len(shape)), shape)
    hosts = np.fromiter(owners, dtype=np.int64, count=len(owners))[ids]
    return ShardingLayout.of_arrays(
        shape, LayoutArrays(ids, hosts, starts, stops), count, mesh, spec
    )
