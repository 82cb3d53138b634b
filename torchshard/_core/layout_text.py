"""The plain-text picture of a ``ShardingLayout``: a grid of its distinct blocks (1-D and 2-D
arrays), else a table of them, then a line per host; for a large layout, a summary whose length
follows the layout's regularity, not its devices.

Text a reader can read: where the table or the host lines would pass ``MAX_LINES``, they print
runs instead: the first and the last block (or host) of each run of blocks that advance by one
constant step, with the step between them (``... 16,382 more blocks, each [+2, +0], devices
+1``), and runs of such runs the same way, up to ``MAX_LINES`` lines. A pod's layout (16,384
devices of one block each, 4,096 hosts) is then a few lines; ``layout.to_text(full=True)``
prints every block and every host. Everything is computed from the layout's arrays (numpy),
not from an object per device; lists of many devices print as ranges and progressions
(``0-4095``, ``0,4,...,16380``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from torchshard._core.layout import LayoutArrays, ShardingLayout

Span = tuple[int, int]
MAX_GRID_ROWS = 64
MAX_GRID_COLS = 8
MAX_LINES = 64  # table rows, and host lines, printed whole up to this many
LONG_LIST = 16  # a list of more ids than this prints its progressions as ``a,b,...,z``
LEVELS = 4  # runs of runs, nested at most this deep


def compact(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``0-3,6`` (runs of three or more become ranges); a list of more
    than ``LONG_LIST`` ids also prints progressions of four or more with another step as
    ``a,b,...,z`` (``0,4,...,16380``)."""
    ids = sorted(ids)
    if len(ids) >= 3 and ids == list(range(ids[0], ids[0] + len(ids))):  # one run: at C speed
        return f"{ids[0]}-{ids[-1]}"
    if len(ids) > LONG_LIST:
        return _progressions(np.asarray(ids, dtype=np.int64))
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


def _progressions(ids: np.ndarray) -> str:
    """Sorted ``ids`` as runs: step 1 and three or more as ``a-z``, another step and four or
    more as ``a,b,...,z``, the rest one by one."""
    starts, lengths, steps = _runs1(ids.reshape(-1, 1), np.zeros(1, dtype=bool))
    out = []
    for s, n, d in zip(starts.tolist(), lengths.tolist(), steps[:, 0].tolist(), strict=True):
        first, last = int(ids[s]), int(ids[s + n - 1])
        if d == 1 and n >= 3:
            out.append(f"{first}-{last}")
        elif n >= 4:
            out.append(f"{first},{first + d},...,{last}")
        else:
            out.extend(str(x) for x in ids[s : s + n].tolist())
    return ",".join(out)


def span_text(r: Span) -> str:
    return f"{r[0]}:{r[1]}"


class Cell(NamedTuple):
    """The devices (ascending) that hold one cell's block of a grid, and their hosts (distinct,
    ascending)."""

    devices: list[int]
    hosts: list[int]


def cell_lines(cell: Cell) -> tuple[str, str]:
    """The two label lines of a block: its devices and their hosts."""
    devs, hosts = cell.devices, cell.hosts
    dev = f"device {devs[0]}" if len(devs) == 1 else f"devices {compact(devs)}"
    host = f"host {hosts[0]}" if len(hosts) == 1 else f"hosts {compact(hosts)}"
    return dev, host


def grid(
    layout: ShardingLayout,
) -> tuple[list[Span], list[Span] | None, dict[tuple[int, int], Cell]] | None:
    """Rows (dim-0 spans), columns (dim-1 spans, None for 1-D) and the devices of each cell;
    None when the layout is drawn as a table (rank not 1 or 2, or too many blocks)."""
    ndim = len(layout.global_shape)
    if ndim not in (1, 2):
        return None
    ids, hosts, starts, stops = layout.arrays
    if not ids.size:
        return None
    spans = []
    for i, most in zip(range(ndim), (MAX_GRID_ROWS, MAX_GRID_COLS), strict=False):
        found = _distinct_spans(starts[:, i], stops[:, i], most)
        if found is None:
            return None
        spans.append(found)
    rows, at_row = spans[0]
    cols, at_col = spans[1] if ndim == 2 else (None, np.zeros_like(at_row))
    cell = at_row * (len(cols) if cols is not None else 1) + at_col
    order = np.lexsort((ids, cell))
    firsts = _firsts(cell[order])
    cells = {}
    for part in np.split(order, firsts[1:]):
        c = int(cell[part[0]])
        key = (c // len(cols), c % len(cols)) if cols is not None else (c, 0)
        cells[key] = Cell(ids[part].tolist(), np.unique(hosts[part]).tolist())
    return rows, cols, cells


def _distinct_spans(
    starts: np.ndarray, stops: np.ndarray, most: int
) -> tuple[list[Span], np.ndarray] | None:
    """The distinct ``(start, stop)`` spans, sorted, and each device's index among them; None
    past ``most`` of them."""
    order = np.lexsort((stops, starts))
    s, e = starts[order], stops[order]
    new = np.ones(s.size, dtype=bool)
    new[1:] = (s[1:] != s[:-1]) | (e[1:] != e[:-1])
    firsts = np.flatnonzero(new)
    if firsts.size > most:
        return None
    where = np.empty(s.size, dtype=np.int64)
    where[order] = np.cumsum(new) - 1
    return list(zip(s[firsts].tolist(), e[firsts].tolist(), strict=True)), where


def _firsts(sorted_keys: np.ndarray) -> np.ndarray:
    """The index of the first of each run of equal values in ``sorted_keys``."""
    if not sorted_keys.size:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1])))


class HostTable(NamedTuple):
    """Per host (ascending): its devices and the shape of its local block (per dimension, the
    total length of its devices' distinct spans). Host ``hosts[k]`` holds the devices
    ``ids[bounds[k]:bounds[k + 1]]`` (ascending); ``shapes`` is ``[hosts, dims]``."""

    hosts: np.ndarray
    ids: np.ndarray
    bounds: np.ndarray
    shapes: np.ndarray

    def devices(self, k: int) -> list[int]:
        return self.ids[self.bounds[k] : self.bounds[k + 1]].tolist()


def host_table(arrays: LayoutArrays) -> HostTable:
    """The ``HostTable`` of a layout's arrays (numpy, no object per device or host)."""
    ids, hosts, starts, stops = arrays
    order = np.lexsort((ids, hosts))
    by_host = hosts[order]
    first = _firsts(by_host)
    owners = by_host[first]
    shapes = np.zeros((owners.size, starts.shape[1]), dtype=np.int64)
    row = np.searchsorted(owners, hosts)  # each device's host row
    for i in range(starts.shape[1] if ids.size else 0):
        # distinct (host, start, stop) per dim: their lengths add up to the host's local block
        key = np.lexsort((stops[:, i], starts[:, i], row))
        r, s, e = row[key], starts[key, i], stops[key, i]
        new = np.ones(r.size, dtype=bool)
        new[1:] = (r[1:] != r[:-1]) | (s[1:] != s[:-1]) | (e[1:] != e[:-1])
        shapes[:, i] = np.add.reduceat((e - s)[new], _firsts(r[new]))  # ints: sizes to 2**63
    return HostTable(owners, ids[order], np.append(first, ids.size), shapes)


class _Blocks(NamedTuple):
    """The distinct blocks, sorted by position: block ``g`` is held by the devices
    ``order[bounds[g]:bounds[g + 1]]`` (rows of the layout's arrays, ascending ids)."""

    order: np.ndarray
    bounds: np.ndarray

    @classmethod
    def of(cls, arrays: LayoutArrays) -> _Blocks:
        ids, _, starts, stops = arrays
        ndim = starts.shape[1]
        keys = [ids]  # lexsort: the last key is the primary one (dim 0's start)
        for i in reversed(range(ndim)):
            keys += [stops[:, i], starts[:, i]]
        order = np.lexsort(keys)
        s, e = starts[order], stops[order]
        new = np.ones(ids.size, dtype=bool)
        new[1:] = (s[1:] != s[:-1]).any(axis=1) | (e[1:] != e[:-1]).any(axis=1)
        return cls(order, np.append(np.flatnonzero(new), ids.size))

    def __len__(self) -> int:
        return self.bounds.size - 1

    def rows(self, g: int) -> np.ndarray:
        return self.order[self.bounds[g] : self.bounds[g + 1]]


TableRow = tuple[str, str, str, int]  # block, devices, hosts, the first host (a colour)


def _table_row(arrays: LayoutArrays, rows: np.ndarray) -> TableRow:
    """The table row of the block held by the devices at ``rows`` of ``arrays``."""
    ids, hosts, starts, stops = arrays
    r = int(rows[0])
    block = "[" + ", ".join(f"{a}:{b}" for a, b in zip(starts[r], stops[r], strict=True)) + "]"
    devices = ids[rows].tolist()
    held = np.unique(hosts[rows]).tolist()
    if len(devices) == 1:  # one device (a pod's FULL batch: every row)
        return block, str(devices[0]), str(held[0]), held[0]
    return block, compact(devices), compact(held), held[0]


def table_rows(layout: ShardingLayout) -> list[tuple[str, str, str]]:
    """One ``(block, devices, hosts)`` row per distinct block, sorted by position (every
    block: ``table_lines`` summarises a large layout)."""
    blocks = _Blocks.of(layout.arrays)
    return [_table_row(layout.arrays, blocks.rows(g))[:3] for g in range(len(blocks))]


def table_lines(layout: ShardingLayout, *, full: bool = False) -> list[TableRow | str]:
    """The table: a row per distinct block, sorted by position; past ``MAX_LINES`` blocks
    (unless ``full``), runs of them, a note line (a ``str``) between a run's first and last."""
    arrays = layout.arrays
    blocks = _Blocks.of(arrays)
    if full or len(blocks) <= MAX_LINES:
        return [_table_row(arrays, blocks.rows(g)) for g in range(len(blocks))]
    ndim = arrays.starts.shape[1]
    firsts = blocks.order[blocks.bounds[:-1]]
    held = np.diff(blocks.bounds)  # devices per block
    out: list[TableRow | str] = []
    total = len(blocks)
    for a, b in _segments(held):  # blocks a..b-1 have equal counts of devices
        c = int(held[a])
        devices = arrays.ids[blocks.order[blocks.bounds[a] : blocks.bounds[b]]].reshape(-1, c)
        records = np.concatenate(
            [arrays.starts[firsts[a:b]], arrays.stops[firsts[a:b]], devices], axis=1
        )

        def row(k: int, a: int = a) -> TableRow:
            return _table_row(arrays, blocks.rows(a + k))

        def note(more: int, step: np.ndarray, inner: int) -> str:
            what = "blocks" if inner == 0 else "groups like the one above"
            return f"... {more:,} more {what}, each {_block_step(step, ndim)}"

        if not _emit(records, np.zeros(records.shape[1], dtype=bool), row, note, out, a, total):
            break
    return out


def _block_step(step: np.ndarray, ndim: int) -> str:
    """``[+2, +0], devices +1``: a step of blocks' records (starts, stops, devices)."""
    starts, stops, devices = step[:ndim], step[ndim : 2 * ndim], step[2 * ndim :]
    block = ", ".join(
        f"{a:+d}" if a == b else f"{a:+d}:{b:+d}"
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
    )
    return f"[{block}], devices {_shift(devices)}"


def _shift(step: np.ndarray) -> str:
    values = sorted(set(step.tolist()))
    if len(values) == 1:
        return f"{values[0]:+d}"
    return "(" + ", ".join(f"{v:+d}" for v in step.tolist()) + ")"


def host_lines(layout: ShardingLayout, *, full: bool = False) -> list[str]:
    """A line per host: its devices and local block shape; past ``MAX_LINES`` hosts (unless
    ``full``), runs of hosts (a note line between a run's first and last)."""
    table = host_table(layout.arrays)
    hosts, shapes = table.hosts, table.shapes

    def line(k: int) -> str:
        return (
            f"host {int(hosts[k])}: devices {compact(table.devices(k))}, local block shape "
            f"{tuple(shapes[k].tolist())}"
        )

    if full or hosts.size <= MAX_LINES:
        return [line(k) for k in range(hosts.size)]
    counts = np.diff(table.bounds)  # devices per host
    out: list[TableRow | str] = []
    ndim = shapes.shape[1]
    for a, b in _segments(counts):  # hosts a..b-1 have equal counts of devices
        devices = table.ids[table.bounds[a] : table.bounds[b]].reshape(b - a, -1)
        records = np.concatenate([shapes[a:b], hosts[a:b, None], devices], axis=1)
        fixed = np.arange(records.shape[1]) < ndim  # a run of hosts keeps its block shape

        def row(k: int, a: int = a) -> str:
            return line(a + k)

        def note(more: int, step: np.ndarray, inner: int) -> str:
            what = "hosts" if inner == 0 else "groups of hosts like the one above"
            h, d = int(step[ndim]), step[ndim + 1 :]
            each = f"devices {_shift(d)}" if h == 1 else f"hosts {h:+d}, devices {_shift(d)}"
            return f"... {more:,} more {what}, each {each}"

        if not _emit(records, fixed, row, note, out, a, hosts.size, what="hosts"):
            break
    return [x if isinstance(x, str) else x[0] for x in out]


def _segments(counts: np.ndarray) -> list[tuple[int, int]]:
    """``[a, b)`` of each run of equal values in ``counts``."""
    firsts = _firsts(counts).tolist()
    return list(zip(firsts, [*firsts[1:], counts.size], strict=True))


def footer(layout: ShardingLayout, *, full: bool = False) -> list[str]:
    """Per host: its devices and local block shape; a note on uneven splits."""
    lines = host_lines(layout, full=full)
    _, _, starts, stops = layout.arrays
    for i, n in enumerate(layout.global_shape):
        length = stops[:, i] - starts[:, i]
        if not length.size or length.min() == length.max():
            continue
        lengths = np.unique(length).tolist()
        if len(lengths) > 1:
            lines.append(
                f"note: dim {i} ({n}) splits unevenly, into blocks of sizes {lengths}; "
                "torchshard's host_to_global_array refuses it (pad the batch), torch_xla pads."
            )
    return lines


# -- runs -------------------------------------------------------------------------------------


def _runs1(records: np.ndarray, fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy maximal runs of ``records`` (``[n, m]``, in order) that advance by one constant
    step, zero in the ``fixed`` columns: each run's first record, length, and step (zeros for a
    run of one). Numpy over the records, a Python step per run."""
    n, m = records.shape
    starts: list[int] = []
    lengths: list[int] = []
    if n > 1:
        d = np.diff(records, axis=0)
        ok = (~(d[:, fixed] != 0).any(axis=1)).tolist()
        new = np.ones(n - 1, dtype=bool)
        new[1:] = (d[1:] != d[:-1]).any(axis=1)
        segment = (np.cumsum(new) - 1).tolist()  # per step, its run of equal steps
        last = (np.append(np.flatnonzero(new)[1:], n - 1) - 1).tolist()  # each run's last step
    i = 0
    while i < n:
        if i == n - 1 or not ok[i]:
            starts.append(i)
            lengths.append(1)
            i += 1
        else:
            j = last[segment[i]]  # steps i..j are equal: records i..j+1
            starts.append(i)
            lengths.append(j - i + 2)
            i = j + 2
    first = np.asarray(starts, dtype=np.int64)
    length = np.asarray(lengths, dtype=np.int64)
    steps = np.zeros((first.size, m), dtype=records.dtype)
    many = length > 1
    steps[many] = records[first[many] + 1] - records[first[many]]
    return first, length, steps


def runs(records: np.ndarray, fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``records`` (``[n, m]``, in order) as runs of runs, up to ``LEVELS`` deep: per top-level
    run, its first record, its counts (``[runs, levels]``, outer to inner: it covers their
    product of records) and steps (``[runs, levels, m]``). Runs that advance by one step
    (zero in the ``fixed`` columns) merge into a run of the next level."""
    n, m = records.shape
    starts = np.arange(n)
    counts = np.ones((n, 0), dtype=np.int64)
    steps = np.zeros((n, 0), dtype=records.dtype)  # flattened, outer to inner
    for level in range(LEVELS):
        rec = np.concatenate([counts, steps, records[starts]], axis=1)
        mask = np.concatenate([np.ones(counts.shape[1] + steps.shape[1], dtype=bool), fixed])
        first, length, step = _runs1(rec, mask)
        if level and (length == 1).all():
            break
        starts = starts[first]
        counts = np.concatenate([length[:, None], counts[first]], axis=1)
        steps = np.concatenate([step[:, -m:], steps[first]], axis=1)
        if starts.size == 1:
            break
    return starts, counts, steps.reshape(starts.size, -1, m)


def _emit(
    records: np.ndarray,
    fixed: np.ndarray,
    row: Callable[[int], TableRow | str],
    note: Callable[[int, np.ndarray, int], str],
    out: list[TableRow | str],
    offset: int,
    total: int,
    *,
    what: str = "blocks",
) -> bool:
    """Appends the lines of ``records``' runs to ``out`` (``row(k)``: record ``k``'s line;
    ``note``: the line between a run's first and last); past ``MAX_LINES`` lines, a last note
    on the ``total - offset - shown`` records left out, and False.

    Runs are found left to right, so every run of a prefix of the records but its last is a
    run of them all: the runs of the first ``16 * MAX_LINES`` records fill the lines of an
    irregular layout; a regular one's (fewer lines) are then found over every record."""
    n = records.shape[0]
    prefix = min(n, 16 * MAX_LINES)
    while True:
        starts, counts, steps = runs(records[:prefix], fixed)
        lines: list[TableRow | str] = []
        for k, (s, c) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
            if prefix < n and k == starts.size - 1:
                break  # it may go on past the prefix
            part: list[TableRow | str] = []
            _run_lines(s, c, steps[k], row, note, part)
            if len(out) + len(lines) + len(part) > MAX_LINES:
                left = total - offset - s
                out.extend(lines)
                out.append(f"... {left:,} more {what} (layout.to_text(full=True) prints them all)")
                return False
            lines.extend(part)
        else:
            out.extend(lines)
            return True
        prefix = n


def _run_lines(
    start: int,
    counts: list[int],
    steps: np.ndarray,
    row: Callable[[int], TableRow | str],
    note: Callable[[int, np.ndarray, int], str],
    out: list[TableRow | str],
) -> None:
    """The lines of one run: its first part, a note (the step), its last part; parts of
    parts the same way."""
    while counts and counts[0] == 1:  # a level that merged nothing
        counts, steps = counts[1:], steps[1:]
    if not counts:
        out.append(row(start))
        return
    c, inner = counts[0], counts[1:]
    size = math.prod(inner)
    if c <= 3:  # no shorter with a note
        for j in range(c):
            _run_lines(start + j * size, inner, steps[1:], row, note, out)
        return
    _run_lines(start, inner, steps[1:], row, note, out)
    out.append(note(c - 2, steps[0], sum(1 for n in inner if n > 1)))
    _run_lines(start + (c - 1) * size, inner, steps[1:], row, note, out)


# -- drawing ----------------------------------------------------------------------------------


def _box_table(rows: Sequence[tuple[str, ...] | str]) -> list[str]:
    """A box table of ``rows`` (the first is the header); a ``str`` row spans every column."""
    cells = [r for r in rows if not isinstance(r, str)]
    widths = [max([len(r[i]) for r in cells]) for i in range(len(cells[0]))]
    inner = sum(widths) + 3 * (len(widths) - 1)
    wide = max([len(r) for r in rows if isinstance(r, str)], default=0)
    if wide > inner:  # a note wider than the columns: the first column takes the rest
        widths[0] += wide - inner
        inner = wide
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    line = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    out = [f"| {r:<{inner}} |" if isinstance(r, str) else line.format(*r) for r in rows]
    return [rule, out[0], rule, *out[1:], rule]


def render_plain(layout: ShardingLayout, *, full: bool = False) -> str:
    """The layout as plain text: title, grid or table, host lines (``full``: every block and
    host, however many)."""
    lines = [layout.title(), ""]
    g = grid(layout)
    if g is None:
        table = table_lines(layout, full=full)
        lines += _box_table(
            [("block", "devices", "hosts"), *(r if isinstance(r, str) else r[:3] for r in table)]
        )
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
    lines += ["", *footer(layout, full=full)]
    return "\n".join(line.rstrip() for line in lines)
