"""Property tests: random meshes (rank 1-3, permuted ids), specs, shapes, dtypes and 1, 2, 4 or
8 virtual hosts, checked against torch_xla's own placement and numpy slicing.

Oracle: the global array G is placed with torch_xla's ``mark_sharding``; the index map it
reports gives each host's segments (the distinct ranges its devices hold, per dimension), and so
the block ``G[segments]`` that host must pass. torchshard must then place every device's shard
exactly where torch_xla puts it, and read each host's block back bit for bit.
"""

import re

import numpy as np
import pytest
import torch
from helpers import (
    host_segments,
    layout_is_uniform,
    torch_xla_placement,
    xla_shards,
)
from hypothesis import HealthCheck, assume, event, given, settings
from strategies import SETTINGS, _bits_equal, _block, _values, even_cases, uneven_cases

import torchshard as ts
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)

pytestmark = pytest.mark.xla  # every test here runs on torch_xla


@SETTINGS
@given(case=even_cases())
def test_round_trip_matches_torch_xla_and_numpy(case):
    mesh, spec, shape, hosts, dtype, as_numpy, seed = case
    G = _values(dtype, shape, seed)
    xla = torch_xla_placement(G, mesh, spec)  # the oracle: torch_xla's own placement
    xla_map = {d: ranges for d, (ranges, _) in xla.items()}
    sharding = ts.NamedSharding(mesh, spec)
    index_map = sharding.devices_indices_map(shape)
    assert {d: tuple((s.start, s.stop) for s in sl) for d, sl in index_map.items()} == xla_map

    owner = [d // (8 // hosts) for d in range(8)]
    segments = host_segments(xla_map, owner, len(shape))
    blocks = [_block(G, segments[h]) for h in range(hosts)]
    if as_numpy:
        blocks = [b.numpy() for b in blocks]
    with virtual_hosts(hosts), mesh:
        uniform = layout_is_uniform(segments, len(shape))
        event(f"{hosts} hosts, {'uniform' if uniform else 'non-uniform'}")
        if not uniform:  # every host passes a block of host 0's shape; no global shape fits
            with pytest.raises(ts.errors.NonUniformShardingError, match="is not process-uniform"):
                host_to_global_array_per_host([blocks[0]] * hosts, partition=spec)
            return
        g = host_to_global_array_per_host(blocks, partition=spec)
        assert tuple(g.shape) == shape and g.dtype == dtype
        shards = xla_shards(g)
        back = global_to_host_array_per_host(g)
    assert sorted(shards) == list(range(8))
    for d, (ranges, data) in shards.items():
        assert ranges == xla_map[d], d
        assert _bits_equal(data, G[index_map[d]]), d
    for h in range(hosts):
        assert back[h].dtype == dtype
        assert _bits_equal(back[h], torch.as_tensor(blocks[h])), h


def _changed(block, index):
    """A copy of ``block`` (tensor or numpy) whose element at ``index`` differs."""
    out = block.clone() if isinstance(block, torch.Tensor) else block.copy()
    v = out[index]
    if out.dtype in (torch.bool, np.bool_):
        out[index] = not bool(v)
    elif out.dtype.is_floating_point if isinstance(out, torch.Tensor) else out.dtype.kind == "f":
        out[index] = -v - 1  # differs from v even where -v rounds back (v = 0 gives -1)
    else:
        out[index] = v ^ 1
    return out


@SETTINGS
@given(case=even_cases())
def test_hosts_that_share_a_block_must_pass_its_values(case):
    """Oracle: torch_xla's index map. Devices with the same ranges hold the same block; where
    hosts h1 < h2 own such devices, host h2's copy of the block's first element is changed:
    the call must raise naming host h2's tree, the pair and that element's global index. With
    the true blocks (the round-trip test) it must not raise."""
    mesh, spec, shape, hosts, dtype, as_numpy, seed = case
    G = _values(dtype, shape, seed)
    xla_map = {d: ranges for d, (ranges, _) in torch_xla_placement(G, mesh, spec).items()}
    owner = [d // (8 // hosts) for d in range(8)]
    segments = host_segments(xla_map, owner, len(shape))
    assume(layout_is_uniform(segments, len(shape)))
    owners_of: dict = {}
    for d, ranges in xla_map.items():
        owners_of.setdefault(ranges, set()).add(owner[d])
    shared = sorted((r, sorted(o)) for r, o in owners_of.items() if len(o) > 1)
    event("a block with several owners" if shared else "every block has one owner")
    assume(shared)
    ranges, owners = shared[0]
    first, host = owners[0], owners[-1]
    local = tuple(  # where the block's first element sits in host's block
        sum(b - a for a, b in segments[host][i] if b <= r[0]) for i, r in enumerate(ranges)
    )
    blocks = [_block(G, segments[h]) for h in range(hosts)]
    if as_numpy:
        blocks = [b.numpy() for b in blocks]
    blocks[host] = _changed(blocks[host], local)
    where = tuple(r[0] for r in ranges)
    with virtual_hosts(hosts), mesh:
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(f"per_host_arrays[{host}]: hosts {first} and {host} supply the same ")
            + ".*"
            + re.escape(f"at global index {where} host {first} has "),
        ):
            host_to_global_array_per_host(blocks, partition=spec)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=uneven_cases())
def test_uneven_shapes_are_refused_but_mapped_as_torch_xla_pads_them(case):
    mesh, spec, shape, dtype, seed = case
    G = _values(dtype, shape, seed)
    xla = torch_xla_placement(G, mesh, spec)
    index_map = ts.NamedSharding(mesh, spec).devices_indices_map(shape)
    for d, (ranges, data) in xla.items():
        assert tuple((s.start, s.stop) for s in index_map[d]) == ranges, d
        assert _bits_equal(data, G[index_map[d]]), d
    with mesh, pytest.raises(ts.errors.IndivisibleError, match="Pad the batch to a multiple"):
        ts.host_to_global_array(G, partition=spec)
