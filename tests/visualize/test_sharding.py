"""visualize_sharding and save_png (torchshard._visualize.sharding): the layout of a placed
tensor as its backend reports it (hosts from the current topology), the plain-text and rich
drawings of a layout, a PNG through matplotlib."""

from __future__ import annotations

import io
import re
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla.distributed.spmd as xs

import torchshard as ts
from torchshard.errors import MissingDependencyError
from torchshard.testing import host_to_global_array_per_host, virtual_hosts

MESH42 = np.arange(8).reshape(4, 2)


GRID_42 = """\
P('data', 'model') on Mesh({'data': 4, 'model': 2}): global shape (16, 8), 2 hosts

          0:4        4:8
      +----------+----------+
  0:4 | device 0 | device 1 |
      | host 0   | host 0   |
      +----------+----------+
  4:8 | device 2 | device 3 |
      | host 0   | host 0   |
      +----------+----------+
 8:12 | device 4 | device 5 |
      | host 1   | host 1   |
      +----------+----------+
12:16 | device 6 | device 7 |
      | host 1   | host 1   |
      +----------+----------+

host 0: devices 0-3, local block shape (8, 8)
host 1: devices 4-7, local block shape (8, 8)"""


def _xla_shards(t):
    """{device: ranges} as torch_xla reports them (its public XLAShardedTensor API)."""
    out = {}
    for s in xs.XLAShardedTensor(t).local_shards:
        device = int(s.shard_device.split(":")[1])
        if s.indices is Ellipsis:
            out[device] = tuple((0, n) for n in t.shape)
        else:
            out[device] = tuple(sl.indices(n)[:2] for sl, n in zip(s.indices, t.shape, strict=True))
    return out


def _ranges(layout):
    return {b.device: b.ranges for b in layout.blocks}


def test_plain_text_grid_2d():
    mesh = ts.Mesh(MESH42, ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P("data", "model"), (16, 8), num_hosts=2)
    assert str(layout) == GRID_42
    out = io.StringIO()
    assert ts.visualize_sharding(layout, file=out, use_rich=False) is layout
    assert out.getvalue() == GRID_42 + "\n"


def test_rich_grid_has_the_labels():
    mesh = ts.Mesh(MESH42, ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P("data"), (16, 8), num_hosts=2)
    out = io.StringIO()
    ts.visualize_sharding(layout, file=out, use_rich=True)
    text = out.getvalue()
    for label in ("devices 0,1", "devices 6,7", "host 0", "host 1", "12:16", "0:8", "┌"):
        assert label in text
    assert "host 1: devices 4-7, local block shape (8, 8)" in text


def test_without_rich_the_default_is_plain_text(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    mesh = ts.Mesh(MESH42, ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P("data", "model"), (16, 8), num_hosts=2)
    out = io.StringIO()
    ts.visualize_sharding(layout, file=out)
    assert out.getvalue() == GRID_42 + "\n"
    install = "pip install 'torchshard-input[pretty]'"
    with pytest.raises(MissingDependencyError, match=re.escape(install)):
        ts.visualize_sharding(layout, file=out, use_rich=True)


@pytest.mark.parametrize(
    ("spec", "shape"), [(ts.P("data", "model"), (16, 8)), (ts.P("data"), (8,)), (ts.P(), (2, 3, 4))]
)
def test_save_png_writes_a_png(tmp_path, spec, shape):
    mesh = ts.Mesh(MESH42, ("data", "model"))
    path = tmp_path / "layout.png"
    ts.describe_layout(mesh, spec, shape, num_hosts=2).save_png(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layout_under_virtual_hosts_uses_the_emulated_hosts(mesh42):
    blocks = [np.full((4, 8), h, np.float32) for h in range(4)]
    with virtual_hosts(4):
        described = ts.describe_layout(mesh42, ts.P("data"), (16, 8))
        assert described == ts.describe_layout(mesh42, ts.P("data"), (16, 8), num_hosts=4)
        g = host_to_global_array_per_host(blocks, partition=ts.P("data"))
        shown = ts.visualize_sharding(g, file=io.StringIO(), use_rich=False)
    assert _ranges(shown) == _ranges(described) == _xla_shards(g)
    assert [b.host for b in shown.blocks] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_unannotated_tensor_is_whole_on_every_device(mesh8):
    t = torch.zeros(4, 2).to("xla")
    layout = ts.visualize_sharding(t, file=io.StringIO(), use_rich=False)
    assert _ranges(layout) == {d: ((0, 4), (0, 2)) for d in range(8)}


def test_a_host_array_is_not_a_global_tensor(mesh8):
    for value, got in ((torch.zeros(3), "a tensor on cpu"), ([1, 2], "list")):
        with pytest.raises(
            TypeError,
            match=re.escape(
                "visualize_sharding: expected a global (XLA) tensor or a ShardingLayout, but got "
                f"{got}."
            ),
        ):
            ts.visualize_sharding(value, file=io.StringIO())


def test_rich_table_for_rank_3_lists_every_block():
    pytest.importorskip("rich")
    mesh = ts.Mesh(MESH42, ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P(None, None, ("data", "model")), (2, 3, 8), num_hosts=2)
    out = io.StringIO()
    assert ts.visualize_sharding(layout, file=out, use_rich=True) is layout
    text = out.getvalue()
    for d in range(8):
        assert f"[0:2, 0:3, {d}:{d + 1}]" in text
    for cell in ("block", "devices", "hosts", "host 1: devices 4-7, local block shape (2, 3, 4)"):
        assert cell in text


def test_visualize_prints_to_stdout_by_default(capsys):
    mesh = ts.Mesh(MESH42, ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P("data", "model"), (16, 8), num_hosts=2)
    ts.visualize_sharding(layout, use_rich=False)
    assert capsys.readouterr().out == GRID_42 + "\n"


def test_save_png_honours_dpi(tmp_path):
    pytest.importorskip("matplotlib")
    mesh = ts.Mesh(MESH42, ("data", "model"))
    layout = ts.describe_layout(mesh, ts.P("data", "model"), (16, 8), num_hosts=2)
    small, large = tmp_path / "small.png", tmp_path / "large.png"
    layout.save_png(str(small), dpi=40)
    layout.save_png(str(large), dpi=160)

    def size(path):  # width and height from the PNG header (IHDR)
        data = path.read_bytes()
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")

    (w1, h1), (w2, h2) = size(small), size(large)
    assert w2 == pytest.approx(4 * w1, rel=0.05) and h2 == pytest.approx(4 * h1, rel=0.05)
