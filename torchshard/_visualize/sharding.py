"""Showing layouts: ``visualize_sharding`` (a text grid, plain or ``rich``), the PNG drawer
behind ``ShardingLayout.save_png`` (matplotlib), and ``layout_of_tensor`` (the layout of a
placed tensor, from the blocks its backend reports).

1-D and 2-D arrays are drawn as a grid of their distinct blocks (dim 0 down, dim 1 across),
each cell naming the devices that hold the block and their host; other ranks, and grids too
large for a terminal, become a table with one row per distinct block. The plain-text picture
and the grid maths are the pure core's (``torchshard._core.layout``).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import IO, Any

import numpy as np
import torch

from torchshard._backend.registry import lookup
from torchshard._core.context import current_mesh
from torchshard._core.layout import LayoutBlock, ShardingLayout, install_png_drawer
from torchshard._core.layout_text import (
    Cell,
    cell_lines,
    footer,
    grid,
    render_plain,
    span_text,
    table_lines,
    table_rows,
)
from torchshard._core.optional import available, require_matplotlib, require_rich
from torchshard._mesh.context import current_topology

_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_black", "white")


def layout_of_tensor(tensor: Any) -> ShardingLayout:
    """The layout of a placed global tensor, from the blocks its backend reports for it.

    Hosts come from the current topology (emulated inside ``virtual_hosts``); the mesh is the
    current mesh, if any. On one host of many, only that host's devices are known. A tensor
    its backend holds unsharded (never annotated) is whole on every local device.
    """
    mesh = current_mesh()
    backend = lookup(mesh)
    if not backend.place.is_global(tensor):
        got = type(tensor).__name__
        if isinstance(tensor, torch.Tensor):
            got = f"a tensor on {tensor.device}"
        raise TypeError(
            "visualize_sharding: expected a global (XLA) tensor or a ShardingLayout, but got "
            f"{got}."
        )
    shape = tuple(int(n) for n in tensor.shape)
    topo = current_topology(mesh)
    if backend.read.is_sharded(tensor):
        pairs = [(s.device, s.ranges) for s in backend.read.local_shards([tensor])[0]]
    else:
        whole = tuple((0, n) for n in shape)
        pairs = [(d, whole) for d in backend.place.local_devices(mesh)]
    blocks = tuple(
        LayoutBlock(d, topo.device_process[d], r) for d, r in sorted(pairs, key=lambda p: p[0])
    )
    return ShardingLayout(shape, blocks, topo.process_count, mesh, None)


def render_rich(layout: ShardingLayout, file: IO[str], *, full: bool = False) -> None:
    """Prints the layout with ``rich`` (cells coloured by host; a large layout's runs, or with
    ``full`` every block and host, as ``render_plain``)."""
    require_rich("visualize_sharding(use_rich=True)")
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own ends the process (SystemExit(1), stdout moved to /dev/null): a library
            # function raises, and the caller decides (the CLI says so in one line).
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    console = _Console(file=file, width=None if file.isatty() else 160, highlight=False)
    g = grid(layout)
    table = Table(box=box.SQUARE, show_lines=g is not None)

    def styled(cell: Cell) -> Text:
        colour = _COLOURS[cell.hosts[0] % len(_COLOURS)]
        return Text("\n".join(cell_lines(cell)), style=f"bold {colour}", justify="center")

    if g is None:
        for name in ("block", "devices", "hosts"):
            table.add_column(name)
        for line in table_lines(layout, full=full):
            if isinstance(line, str):  # a run's step, or the blocks left out
                table.add_row(Text(line, style="dim"), "", "")
                continue
            block, devs, hosts, host = line
            colour = _COLOURS[host % len(_COLOURS)]
            table.add_row(block, devs, Text(hosts, style=f"bold {colour}"))
    else:
        rows, cols, cells = g
        table.add_column("", justify="right", style="dim")
        for c in cols if cols is not None else [None]:
            table.add_column(span_text(c) if c is not None else "", justify="center")
        ncols = len(cols) if cols is not None else 1
        for i, r in enumerate(rows):
            row: list[Any] = [span_text(r)]
            row += [styled(cells[(i, j)]) if (i, j) in cells else "" for j in range(ncols)]
            table.add_row(*row)
    console.print(layout.title())
    console.print(table)
    for line in footer(layout, full=full):
        console.print(line)


def visualize_sharding(
    tensor_or_layout: Any,
    *,
    file: IO[str] | None = None,
    use_rich: bool | None = None,
    full: bool = False,
) -> ShardingLayout:
    """Prints which device and host hold which block of a tensor or a described layout.

    Args:
        tensor_or_layout: a global (XLA) tensor (its blocks as the runtime reports them, hosts
            from the current topology) or a ``ShardingLayout`` from ``describe_layout``.
        file: where to print (default: ``sys.stdout``).
        use_rich: draw with ``rich`` (default: when it is installed); False: plain text.
        full: every block and every host, however many; by default a layout of more than 64
            blocks (or hosts) prints the runs they form (the first and last of each, and the
            step between them), so a pod's 16,384 devices print as a few lines.

    Returns:
        The ``ShardingLayout`` (``.save_png(path)`` draws it into a picture).

    Example (columns over ``model``, replicated over ``data``; plain text, as without rich):
        >>> mesh = torchshard.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
        >>> with mesh:
        ...     x = torchshard.host_to_global_array(
        ...         np.zeros((8, 4)), partition=torchshard.P(None, "model")
        ...     )
        ...     layout = torchshard.visualize_sharding(x, use_rich=False)
        tensor on Mesh({'data': 4, 'model': 2}): global shape (8, 4), 1 host
        <BLANKLINE>
                    0:2               2:4
            +-----------------+-----------------+
        0:8 | devices 0,2,4,6 | devices 1,3,5,7 |
            | host 0          | host 0          |
            +-----------------+-----------------+
        <BLANKLINE>
        host 0: devices 0-7, local block shape (8, 4)
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     layout.save_png(os.path.join(tmp, "layout.png"))
    """
    if isinstance(tensor_or_layout, ShardingLayout):
        layout = tensor_or_layout
    else:
        layout = layout_of_tensor(tensor_or_layout)
    file = sys.stdout if file is None else file
    if use_rich is None:
        use_rich = available("rich")
    if use_rich:
        render_rich(layout, file, full=full)
    else:
        file.write(render_plain(layout, full=full) + "\n")
    return layout


def save_png(layout: ShardingLayout, path: str, dpi: int = 120) -> None:
    """Draws ``layout`` into a PNG at ``path`` (behind ``ShardingLayout.save_png``)."""
    require_matplotlib("ShardingLayout.save_png")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    cmap = [f"C{i}" for i in range(10)]
    g = grid(layout)
    if g is None:
        rows = table_rows(layout)
        fig = Figure(figsize=(7, 1.2 + 0.28 * len(rows)))
        ax = fig.add_subplot()
        ax.axis("off")
        ax.table(
            cellText=rows or [("", "", "")],
            colLabels=["block", "devices", "hosts"],
            loc="center",
            cellLoc="center",
        )
    else:
        rowspans, colspans, cells = g
        ndim = len(layout.global_shape)
        n0 = layout.global_shape[0]
        n1 = layout.global_shape[1] if ndim == 2 else 1
        fig = Figure(
            figsize=(min(4.5 + 1.8 * len(colspans or [0]), 14), min(1.8 + 0.55 * len(rowspans), 14))
        )
        ax = fig.add_subplot()
        size = max(5.0, 11.0 - 0.08 * len(cells))
        for (i, j), cell in cells.items():
            r0, r1 = rowspans[i]
            c0, c1 = colspans[j] if colspans is not None else (0, 1)
            if r1 == r0 or c1 == c0:
                continue  # an empty block of an uneven split
            ax.add_patch(
                Rectangle(
                    (c0, r0),
                    c1 - c0,
                    r1 - r0,
                    facecolor=cmap[cell.hosts[0] % 10],
                    alpha=0.55,
                    edgecolor="black",
                    linewidth=1.2,
                )
            )
            ax.text(
                (c0 + c1) / 2,
                (r0 + r1) / 2,
                "\n".join(cell_lines(cell)),
                ha="center",
                va="center",
                fontsize=size,
            )
        ax.set_xlim(0, max(n1, 1))
        ax.set_ylim(max(n0, 1), 0)
        ax.set_yticks(sorted({r[0] for r in rowspans} | {n0}))
        ax.set_ylabel("dim 0")
        if colspans is not None:
            ax.set_xticks(sorted({c[0] for c in colspans} | {n1}))
            ax.set_xlabel("dim 1")
            ax.xaxis.set_label_position("top")
            ax.xaxis.tick_top()
        else:
            ax.set_xticks([])
        hosts = np.unique(layout.arrays.hosts).tolist()
        if len(hosts) <= 16:
            ax.legend(
                handles=[
                    Patch(facecolor=cmap[h % 10], alpha=0.55, label=f"host {h}") for h in hosts
                ],
                loc="upper left",
                bbox_to_anchor=(1.01, 1.0),
                fontsize=9,
                frameon=False,
            )
    fig.suptitle(layout.title().replace(": global shape", "\nglobal shape"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, format="png")


install_png_drawer(save_png)
