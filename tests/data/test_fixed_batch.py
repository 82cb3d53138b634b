"""``torchshard.data.fixed_global_batches``: elastic scale-down with a fixed global batch. A job
saved on ``N`` virtual hosts resumes on fewer (and more): every step keeps ``G`` real examples
(the mask's sum), the global batch's shape is unchanged where the shards divide ``G`` (else the
padding rows are masked off), and the epoch's examples come once each. Oracles: numpy's
permutation of the epoch cut into global batches of ``G``, and the set of ids."""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest

import torchshard as ts
from torchshard.data import FixedGlobalBatches, fixed_global_batches
from torchshard.testing import global_batch_loader_per_host, virtual_hosts

N = 100


def _sources(hosts, mesh, g, **kw):
    out = []
    for h in range(hosts):
        with virtual_hosts(hosts, process_index=h), mesh:
            out.append(fixed_global_batches(range(N), g, ts.P("data"), **kw))
    return out


def _steps(loader, count=None):
    """``(ids in global order, mask sum, global rows)`` of each step."""
    out = []
    it = iter(loader)
    for batch, mask in it if count is None else (next(it) for _ in range(count)):
        ids, keep = ts.replicate_to_local_data((batch, mask))
        out.append((ids[keep].tolist(), int(keep.sum()), int(ids.shape[0])))
    return out


def test_the_parts_of_a_global_batch_are_its_examples_in_order():
    """3 feeds of a global batch of 10: 4, 3, 3 examples, blocks padded to 4 rows."""
    parts = [
        FixedGlobalBatches(
            range(N),
            global_batch_size=10,
            feed=f,
            feeds=3,
            block=4,
            shuffle=True,
            seed=7,
            collate=list,
        )
        for f in range(3)
    ]
    assert [p.rows for p in parts] == [4, 3, 3]
    order = np.random.default_rng(7).permutation(N)  # the oracle: numpy's epoch order
    steps = list(zip(*parts, strict=True))
    assert len(steps) == N // 10
    for k, step in enumerate(steps):
        assert [i for part in step for i in part] == order[10 * k : 10 * k + 10].tolist()


@pytest.mark.parametrize(
    ("old", "new", "g", "rows"), [(4, 2, 16, 16), (4, 1, 16, 16), (2, 4, 12, 16), (4, 2, 12, 16)]
)
def test_a_job_resumed_on_another_host_count_keeps_its_global_batch(mesh8, old, new, g, rows):
    """Saved after 2 steps on ``old`` hosts, resumed on ``new``: every step ``g`` real examples
    of ``rows`` (16 = g where 8 shards divide g, else padded), the epoch's examples once."""
    with virtual_hosts(old), mesh8:
        loader = global_batch_loader_per_host(
            _sources(old, mesh8, g), partition=ts.P("data"), last_batch="pad"
        )
        taken = _steps(loader, 2)
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        loader.close()
    assert json.loads(state["common"]["elastic"])["position"]["step"] == 2
    with virtual_hosts(new), mesh8:
        resumed = global_batch_loader_per_host(
            _sources(new, mesh8, g), partition=ts.P("data"), last_batch="pad"
        )
        resumed.load_state_dict(state)
        rest = _steps(resumed)
        resumed.close()
    steps = taken + rest
    assert len(steps) == N // g
    assert {(real, shape) for _, real, shape in steps} == {(g, rows)}  # shapes unchanged
    order = np.random.default_rng(0).permutation(N)
    assert [ids for ids, _, _ in steps] == [
        order[k * g : (k + 1) * g].tolist() for k in range(N // g)
    ]  # the global batches of the epoch's order, whatever the layout


def test_the_state_is_checked_and_means_the_same_on_any_layout(mesh8):
    with virtual_hosts(2), mesh8:
        source = _sources(2, mesh8, 16)[1]
    assert (source.feed, source.num_feeds, source.batch_size, source.rows) == (1, 2, 8, 8)
    it = iter(source)
    next(it)
    assert source.state_dict() == {
        "epoch": 0,
        "step": 1,
        "global_batch_size": 16,
        "num_examples": N,
        "seed": 0,
        "shuffle": True,
    }
    other = FixedGlobalBatches(
        range(N), global_batch_size=8, feed=0, feeds=1, block=8, shuffle=True, seed=0, collate=list
    )
    with pytest.raises(ValueError, match=re.escape("saved with global_batch_size=16, but this")):
        other.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match="save every process's state after the same step"):
        FixedGlobalBatches.merge_elastic_parts([{"step": 1}, {"step": 2}])
    source.set_epoch(3)
    assert next(iter(source)).tolist() == np.random.default_rng(3).permutation(N)[8:16].tolist()


def test_bad_arguments_name_the_fix(mesh8):
    with virtual_hosts(4, process_index=0), mesh8:
        with pytest.raises(ts.ShardingError, match="global_batch_size 3 over 4 feeds"):
            fixed_global_batches(range(N), 3, ts.P("data"))
        with pytest.raises(ValueError, match="larger than the dataset's 100 examples"):
            fixed_global_batches(range(N), 101)
        with pytest.raises(TypeError, match="expected a map-style dataset"):
            fixed_global_batches(iter(range(4)), 2)
