"""Property: logical -> physical (per feed, host side) -> host_to_global (virtual hosts) ->
physical_to_logical (in step) returns exactly the logical batch, in logical order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchshard as ts
from torchshard.testing import host_to_global_array_per_host, virtual_hosts

pytestmark = pytest.mark.xla  # every test here runs on torch_xla

MESHES = {(8,): ("data",), (4, 2): ("data", "model"), (2, 2, 2): ("data", "fsdp", "model")}
DTYPES = [np.float32, np.int32, np.bool_, np.uint8]


def _concat(trees):
    """One host's block when it runs several feeds: their batches concatenated along dim 0."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: _concat([t[k] for t in trees]) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.cat(trees)
    return np.concatenate(trees)


@st.composite
def cases(draw):
    num_hosts = draw(st.sampled_from([1, 2, 4, 8]))
    feeds_per_host = draw(st.sampled_from([1, 1, 2]))
    feeds = num_hosts * feeds_per_host
    num_logical = draw(st.integers(1, feeds))
    logical_feeds = draw(st.permutations(range(feeds)))[:num_logical]
    feed_logical = draw(st.integers(1, 4))
    explicit = draw(st.sampled_from([None, 0, 1]))
    physical = None
    if explicit is not None:
        step = math.lcm(8, feeds)
        physical = (-(-feed_logical * feeds // step) + explicit) * step
    return {
        "num_hosts": num_hosts,
        "feeds": feeds,
        "logical_feeds": tuple(logical_feeds),
        "feed_logical": feed_logical,
        "physical": physical,
        "mesh_shape": draw(st.sampled_from(sorted(MESHES))),
        "width": draw(st.integers(1, 3)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "torch_leaves": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_logical_physical_global_logical_round_trip(case):
    fl, feeds = case["feed_logical"], case["feeds"]
    logical = fl * len(case["logical_feeds"])
    rng = np.random.default_rng(case["seed"])
    index = np.arange(logical, dtype=np.int64)
    feature = (rng.integers(0, 100, (logical, case["width"]))).astype(case["dtype"])

    physical_batches, dispatcher = [], None
    for f in range(feeds):
        dispatcher = ts.InputDispatcher(
            logical,
            global_physical_batch_size=case["physical"],
            num_physical_feeds=feeds,
            physical_feed_index=f,
            logical_feed_indices=case["logical_feeds"],
        )
        assert dispatcher.global_physical_batch_size % 8 == 0
        shard = dispatcher.feed_read_config()["shard_index"]
        rows = slice(shard * fl, (shard + 1) * fl)
        batch = {"index": index[rows], "nested": {"feature": feature[rows]}}
        if case["torch_leaves"]:
            batch["nested"]["feature"] = torch.from_numpy(feature[rows].copy())
        physical_batches.append(dispatcher.logical_to_physical_batch(batch))

    hosts = case["num_hosts"]
    per_host = feeds // hosts
    blocks = [_concat(physical_batches[h * per_host : (h + 1) * per_host]) for h in range(hosts)]
    shape = case["mesh_shape"]
    mesh = ts.Mesh(np.arange(8).reshape(shape), MESHES[shape])
    with mesh, virtual_hosts(hosts):
        global_batch = host_to_global_array_per_host(blocks, partition=dispatcher.partition_spec)
        out = dispatcher.physical_to_logical_batch(global_batch)
        back = ts.replicate_to_local_data(out)
    assert list(back) == ["index", "nested"]
    assert back["index"].tolist() == index.tolist()
    assert torch.equal(back["nested"]["feature"], torch.from_numpy(feature))
