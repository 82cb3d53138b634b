"""Drawing a ``ShardingLayout``: a text grid (plain or ``rich``) and a PNG (matplotlib).

1-D and 2-D arrays are drawn as a grid of their distinct blocks (dim 0 down, dim 1 across),
each cell naming the devices that hold the block and their host; other ranks, and grids too
large for a terminal, become a table with one row per distinct block.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO, Any

from torchshard._describe import LayoutBlock, ShardingLayout, layout_of_tensor
from torchshard._optional import has_rich, require_matplotlib, require_rich

_MAX_GRID_ROWS = 64
_MAX_GRID_COLS = 8
_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_black", "white")

Span = tuple[int, int]


def compact(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``0-3,6`` (runs of three or more become ranges)."""
    ids = sorted(ids)
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


def _span(r: Span) -> str:
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
    if len(rows) > _MAX_GRID_ROWS or len(cols or ()) > _MAX_GRID_COLS:
        return None
    cells = {}
    for ranges, blocks in layout.distinct_blocks.items():
        i = rows.index(ranges[0])
        j = cols.index(ranges[1]) if cols is not None else 0
        cells[(i, j)] = blocks
    return rows, cols, cells


def _table_rows(layout: ShardingLayout) -> list[tuple[str, str, str]]:
    rows = []
    for ranges, blocks in layout.distinct_blocks.items():
        block = "[" + ", ".join(_span(r) for r in ranges) + "]"
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
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [rule]
    for n, r in enumerate(rows):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
        if n == 0:
            out.append(rule)
    out.append(rule)
    return out


def render_plain(layout: ShardingLayout) -> str:
    """The layout as plain text: title, grid or table, host lines."""
    lines = [layout.title(), ""]
    g = grid(layout)
    if g is None:
        lines += _box_table([("block", "devices", "hosts"), *_table_rows(layout)])
    else:
        rows, cols, cells = g
        ncols = len(cols) if cols is not None else 1
        labels = {k: cell_lines(v) for k, v in cells.items()}
        width = max([len(s) for pair in labels.values() for s in pair] + [3]) + 2
        head = max(len(_span(r)) for r in rows)
        rule = " " * head + " +" + "+".join("-" * width for _ in range(ncols)) + "+"
        if cols is not None:
            lines.append(" " * head + "  " + " ".join(_span(c).center(width) for c in cols))
        lines.append(rule)
        for i, r in enumerate(rows):
            for k in range(2):
                text = [
                    (" " + labels[(i, j)][k]).ljust(width) if (i, j) in labels else " " * width
                    for j in range(ncols)
                ]
                label = _span(r) if k == 0 else ""
                lines.append(label.rjust(head) + " |" + "|".join(text) + "|")
            lines.append(rule)
    lines += ["", *footer(layout)]
    return "\n".join(line.rstrip() for line in lines)


def render_rich(layout: ShardingLayout, file: IO[str]) -> None:
    """Prints the layout with ``rich`` (cells coloured by host)."""
    require_rich("visualize_sharding(use_rich=True)")
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=file, width=None if file.isatty() else 160, highlight=False)
    g = grid(layout)
    table = Table(box=box.SQUARE, show_lines=g is not None)

    def styled(blocks: Sequence[LayoutBlock]) -> Text:
        colour = _COLOURS[blocks[0].host % len(_COLOURS)]
        return Text("\n".join(cell_lines(blocks)), style=f"bold {colour}", justify="center")

    if g is None:
        for name in ("block", "devices", "hosts"):
            table.add_column(name)
        for (block, devs, hosts), blocks in zip(
            _table_rows(layout), layout.distinct_blocks.values(), strict=True
        ):
            colour = _COLOURS[blocks[0].host % len(_COLOURS)]
            table.add_row(block, devs, Text(hosts, style=f"bold {colour}"))
    else:
        rows, cols, cells = g
        table.add_column("", justify="right", style="dim")
        for c in cols if cols is not None else [None]:
            table.add_column(_span(c) if c is not None else "", justify="center")
        ncols = len(cols) if cols is not None else 1
        for i, r in enumerate(rows):
            row: list[Any] = [_span(r)]
            row += [styled(cells[(i, j)]) if (i, j) in cells else "" for j in range(ncols)]
            table.add_row(*row)
    console.print(layout.title())
    console.print(table)
    for line in footer(layout):
        console.print(line)


def visualize_sharding(
    tensor_or_layout: Any, *, file: IO[str] | None = None, use_rich: bool | None = None
) -> ShardingLayout:
    """Prints which device and host hold which block of a tensor or a described layout.

    Args:
        tensor_or_layout: a global (XLA) tensor (its blocks as the runtime reports them, hosts
            from the current topology) or a ``ShardingLayout`` from ``describe_layout``.
        file: where to print (default: ``sys.stdout``).
        use_rich: draw with ``rich`` (default: when it is installed); False: plain text.

    Returns:
        The ``ShardingLayout`` (``.save_png(path)`` draws it into a picture).

    Example:
        >>> layout = describe_layout(mesh, P("data", "model"), (16, 8), num_hosts=2)
        >>> visualize_sharding(layout).save_png("layout.png")
    """
    if isinstance(tensor_or_layout, ShardingLayout):
        layout = tensor_or_layout
    else:
        layout = layout_of_tensor(tensor_or_layout)
    file = sys.stdout if file is None else file
    if use_rich is None:
        use_rich = has_rich()
    if use_rich:
        render_rich(layout, file)
    else:
        file.write(render_plain(layout) + "\n")
    return layout


def save_png(layout: ShardingLayout, path: str, *, dpi: int = 120) -> None:
    """Draws ``layout`` into a PNG at ``path`` (see ``ShardingLayout.save_png``)."""
    require_matplotlib("ShardingLayout.save_png")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    cmap = [f"C{i}" for i in range(10)]
    g = grid(layout)
    if g is None:
        rows = _table_rows(layout)
        fig = Figure(figsize=(7, 1.2 + 0.28 * len(rows)))
        ax = fig.add_subplot()
        ax.axis("off")
        ax.table(
            cellText=rows or [["", "", ""]],
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
        for (i, j), blocks in cells.items():
            r0, r1 = rowspans[i]
            c0, c1 = colspans[j] if colspans is not None else (0, 1)
            if r1 == r0 or c1 == c0:
                continue  # an empty block of an uneven split
            ax.add_patch(
                Rectangle(
                    (c0, r0),
                    c1 - c0,
                    r1 - r0,
                    facecolor=cmap[blocks[0].host % 10],
                    alpha=0.55,
                    edgecolor="black",
                    linewidth=1.2,
                )
            )
            ax.text(
                (c0 + c1) / 2,
                (r0 + r1) / 2,
                "\n".join(cell_lines(blocks)),
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
        hosts = sorted({b.host for b in layout.blocks})
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
