"""``torchshard.data.sharded_stream``: a stream of shards read in batches, each shard's position
recorded, and a job saved on ``N`` hosts resumed on ``M`` with the unfinished shards split again.

The oracle is the set of example ids: every example of a pass exactly once, across the batches
taken before the save and those read after the resume (the padding rows of ``last_batch="pad"``
left out by the mask). An HF ``datasets`` stream's own shards (``IterableDataset.shard``) are
the second oracle where ``datasets`` is installed. On gloo processes: the example
``examples/resume_stream.py`` under torchrun, 2 processes saved and 1 resumed
(``tests/cross/test_examples.py``)."""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard.data import ShardedStream, sharded_stream
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


def _shards(sizes):
    """Shard ``s`` holds the ids ``1000 s + j``, ``j < sizes[s]``."""
    return {s: [1000 * s + j for j in range(n)] for s, n in enumerate(sizes)}


def _reader(data, log=None):
    def read(shard, start):
        if log is not None:
            log.append((shard, start))
        return iter(data[shard][start:])

    return read


def _sources(data, hosts, mesh, batch):
    out = []
    for h in range(hosts):
        with virtual_hosts(hosts, process_index=h), mesh:
            out.append(sharded_stream(list(data), _reader(data), ts.P("data"), batch_size=batch))
    return out


def _ids(batch_and_mask):
    batch, mask = batch_and_mask
    ids, keep = ts.replicate_to_local_data((batch, mask))
    return [int(i) for i in ids[keep].tolist()]


def test_one_feed_reads_its_shards_in_batches_across_their_ends():
    data = _shards([3, 2, 4])
    stream = ShardedStream(
        list(data), _reader(data), batch_size=4, feed=0, feeds=1, collate=torch.tensor
    )
    assert [b.tolist() for b in stream] == [
        [0, 1, 2, 1000],
        [1001, 2000, 2001, 2002],
        [2003],
    ]
    assert stream.state_dict()["positions"] == {"0": [3, True], "1": [2, True], "2": [4, True]}
    assert next(b.tolist() for b in stream) == [0, 1, 2, 1000]  # iter(): a new pass


def test_a_state_resumes_the_feed_where_each_shard_stopped():
    data = _shards([5, 5, 5, 5])
    log: list = []
    stream = ShardedStream(
        list(data), _reader(data, log), batch_size=3, feed=1, feeds=2, collate=torch.tensor
    )
    it = iter(stream)
    assert next(it).tolist() == [1000, 1001, 1002]
    state = pickle.loads(pickle.dumps(stream.state_dict()))
    assert state == {
        "feed": 1,
        "feeds": 2,
        "shards": ["1", "3"],
        "positions": {"1": [3, False], "3": [0, False]},
    }
    fresh = ShardedStream(
        list(data), _reader(data, log), batch_size=3, feed=1, feeds=2, collate=torch.tensor
    )
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == [[1003, 1004, 3000], [3001, 3002, 3003], [3004]]
    assert log[-2:] == [(1, 3), (3, 0)]  # the shard asked for from where it stopped
    with pytest.raises(ValueError, match=re.escape("saved by feed 1 of 2, but this stream")):
        ShardedStream(
            list(data), _reader(data), batch_size=3, feed=0, feeds=2, collate=torch.tensor
        ).load_state_dict(state)
    bad = {**state, "positions": {"1": [-1, False], "3": [0, False]}}
    with pytest.raises(ValueError, match=re.escape("expected [consumed >= 0, finished]")):
        fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match="names shard 9, which this stream does not have"):
        fresh.load_state_dict({**state, "positions": {"9": [0, False]}})


def test_the_job_position_splits_the_unfinished_shards_over_other_feeds():
    """2 feeds read 2 batches of 4 each; the parts merged, 3 feeds resume: the finished shards
    are skipped, the unfinished ones dealt again, each from where it stopped."""
    data = _shards([3, 6, 2, 5, 4])
    kw = {"batch_size": 4, "collate": list}
    old = [ShardedStream(list(data), _reader(data), feed=f, feeds=2, **kw) for f in range(2)]
    taken, parts = [], []
    for s in old:
        it = iter(s)
        taken += next(it) + next(it)
        parts.append(s.elastic_part(s.state_dict()))
    position = ShardedStream.merge_elastic_parts(parts)
    assert position == {
        "shards": 5,
        "positions": {
            "0": [3, True],
            "1": [6, True],
            "2": [2, True],
            "3": [2, False],
            "4": [3, False],
        },
    }
    new = [ShardedStream(list(data), _reader(data), feed=f, feeds=3, **kw) for f in range(3)]
    for s in new:
        s.load_elastic_state(json.loads(json.dumps(position)))
    assert [s.shards for s in new] == [[3], [4], []]  # feed 2: nothing left this pass
    rest = [i for s in new for b in s for i in b]
    every = taken + rest
    assert sorted(every) == sorted(i for ids in data.values() for i in ids)
    assert len(every) == len(set(every))  # each example once
    assert [list(s) for s in new][2] == [[2000, 2001]]  # then a new pass: shards[2::3]
    with pytest.raises(ValueError, match="leaves out shards"):
        new[0].load_elastic_state({"shards": 5, "positions": {"0": [3, True]}})
    with pytest.raises(ValueError, match="the position is over 4 shards, this stream has 5"):
        new[0].load_elastic_state({"shards": 4, "positions": {}})
    with pytest.raises(ValueError, match=re.escape("shard 1 is at [6, True] on one process")):
        ShardedStream.merge_elastic_parts([parts[1], {**parts[1], "positions": {"1": [1, False]}}])


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 4), (4, 1)])
def test_a_loader_saved_on_n_hosts_resumes_on_m_each_example_once(mesh8, old, new):
    """7 shards of uneven sizes over ``old`` virtual hosts (one feed each), ``last_batch="pad"``
    (the feeds end unevenly), global batches of 8; saved after 3, resumed on ``new`` hosts: the ids
    of the batches taken and of the rest, the padding masked off, are every id once."""
    data = _shards([5, 9, 3, 7, 1, 6, 8])
    with virtual_hosts(old), mesh8:
        loader = global_batch_loader_per_host(
            _sources(data, old, mesh8, 8 // old), partition=ts.P("data"), last_batch="pad"
        )
        it = iter(loader)
        taken = [i for _ in range(3) for i in _ids(next(it))]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        loader.close()
    job = json.loads(state["common"]["elastic"])
    assert job["kind"] == "torchshard.data._sharded_stream.ShardedStream"
    assert sum(p[0] for p in job["position"]["positions"].values()) == len(taken)
    with virtual_hosts(new), mesh8:
        resumed = global_batch_loader_per_host(
            _sources(data, new, mesh8, 8 // new), partition=ts.P("data"), last_batch="pad"
        )
        resumed.load_state_dict(state)
        rest = [i for b in resumed for i in _ids(b)]
        again = [i for b in resumed for i in _ids(b)]  # the next pass: every example
        resumed.close()
    every = taken + rest
    ids = sorted(i for v in data.values() for i in v)
    assert sorted(every) == ids and len(set(every)) == len(every)
    assert sorted(again) == ids


def test_tp_peers_read_one_feed(mesh8):
    """4 hosts on (dp=2, tp=4) with P("dp"): hosts 0, 1 hold dp row 0 (tp peers), 2, 3 row 1;
    the peers read the same shards."""
    data = _shards([4, 4, 4, 4, 4])
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    sources = []
    for h in range(4):
        with virtual_hosts(4, process_index=h), mesh:
            sources.append(sharded_stream(list(data), _reader(data), ts.P("dp"), batch_size=2))
    assert [(s.feed, s.num_feeds) for s in sources] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [s.shards for s in sources] == [[0, 2, 4], [0, 2, 4], [1, 3], [1, 3]]


def test_fewer_shards_than_feeds_names_the_fix(mesh8):
    with virtual_hosts(4, process_index=0), mesh8:
        with pytest.raises(ts.ShardingError, match=re.escape("1 shard(s) over 4 feeds")) as e:
            sharded_stream(["only.tar"], lambda s, start: iter(()), ts.P("data"), batch_size=2)
        assert "Split the stream into at least as many shards as feeds" in str(e.value)
        with pytest.raises(TypeError, match="shards must be JSON-able names"):
            sharded_stream([object()] * 4, lambda s, start: iter(()), batch_size=2)
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            sharded_stream(range(4), lambda s, start: iter(()), batch_size=0)


def test_an_hf_stream_resumed_on_another_feed_count_reads_what_hf_reads():
    """An HF ``IterableDataset`` of 6 shards (``from_generator`` over a list: HF's own shards),
    read through ``read = stream.shard(...).skip(start)``: 2 feeds take 2 batches each, 3 feeds
    resume from the merged position; every id of HF's own pass once."""
    datasets = pytest.importorskip("datasets", reason="needs datasets (HF)")

    def gen(shards):
        for s in shards:
            for j in range(s + 2):
                yield {"id": 100 * s + j}

    stream = datasets.IterableDataset.from_generator(gen, gen_kwargs={"shards": list(range(6))})
    assert stream.num_shards == 6
    own = [r["id"] for r in stream]  # HF's own pass

    def read(i, start):
        return stream.shard(num_shards=stream.num_shards, index=i).skip(start)

    def collate(rows):
        return [r["id"] for r in rows]

    def make(feed, feeds):
        return ShardedStream(range(6), read, batch_size=3, feed=feed, feeds=feeds, collate=collate)

    old = [make(f, 2) for f in range(2)]
    taken, parts = [], []
    for s in old:
        it = iter(s)
        taken += next(it) + next(it)
        parts.append(s.elastic_part(s.state_dict()))
    position = ShardedStream.merge_elastic_parts(parts)
    new = [make(f, 3) for f in range(3)]
    rest = []
    for s in new:
        s.load_elastic_state(position)
        rest += [i for b in s for i in b]
    assert sorted(taken + rest) == sorted(own) and len(taken + rest) == len(own)
    # A fresh pass of one feed is HF's own rows of its shards, in order.
    assert [i for b in make(1, 3) for i in b] == [i for i in own if i // 100 in (1, 4)]


def test_a_stream_is_the_source_of_a_loader_on_one_host(mesh8):
    data = _shards([3, 3, 3])
    with mesh8:
        stream = sharded_stream(list(data), _reader(data), ts.P("data"), batch_size=8)
        loader = ts.GlobalBatchLoader(stream, partition=ts.P("data"), last_batch="drop")
        batches = [ts.replicate_to_local_data(b).tolist() for b in loader]
    assert batches == [[0, 1, 2, 1000, 1001, 1002, 2000, 2001]]
    assert np.array_equal(stream.shards, [0, 1, 2])
