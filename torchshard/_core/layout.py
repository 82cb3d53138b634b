"""``describe_layout``: which host and which device own which block of a global array, and
the plain-text picture of it.

Pure maths from ``NamedSharding.devices_indices_map`` and a device -> host map (the runtime
topology, or ``num_hosts`` contiguous, equal groups of device ids as ``virtual_hosts`` splits
them), for planning a pod layout without a pod. ``torchshard._visualize.layout_of_tensor``
builds the same object from the blocks the runtime reports for a placed tensor, and draws it
with ``rich`` or into a PNG (matplotlib); the PNG drawer reaches ``ShardingLayout.save_png``
through a slot (``install_png_drawer``) that ``torchshard._visualize`` fills when imported, so
this module imports no drawing library.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from torchshard._core import checks
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
MAX_GRID_ROWS = 64
MAX_GRID_COLS = 8


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


@dataclasses.dataclass(frozen=True)
class ShardingLayout:
    """Who owns which block of a global array: one ``LayoutBlock`` per device, ascending ids.

    ``str(layout)`` is a plain-text grid (1-D and 2-D arrays) or table (other ranks);
    ``torchshard.visualize_sharding(layout)`` prints it (with ``rich`` when installed) and
    ``layout.save_png(path)`` draws it with matplotlib.

    Attributes:
        global_shape: the shape of the global array.
        blocks: every (known) device's block; a tensor read on one host of many lists only that
            host's devices.
        num_hosts: the number of hosts of the device -> host map.
        mesh: the mesh, when known.
        spec: the partition spec, when the layout was described from one.
    """

    global_shape: tuple[int, ...]
    blocks: tuple[LayoutBlock, ...]
    num_hosts: int
    mesh: Mesh | None = None
    spec: PartitionSpec | None = None

    def devices_indices_map(self) -> dict[int, tuple[slice, ...]]:
        """``{device id: slices}``, as ``NamedSharding.devices_indices_map``."""
        return {b.device: b.index for b in self.blocks}

    def host_of(self, device: int) -> int:
        """The host that owns ``device``."""
        for b in self.blocks:
            if b.device == device:
                return b.host
        raise KeyError(f"device {device} is not in this layout (devices {self.devices}).")

    @property
    def devices(self) -> tuple[int, ...]:
        """The device ids of the layout, ascending."""
        return tuple(b.device for b in self.blocks)

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
        by_host: dict[int, list[LayoutBlock]] = {}
        for b in self.blocks:  # one pass: linear in the devices, whatever the host count
            by_host.setdefault(b.host, []).append(b)
        out = {}
        ndim = len(self.global_shape)
        for h in sorted(by_host):
            mine = by_host[h]
            # along each dim, the distinct ranges of its devices end to end (``block_offsets``)
            if len(mine) == 1:
                shape = tuple(b - a for a, b in mine[0].ranges)
            else:
                dims = zip(*[b.ranges for b in mine], strict=True) if ndim else ()
                shape = tuple(sum(b - a for a, b in set(spans)) for spans in dims)
            out[h] = (tuple(b.device for b in mine), shape)
        return out

    def title(self) -> str:
        """One line: spec, mesh, global shape, hosts."""
        what = (
            f"{self.spec!r} on {self.mesh!r}"
            if self.spec is not None
            else (f"tensor on {self.mesh!r}" if self.mesh is not None else "tensor")
        )
        hosts = f"{self.num_hosts} host" + ("s" if self.num_hosts != 1 else "")
        return f"{what}: global shape {self.global_shape}, {hosts}"

    def to_text(self) -> str:
        """The plain-text grid or table (no colours)."""
        return render_plain(self)

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
        count = len(set(owners))
    check_device_process(mesh, owners)
    NamedSharding(mesh, spec)  # checks the spec's axes (then its length, below)
    # The blocks from arrays (``device_ranges``), without a dict of slices per device
    ids, starts, stops = device_ranges(mesh, dim_axes(mesh, spec, len(shape)), shape)
    devices = ids.tolist()
    spans = []  # per dim, each device's (start, stop): one tuple per distinct span, shared
    for i in range(len(shape)):
        known: dict[Span, Span] = {}
        pairs = zip(starts[:, i].tolist(), stops[:, i].tolist(), strict=True)
        spans.append([known.setdefault(p, p) for p in pairs])
    ranges = list(zip(*spans, strict=True)) if spans else [()] * len(devices)
    blocks = tuple(map(LayoutBlock, devices, [owners[d] for d in devices], ranges))
    return ShardingLayout(shape, blocks, count, mesh, spec)


# -- the plain-text picture ------------------------------------------------------------


def compact(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``0-3,6`` (runs of three or more become ranges)."""
    ids = sorted(ids)
    if len(ids) >= 3 and ids == list(range(ids[0], ids[0] + len(ids))):  # one run: at C speed
        return f"{ids[0]}-{ids[-1]}"
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{ids[i]}-{ids[j]}")
        else:
            out.extend(str(x) for x in ids[i : j + 1])
        i = j + 1
    return ",".join(out)


def span_text(r: Span) -> str:
    return f"{r[0]}:{r[1]}"


def cell_lines(blocks: Sequence[LayoutBlock]) -> tuple[str, str]:
    """The two label lines of a block: its devices and their hosts."""
    devs = [b.device for b in blocks]
    hosts = sorted({b.host for b in blocks})
    dev = f"device {devs[0]}" if len(devs) == 1 else f"devices {compact(devs)}"
    host = f"host {hosts[0]}" if len(hosts) == 1 else f"hosts {compact(hosts)}"
    return dev, host


def grid(
    layout: ShardingLayout,
) -> tuple[list[Span], list[Span] | None, dict[tuple[int, int], tuple[LayoutBlock, ...]]] | None:
    """Rows (dim-0 spans), columns (dim-1 spans, None for 1-D) and the blocks of each cell;
    None when the layout is drawn as a table (rank not 1 or 2, or too many blocks)."""
    ndim = len(layout.global_shape)
    if ndim not in (1, 2):
        return None
    rows = sorted({r[0] for r in layout.distinct_blocks})
    cols = sorted({r[1] for r in layout.distinct_blocks}) if ndim == 2 else None
    if len(rows) > MAX_GRID_ROWS or len(cols or ()) > MAX_GRID_COLS:
        return None
    cells = {}
    for ranges, blocks in layout.distinct_blocks.items():
        i = rows.index(ranges[0])
        j = cols.index(ranges[1]) if cols is not None else 0
        cells[(i, j)] = blocks
    return rows, cols, cells


def table_rows(layout: ShardingLayout) -> list[tuple[str, str, str]]:
    rows = []
    for ranges, blocks in layout.distinct_blocks.items():
        block = "[" + ", ".join([f"{a}:{b}" for a, b in ranges]) + "]"
        if len(blocks) == 1:  # one device (a pod's FULL batch: every row)
            rows.append((block, str(blocks[0].device), str(blocks[0].host)))
            continue
        rows.append(
            (block, compact([b.device for b in blocks]), compact(sorted({b.host for b in blocks})))
        )
    return rows


def footer(layout: ShardingLayout) -> list[str]:
    """Per host: its devices and local block shape; a note on uneven splits."""
    lines = []
    for h, (devs, shape) in layout.host_blocks().items():
        lines.append(f"host {h}: devices {compact(devs)}, local block shape {shape}")
    for i, n in enumerate(layout.global_shape):
        lengths = {r[i][1] - r[i][0] for r in layout.distinct_blocks}
        if len(lengths) > 1:
            lines.append(
                f"note: dim {i} ({n}) splits unevenly, into blocks of sizes {sorted(lengths)}; "
                "torchshard's host_to_global_array refuses it (pad the batch), torch_xla pads."
            )
    return lines


def _box_table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max([len(r[i]) for r in rows]) for i in range(len(rows[0]))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    line = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    out = [line.format(*r) for r in rows]
    return [rule, out[0], rule, *out[1:], rule]


def render_plain(layout: ShardingLayout) -> str:
    """The layout as plain text: title, grid or table, host lines."""
    lines = [layout.title(), ""]
    g = grid(layout)
    if g is None:
        lines += _box_table([("block", "devices", "hosts"), *table_rows(layout)])
    else:
        rows, cols, cells = g
        ncols = len(cols) if cols is not None else 1
        labels = {k: cell_lines(v) for k, v in cells.items()}
        width = max([len(s) for pair in labels.values() for s in pair] + [3]) + 2
        head = max(len(span_text(r)) for r in rows)
        rule = " " * head + " +" + "+".join("-" * width for _ in range(ncols)) + "+"
        if cols is not None:
            lines.append(" " * head + "  " + " ".join(span_text(c).center(width) for c in cols))
        lines.append(rule)
        for i, r in enumerate(rows):
            for k in range(2):
                text = [
                    (" " + labels[(i, j)][k]).ljust(width) if (i, j) in labels else " " * width
                    for j in range(ncols)
                ]
                label = span_text(r) if k == 0 else ""
                lines.append(label.rjust(head) + " |" + "|".join(text) + "|")
            lines.append(rule)
    lines += ["", *footer(layout)]
    return "\n".join(line.rstrip() for line in lines)
