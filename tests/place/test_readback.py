"""Reading global tensors back (torchshard._place.readback): global_to_host_array reads each
host's block from the local shards, without compiling or gathering; replicate_to_local_data
gathers only when blocks are missing; padded step outputs, unsharded tensors, non-grid layouts."""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
import torch_xla.distributed.spmd as xs
from bit_patterns import bits, differing, odd_values
from helpers import to_numpy, xla_shards

import torchshard as ts
from torchshard._backend.registry import lookup
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)


def _check_shards(g, expected, mesh, spec):
    """Each device holds the numpy slice devices_indices_map names; torch_xla agrees."""
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(tuple(expected.shape))
    shards = xla_shards(g)
    assert sorted(shards) == list(range(8))
    for d, (ranges, data) in shards.items():
        assert ranges == tuple((s.start, s.stop) for s in index_map[d])
        np.testing.assert_array_equal(
            to_numpy(data), to_numpy(torch.as_tensor(expected))[index_map[d]]
        )


def test_global_to_host_array_reads_local_shards_without_compiling(mesh42, monkeypatch):
    import torch_xla.debug.metrics as met

    g = ts.host_to_global_array({"x": np.arange(16).reshape(8, 2)}, partition=ts.P("data"))
    backend = lookup(ts.current_mesh())

    def no_gather(x):
        raise AssertionError("global_to_host_array must not gather")

    monkeypatch.setattr(backend.read, "gather", no_gather)
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: no_gather(self))
    before = met.metric_data("CompileTime")
    back = ts.global_to_host_array(g)
    full = ts.replicate_to_local_data(g)  # one host holds everything: no gather either
    assert met.metric_data("CompileTime") == before
    monkeypatch.undo()
    assert back["x"].tolist() == np.arange(16).reshape(8, 2).tolist()
    assert full["x"].tolist() == back["x"].tolist()


def test_step_outputs_with_padded_shards_read_back(mesh42):
    # torch_xla pads uneven shards; reading back crops the padding.
    x = torch.arange(30).reshape(10, 3)
    t = x.to(torch_xla.device())
    xs.mark_sharding(t, ts.current_mesh().xla_mesh, ("data", "model"))
    back = ts.global_to_host_array({"t": t, "y": t * 2})
    assert torch.equal(back["t"], x) and torch.equal(back["y"], x * 2)
    assert torch.equal(ts.replicate_to_local_data(t), x)


def test_unsharded_xla_tensors_read_back(mesh42):
    t = torch.arange(5, device=torch_xla.device())
    assert ts.global_to_host_array(t).tolist() == list(range(5))


def test_replicate_to_local_data_falls_back_to_gather_when_blocks_are_missing(mesh42, monkeypatch):
    g = ts.host_to_global_array({"x": np.arange(8)})
    backend = lookup(ts.current_mesh())
    real = backend.read.local_shards
    monkeypatch.setattr(backend.read, "local_shards", lambda ts_: [s[:4] for s in real(ts_)])
    gathered = []
    monkeypatch.setattr(backend.read, "gather", lambda x: gathered.append(x) or x.cpu())
    assert ts.replicate_to_local_data(g)["x"].tolist() == list(range(8))
    assert len(gathered) == 1


def test_read_back_needs_global_tensors(mesh42):
    for fn, name in ((ts.global_to_host_array, "global_arrays"), (ts.replicate_to_local_data, "x")):
        with pytest.raises(
            TypeError,
            match=re.escape(
                f"{name}['a'][1]: expected a global tensor of the xla backend (e.g. from "
                "host_to_global_array), but got ndarray."
            ),
        ):
            fn({"a": [torch.zeros(1, device=torch_xla.device()), np.zeros(3)]})
        with pytest.raises(TypeError, match=re.escape("but got Tensor on cpu.")):
            fn({"a": [torch.zeros(1, device=torch_xla.device()), torch.zeros(3)]})


def test_non_grid_layout_in_the_emulation_and_on_a_real_run(monkeypatch):
    """A host whose two devices hold rows 0:2 x cols 0:3 and rows 2:4 x cols 3:6 has the block
    rows 0:4 x cols 0:6, half of it on host 1's devices (conformance case hl005)."""
    mesh = ts.Mesh(np.array([0, 2, 3, 1, 4, 6, 7, 5]).reshape(4, 2), ("x", "y"))
    G = np.arange(48).reshape(8, 6)
    per = [G[0:4], G[0:4], G[4:8], G[4:8]]
    with virtual_hosts(4), mesh:
        g = host_to_global_array_per_host(per, partition=ts.P("x", "y"))
        _check_shards(g, G, mesh, ts.P("x", "y"))
        for h, block in enumerate(global_to_host_array_per_host(g)):
            np.testing.assert_array_equal(block.numpy(), per[h])
        # On a real multi-host run only the process's own devices are addressable.
        backend = lookup(mesh)
        real = backend.read.local_shards
        monkeypatch.setattr(
            backend.read,
            "local_shards",
            lambda t: [[s for s in x if s.device in (0, 1)] for x in real(t)],
        )
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "global_arrays['g']: host 0's block spans the ranges [[(0, 2), (2, 4)], [(0, 3), "
                "(3, 6)]] (one list per dimension), but this process can read only 12 of its 24 "
                "elements: the layout is not a grid per host (the host's devices do not hold the "
                "whole cross product of their slices; other hosts' devices hold the rest). Read "
                "the whole value with replicate_to_local_data, or use a mesh whose device order "
                "follows host boundaries (e.g. create_device_mesh with a HybridMeshShape)."
            ),
        ):
            ts.global_to_host_array({"g": g})


@pytest.mark.parametrize("spec", [ts.P("data"), ts.P(), ts.P("data", "model")])
def test_float16_nan_payloads_read_back_bit_exact(mesh42, spec):
    """torch_xla 2.9 copies a sharded float16 tensor's shards to the host with NaN payloads
    rewritten (0x7C01 -> 0x7E00); torchshard reads them through their int16 bits."""
    x = odd_values(torch.float16, 32).reshape(8, 4)
    back = ts.global_to_host_array(ts.host_to_global_array(x, partition=spec))
    assert back.dtype == torch.float16
    assert torch.equal(bits(back), bits(x)), differing(back, x)
