"""The torch_xla backend's transfer for a loader thread (``make_global(..., background=True)``):
the GIL-free ``_xla_tensors_from_aten`` route for dim 0 split over every device and for
replication, the GIL-holding ``_global_tensor_from_cpu_shards`` for everything else, and the
same placement, bit for bit, as torch_xla's own ``mark_sharding`` either way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
from data_helpers import Rows
from helpers import DTYPES, host_segments, layout_is_uniform, torch_xla_placement, xla_shards
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import (
    SETTINGS,
    _bits_equal,
    _block,
    _values,
    even_cases,
    meshes,
)

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard._backend.xla import backend as backend_xla
from torchshard._backend.xla.backend import _stacked
from torchshard._mesh.context import current_topology
from torchshard._place.call import read
from torchshard._place.place import to_global
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


def assemble_per_host(blocks, *, partition, background):
    """The engine as the per-host loader's thread calls it (``background``)."""
    mesh = ts.current_mesh()
    backend, topology = lookup(mesh), current_topology(mesh)
    call = read(blocks, topology, partition, per_host=True)
    return to_global(mesh, backend, topology, call, background=background)


def _index(ranges):
    return tuple(slice(a, b) for a, b in ranges)


@pytest.fixture
def routes(monkeypatch):
    """Counts the transfers by route: "gil-free" (_xla_tensors_from_aten) or "direct"; every
    size qualifies for the GIL-free route (the tests use small arrays)."""
    monkeypatch.setattr(backend_xla, "GIL_FREE_MIN_BYTES", 0)
    seen = {"gil-free": 0, "direct": 0}
    gil_free, direct = backend_xla._tensors_from_aten, backend_xla.global_tensor_from_cpu_shards

    def count_gil_free(*args):
        seen["gil-free"] += 1
        return gil_free(*args)

    def count_direct(*args):
        seen["direct"] += 1
        return direct(*args)

    monkeypatch.setattr(backend_xla, "_tensors_from_aten", count_gil_free)
    monkeypatch.setattr(backend_xla, "global_tensor_from_cpu_shards", count_direct)
    return seen


def _gil_free_layout(mesh, spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    if not any(e is not None for e in entries):
        return True  # replicated (scalars included)
    first = entries[0]
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    return int(np.prod([mesh.shape[a] for a in axes])) == 8 and all(e is None for e in entries[1:])


@st.composite
def split_over_every_device(draw):
    """The loader's usual layout: dim 0 over every mesh axis, in any order (a permuted mesh,
    1-3 dims, 1-8 hosts)."""
    mesh = draw(meshes())
    axes = tuple(draw(st.permutations(mesh.axis_names)))
    ndim = draw(st.integers(1, 3))
    spec = ts.P(axes[0] if len(axes) == 1 and draw(st.booleans()) else axes)
    shape = (8 * draw(st.integers(1, 3)), *(draw(st.integers(1, 3)) for _ in range(ndim - 1)))
    hosts = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    as_numpy = dtype != torch.bfloat16 and draw(st.booleans())
    return mesh, spec, shape, hosts, dtype, as_numpy, draw(st.integers(0, 2**31))


@SETTINGS
@given(case=st.one_of(even_cases(), split_over_every_device()))
def test_background_transfer_places_every_shard_as_torch_xla_does(case, routes):
    mesh, spec, shape, hosts, dtype, as_numpy, seed = case
    G = _values(dtype, shape, seed)
    xla_map = {d: r for d, (r, _) in torch_xla_placement(G, mesh, spec).items()}
    owner = [d // (8 // hosts) for d in range(8)]
    segments = host_segments(xla_map, owner, len(shape))
    if not layout_is_uniform(segments, len(shape)):
        return
    blocks = [_block(G, segments[h]) for h in range(hosts)]
    if as_numpy:
        blocks = [b.numpy() for b in blocks]
    before = dict(routes)
    with virtual_hosts(hosts), mesh:
        g = assemble_per_host(blocks, partition=spec, background=True)
        fg = ts.testing.host_to_global_array_per_host(blocks, partition=spec)
    assert tuple(g.shape) == shape and g.dtype == dtype
    assert torch_xla._XLAC._get_xla_sharding_spec(g) == torch_xla._XLAC._get_xla_sharding_spec(fg)
    shards = xla_shards(g)
    assert sorted(shards) == list(range(8))
    for d, (ranges, data) in shards.items():  # each device holds exactly its shard
        assert ranges == xla_map[d], d  # where mark_sharding puts it
        assert _bits_equal(data, G[_index(ranges)]), d  # the values torch_xla says it holds
    gil_free = _gil_free_layout(mesh, spec, len(shape))
    kind = "direct" if not gil_free else "replicated" if not any(tuple(spec)) else "dim 0 over all"
    event(f"{hosts} hosts, {kind}")
    assert routes["gil-free"] - before["gil-free"] == int(gil_free)
    assert routes["direct"] - before["direct"] == 1 + int(not gil_free)  # + the foreground call


def test_foreground_transfer_keeps_the_direct_call(mesh8, routes):
    ts.host_to_global_array(
        {"x": np.zeros((8, 2)), "s": np.float32(1)}, partition={"x": ts.P("data"), "s": ts.P()}
    )
    assert routes == {"gil-free": 0, "direct": 2}


def test_small_leaves_keep_the_direct_call_in_the_background(mesh8, routes, monkeypatch):
    monkeypatch.setattr(backend_xla, "GIL_FREE_MIN_BYTES", 8 * 64 * 4)
    batch = {"big": np.zeros((8, 64), np.float32), "small": np.zeros((8, 63), np.float32)}
    (out,) = ts.GlobalBatchLoader([batch])
    assert routes == {"gil-free": 1, "direct": 1}
    assert torch.equal(ts.global_to_host_array(out)["small"], torch.zeros(8, 63))


def test_stacked_shards_are_a_view_when_they_lie_in_order():
    block = torch.arange(24.0).reshape(8, 3)
    parts = list(block.tensor_split(4))
    view = _stacked(parts)
    assert view.data_ptr() == block.data_ptr() and torch.equal(view, block)
    shuffled = [parts[i] for i in (2, 0, 3, 1)]
    copy = _stacked(shuffled)
    assert copy.data_ptr() != block.data_ptr()
    assert torch.equal(copy, torch.cat(shuffled))
    columns = list(block.tensor_split(3, dim=1))  # not contiguous: copied
    assert torch.equal(_stacked(columns), torch.cat(columns))


def test_permuted_mesh_background_transfer(routes):
    ids = np.array([3, 1, 7, 5, 0, 2, 6, 4])
    x = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    for mesh in (ts.Mesh(ids, ("data",)), ts.Mesh(ids.reshape(4, 2), ("data", "model"))):
        with mesh:
            g = ts.GlobalBatchLoader([{"x": x}], partition=ts.P(mesh.axis_names))
            (batch,) = list(g)
            assert torch.equal(ts.global_to_host_array(batch)["x"], x)
            placed = torch_xla_placement(x, mesh, ts.P(mesh.axis_names))  # mark_sharding's
            shards = xla_shards(batch["x"])
            assert sorted(shards) == list(range(8))
            for d, (ranges, data) in shards.items():
                assert ranges == placed[d][0], d
                assert torch.equal(data, x[_index(ranges)]), d
    assert routes == {"gil-free": 2, "direct": 0}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_loader_transfers_in_the_background_only_on_its_thread(mesh42, routes, prefetch):
    source = torch.utils.data.DataLoader(Rows(32), batch_size=8)
    ids = [
        i for b in ts.GlobalBatchLoader(source, prefetch=prefetch) for i in b["id"].cpu().tolist()
    ]
    assert ids == list(range(32))
    if prefetch:
        assert routes == {"gil-free": 8, "direct": 0}
    else:  # no thread: the transfer runs inside next(), the direct call is the fastest
        assert routes == {"gil-free": 0, "direct": 8}
    with virtual_hosts(2):
        sources = [[{"id": np.arange(4) + 4 * h}] for h in range(2)]
        (batch,) = global_batch_loader_per_host(sources, prefetch=prefetch)
        assert ts.replicate_to_local_data(batch["id"]).tolist() == list(range(8))


# -- leaves of rank 6 or more: torch_xla builds a corrupt tile assignment for them --


@pytest.mark.parametrize("rank", [6, 7, 8])
@pytest.mark.parametrize("shape", [(8,), (4, 2)], ids=["mesh8", "mesh42"])
def test_a_sharded_leaf_of_rank_6_or_more_is_refused(shape, rank):
    """Placed with every tile on device 0 before (and read back: a segfault), now refused
    before torch_xla is reached; replicated, the same leaf is placed and read back exactly."""
    mesh = ts.Mesh(np.arange(8).reshape(shape), ("data", "model")[: len(shape)])
    x = np.arange(8 * 2 ** (rank - 1), dtype=np.float32).reshape((8,) + (2,) * (rank - 1))
    with mesh:
        with pytest.raises(
            ts.errors.ShardingError,
            match=re.escape(
                f"host_arrays['x']: torch_xla shards arrays of rank up to 5, but this one has "
                f"rank {rank} and is split over mesh axes ['data'] (torch_xla 2.9 would place "
                "every tile on device 0, and reading it back crashes the process). Reshape it "
                "to rank 5 or less on the host (e.g. merge trailing dimensions with "
                "x.reshape(x.shape[0], -1)), or replicate it (P())."
            ),
        ):
            ts.host_to_global_array({"x": x}, partition=ts.P("data"))
        g = ts.host_to_global_array({"x": x}, partition=ts.P())
        np.testing.assert_array_equal(ts.global_to_host_array(g)["x"].numpy(), x)
        x5 = x.reshape(8, 2, 2, 2, -1)  # the fix the message names
        g = ts.host_to_global_array(x5, partition=ts.P("data"))
        np.testing.assert_array_equal(ts.global_to_host_array(g).numpy(), x5)


@pytest.mark.parametrize(
    ("how", "path"),
    [("loader", "batch['x']"), ("pad", "batch['x']"), ("per-host", "host_batches[0]['x']")],
)
def test_a_rank_6_leaf_through_a_loader_is_refused_naming_the_batch(how, path):
    """The refusal reaches the loader's user with its message, naming the leaf as the
    loader's batch (before: ``host_arrays['x']``, an argument the user never passed, or
    ``host_arrays[0]['x']`` under ``last_batch="pad"``)."""
    mesh = ts.Mesh(np.arange(8), ("data",))
    source = [{"x": np.zeros((8, 1, 1, 1, 1, 2), np.float32), "y": np.zeros(8, np.int64)}]
    message = (
        f"{path}: torch_xla shards arrays of rank up to 5, but this one has rank 6 and is split "
        "over mesh axes ['data']"
    )
    with mesh:
        if how == "per-host":
            with virtual_hosts(2):
                halves = [[{k: v[4 * h : 4 * h + 4] for k, v in source[0].items()}] for h in (0, 1)]
                loader = global_batch_loader_per_host(halves, partition=ts.P("data"))
                with pytest.raises(ts.errors.ShardingError, match=re.escape(message)) as info:
                    next(iter(loader))
        else:
            loader = ts.GlobalBatchLoader(
                source, partition=ts.P("data"), last_batch="pad" if how == "pad" else "error"
            )
            with pytest.raises(ts.errors.ShardingError, match=re.escape(message)) as info:
                next(iter(loader))
        loader.close()
    assert any("at batch 0" in note for note in info.value.__notes__)  # where it was raised


def test_torch_xla_still_corrupts_a_rank_6_tile_assignment():
    """The upstream behaviour the refusal above works around (torch_xla 2.9.0,
    xla_sharding_util.cpp: "tile_assignment ranks > 5"): the sharding built for a rank-6
    leaf split over 8 devices names device 0 for every tile. When this fails, torch_xla
    builds it correctly and ``backend_xla.MAX_SHARDED_RANK`` can go. (Nothing is read back:
    that is the segfault.)"""
    mesh = ts.Mesh(np.arange(8), ("data",))
    shape = (8, 1, 1, 1, 1, 1)
    spec = backend_xla._sharding_spec(mesh, (("data",),) + ((),) * 5, shape, torch.float32)
    (t,) = backend_xla._tensors_from_aten([torch.zeros(shape)], [spec])
    assert backend_xla._sharding_spec_text(t) == "{devices=[8,1,1,1,1,1]0,0,0,0,0,0,0,0}"
    spec5 = backend_xla._sharding_spec(mesh, (("data",),) + ((),) * 4, shape[:5], torch.float32)
    (t5,) = backend_xla._tensors_from_aten([torch.zeros(shape[:5])], [spec5])
    assert backend_xla._sharding_spec_text(t5) == "{devices=[8,1,1,1,1]0,1,2,3,4,5,6,7}"


_FAKE_COPY = """
import numpy as np, torch
import torchshard as ts
ts.setup_cpu_emulation(8)
from torch._subclasses.fake_tensor import FakeTensorMode
from torchshard._backend.xla import backend as backend_xla
with FakeTensorMode():
    fake = torch.zeros(8, 2)
assert fake.device.type == "cpu"  # it says it is host data ...
spec = backend_xla._sharding_spec(ts.Mesh(np.arange(8), ("data",)), (("data",), ()), (8, 2),
                                  torch.float32)
backend_xla._tensors_from_aten([fake], [spec])  # ... and torch_xla reads its memory
print("copied")
"""


def test_torch_xla_still_crashes_copying_a_fake_tensor(tmp_path):
    """The upstream behaviour the FakeTensor refusal (``_place.host_data``) works around
    (torch 2.9 + torch_xla 2.9.0): a FakeTensor reports device ``cpu`` but has no memory, and
    torch_xla's host-to-device copy reads it: SIGSEGV. When this fails (torch_xla refuses it,
    or copies zeros), the crash is gone; keep refusing anyway (a FakeTensor has no values)."""
    script = tmp_path / "fake_copy.py"
    script.write_text(_FAKE_COPY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == -11, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "copied" not in done.stdout
