"""The plain-text picture of a layout (torchshard._core.layout_text): grids and tables as they
print (golden texts), a pod's layout as the runs of its blocks and hosts (issue 28: its text
was a row per device), the runs themselves against their expansion (hypothesis), and long
lists of ids. The full-dict oracle of the table rows and host lines is
tests/core/test_blocks_properties.py's."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import torchshard as ts
from torchshard._core import layout_text
from torchshard._core.layout_text import compact, runs

MESH42 = np.arange(8).reshape(4, 2)


def _pod(devices=16384, per_host=4):
    return ts.Mesh(np.arange(devices).reshape(devices // per_host, per_host), ("data", "model"))


GRID_1D = """\
P('data',) on Mesh({'data': 4, 'model': 2}): global shape (8,), 4 hosts

    +-------------+
0:2 | devices 0,1 |
    | host 0      |
    +-------------+
2:4 | devices 2,3 |
    | host 1      |
    +-------------+
4:6 | devices 4,5 |
    | host 2      |
    +-------------+
6:8 | devices 6,7 |
    | host 3      |
    +-------------+

host 0: devices 0,1, local block shape (2,)
host 1: devices 2,3, local block shape (2,)
host 2: devices 4,5, local block shape (2,)
host 3: devices 6,7, local block shape (2,)"""

TABLE_3D = """\
P(None, None, ('data', 'model')) on Mesh({'data': 4, 'model': 2}): global shape (2, 3, 8), 1 host

+-----------------+---------+-------+
| block           | devices | hosts |
+-----------------+---------+-------+
| [0:2, 0:3, 0:1] | 0       | 0     |
| [0:2, 0:3, 1:2] | 1       | 0     |
| [0:2, 0:3, 2:3] | 2       | 0     |
| [0:2, 0:3, 3:4] | 3       | 0     |
| [0:2, 0:3, 4:5] | 4       | 0     |
| [0:2, 0:3, 5:6] | 5       | 0     |
| [0:2, 0:3, 6:7] | 6       | 0     |
| [0:2, 0:3, 7:8] | 7       | 0     |
+-----------------+---------+-------+

host 0: devices 0-7, local block shape (2, 3, 8)"""


def test_plain_text_grid_1d_and_table_for_rank_3():
    mesh = ts.Mesh(MESH42, ("data", "model"))
    assert str(ts.describe_layout(mesh, ts.P("data"), (8,), num_hosts=4)) == GRID_1D
    spec = ts.P(None, None, ("data", "model"))
    layout = ts.describe_layout(mesh, spec, (2, 3, 8), num_hosts=1)
    assert str(layout) == layout.to_text(full=True) == TABLE_3D  # small: whole either way


POD_FULL = """\
P(('data', 'model'),) on Mesh({'data': 4096, 'model': 4}): global shape (32768, 8), 4096 hosts

+---------------------------------+---------+-------+
| block                           | devices | hosts |
+---------------------------------+---------+-------+
| [0:2, 0:8]                      | 0       | 0     |
| ... 16,382 more blocks, each [+2, +0], devices +1 |
| [32766:32768, 0:8]              | 16383   | 4095  |
+---------------------------------+---------+-------+

host 0: devices 0-3, local block shape (8, 8)
... 4,094 more hosts, each devices +4
host 4095: devices 16380-16383, local block shape (8, 8)"""


def test_a_pods_full_batch_prints_as_its_runs():
    """16,384 devices of one block each and 4,096 hosts: 13 lines (the full text, one row per
    device and host, is 20,000 lines; the summary's rows are its rows)."""
    layout = ts.describe_layout(_pod(), ts.P(("data", "model")), (32768, 8), num_hosts=4096)
    assert str(layout) == POD_FULL
    full = layout.to_text(full=True).splitlines()
    assert len(full) == 2 + 4 + 16384 + 1 + 4096
    assert "| [32766:32768, 0:8] | 16383   | 4095  |" in full
    assert full[-1] == "host 4095: devices 16380-16383, local block shape (8, 8)"
    for line in POD_FULL.splitlines():
        if line.startswith("host "):
            assert line in full


POD_2D = """\
P('data', 'model') on Mesh({'data': 4096, 'model': 4}): global shape (8192, 8), 4096 hosts

+---------------------------------------------------+---------+-------+
| block                                             | devices | hosts |
+---------------------------------------------------+---------+-------+
| [0:2, 0:2]                                        | 0       | 0     |
| ... 2 more blocks, each [+0, +2], devices +1                        |
| [0:2, 6:8]                                        | 3       | 0     |
| ... 4,094 more groups like the one above, each [+2, +0], devices +4 |
| [8190:8192, 0:2]                                  | 16380   | 4095  |
| ... 2 more blocks, each [+0, +2], devices +1                        |
| [8190:8192, 6:8]                                  | 16383   | 4095  |
+---------------------------------------------------+---------+-------+

host 0: devices 0-3, local block shape (2, 8)
... 4,094 more hosts, each devices +4
host 4095: devices 16380-16383, local block shape (2, 8)"""

POD_REPLICATED = """\
P('model',) on Mesh({'data': 4096, 'model': 4}): global shape (8, 8), 4096 hosts

               0:8
    +-----------------------+
0:2 | devices 0,4,...,16380 |
    | hosts 0-4095          |
    +-----------------------+
2:4 | devices 1,5,...,16381 |
    | hosts 0-4095          |
    +-----------------------+
4:6 | devices 2,6,...,16382 |
    | hosts 0-4095          |
    +-----------------------+
6:8 | devices 3,7,...,16383 |
    | hosts 0-4095          |
    +-----------------------+

host 0: devices 0-3, local block shape (8, 8)
... 4,094 more hosts, each devices +4
host 4095: devices 16380-16383, local block shape (8, 8)"""


def test_runs_of_runs_and_replicas_of_a_pod():
    pod = _pod()
    assert str(ts.describe_layout(pod, ts.P("data", "model"), (8192, 8), num_hosts=4096)) == (
        POD_2D
    )
    assert str(ts.describe_layout(pod, ts.P("model"), (8, 8), num_hosts=4096)) == (POD_REPLICATED)


def test_an_uneven_pod_layout_shows_where_its_runs_break():
    text = str(ts.describe_layout(_pod(), ts.P(("data", "model")), (32773, 8), num_hosts=4096))
    assert text.splitlines()[5:11] == [
        "| [0:3, 0:8]              | 0           | 0         |",
        "| ... 10,922 more blocks, each [+3, +0], devices +1 |",
        "| [32769:32772, 0:8]      | 10923       | 2730      |",
        "| [32772:32773, 0:8]      | 10924       | 2731      |",
        "| [32773:32773, 0:8]      | 10925-16383 | 2731-4095 |",
        "+-------------------------+-------------+-----------+",
    ]
    assert text.splitlines()[-8:-2] == [
        "host 0: devices 0-3, local block shape (12, 8)",
        "... 2,729 more hosts, each devices +4",
        "host 2730: devices 10920-10923, local block shape (12, 8)",
        "host 2731: devices 10924-10927, local block shape (1, 8)",
        "host 2732: devices 10928-10931, local block shape (0, 8)",
        "... 1,362 more hosts, each devices +4",
    ]
    assert "note: dim 0 (32773) splits unevenly, into blocks of sizes [0, 1, 3]" in text


def test_a_layout_without_runs_prints_its_first_blocks_and_how_many_it_left_out():
    ids = np.random.default_rng(0).permutation(4096)
    mesh = ts.Mesh(ids.reshape(1024, 4), ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P(("data", "model")), (4096,), num_hosts=1024)
    lines = layout.to_text().splitlines()
    assert lines[0].startswith(
        "P(('data', 'model'),) on Mesh({'data': 1024, 'model': 4}, devices=["
        f"{', '.join(str(d) for d in ids[:8])}, ..., {ids[-2]}, {ids[-1]}] (4,096 ids))"
    )
    table = [line for line in lines if line.startswith("| [")]
    shown = len(table)
    assert 0 < shown <= layout_text.MAX_LINES
    host = str(ids[0] // 4)
    assert [c.strip() for c in table[0].split("|")[1:4]] == ["[0:1]", str(ids[0]), host]
    more = re.search(
        r"\| \.\.\. ([\d,]+) more blocks \(layout\.to_text\(full=True\)", "\n".join(lines)
    )
    assert more and int(more.group(1).replace(",", "")) + shown == 4096  # nothing unaccounted
    every = layout_text.table_lines(layout, full=True)
    assert len(every) == 4096
    shown_rows = [r for r in layout_text.table_lines(layout) if not isinstance(r, str)]
    assert shown_rows == every[:shown]  # the first rows of the full table


def test_full_prints_every_block_and_host_of_a_layout_past_the_limit(monkeypatch):
    monkeypatch.setattr(layout_text, "MAX_LINES", 3)
    mesh = ts.Mesh(MESH42, ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P(None, None, ("data", "model")), (2, 3, 8), num_hosts=4)
    assert layout.to_text().splitlines()[5:8] == [
        "| [0:2, 0:3, 0:1]                | 0       | 0     |",
        "| ... 6 more blocks, each [+0, +0, +1], devices +1 |",
        "| [0:2, 0:3, 7:8]                | 7       | 3     |",
    ]
    assert layout.to_text().splitlines()[-3:] == [
        "host 0: devices 0,1, local block shape (2, 3, 2)",
        "... 2 more hosts, each devices +2",
        "host 3: devices 6,7, local block shape (2, 3, 2)",
    ]
    assert layout.to_text(full=True).count("local block shape") == 4


# -- the runs ----------------------------------------------------------------------------------


@st.composite
def nested_progressions(draw):
    """Records made of nested arithmetic progressions (a layout's pattern), some of them
    broken by random records, with a random fixed column."""
    width = draw(st.integers(1, 4))
    vec = st.lists(st.integers(-5, 5), min_size=width, max_size=width)
    out = []
    for _ in range(draw(st.integers(1, 4))):
        base = np.asarray(draw(vec))
        counts = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
        steps = [np.asarray(draw(vec)) for _ in counts]
        for index in np.ndindex(*counts):
            out.append(base + sum(i * s for i, s in zip(index, steps, strict=True)))
        if draw(st.booleans()):
            out.append(np.asarray(draw(vec)))
    fixed = np.asarray(draw(st.lists(st.booleans(), min_size=width, max_size=width)))
    return np.asarray(out, dtype=np.int64), fixed


@settings(max_examples=300, deadline=None)
@given(case=nested_progressions())
def test_the_runs_expand_to_the_records(case):
    """Every record, in order, is its run's first plus its index times the steps (outer to
    inner); a run's steps leave the fixed columns alone."""
    records, fixed = case
    starts, counts, steps = runs(records, fixed)
    expanded = []
    for s, c, d in zip(starts.tolist(), counts, steps, strict=True):
        assert not d[:, fixed].any()
        for index in np.ndindex(*c.tolist()):
            expanded.append(records[s] + np.asarray(index) @ d)
    np.testing.assert_array_equal(np.asarray(expanded).reshape(records.shape), records)
    assert starts[0] == 0 and starts.tolist() == sorted(starts.tolist())


def test_a_pattern_of_runs_is_one_run_of_runs():
    rows = [(r * 2, c * 2, 4 * r + c) for r in range(100) for c in range(4)]
    starts, counts, steps = runs(np.asarray(rows), np.zeros(3, dtype=bool))
    assert starts.tolist() == [0]
    assert counts.tolist() == [[100, 4]]
    assert steps.tolist() == [[[2, 0, 4], [0, 2, 1]]]


# -- lists of ids -------------------------------------------------------------------------------


def test_long_lists_print_their_ranges_and_progressions():
    assert compact(range(0, 16384, 4)) == "0,4,...,16380"
    assert compact(range(4096)) == "0-4095"
    assert compact([*range(0, 40, 2), 41, 42, 43, 50, 60]) == "0,2,...,38,41-43,50,60"
    assert compact([0, 2, 4, 6]) == "0,2,4,6"  # short lists as before (the docs' grids)
    assert compact([1, 5, 9, 13, 17, 18, 30]) == "1,5,9,13,17,18,30"
