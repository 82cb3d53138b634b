"""grain (torchshard.integrations.grain) as a GlobalBatchLoader source, grain 0.2.18 itself the
oracle: ``shard_options`` is the feed (tp peers read grain's same records), grain's
``MapDataset``, ``IterDataset`` and ``DataLoader`` feed the loader on virtual hosts with the
batches grain's own iterators give each feed, their state travels inside the loader's snapshot
(grain's own checkpoint helper, ``assert_equal_output_after_checkpoint``, passes through the
loader), and an ``ElasticIterator`` resumed by the loader on another number of hosts reads what
grain's own ``ElasticIterator`` resumed from the same global index reads. On gloo processes:
``tests/integrations/test_grain.py::test_gloo_*`` (4 processes saved, 2 resumed through
torch.distributed.checkpoint). Skips without grain."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from torchshard._core.version import pip_install

grain = pytest.importorskip("grain", reason=f"needs grain: {pip_install('grain')}")
import _grain_cases  # noqa: E402 -- the workers import it; here it must import too
from grain._src.python.testing.experimental import (  # noqa: E402
    assert_equal_output_after_checkpoint,
)

import torchshard as ts  # noqa: E402
from torchshard.integrations.grain import elastic_iterator, shard_options  # noqa: E402
from torchshard.testing import (  # noqa: E402
    global_batch_loader_per_host,
    global_to_host_array_per_host,
    virtual_hosts,
)

N = 40


def _options(mesh, hosts, partition=None, **kw):
    """Each virtual host's ``shard_options`` (as that host would ask for it)."""
    out = []
    for h in range(hosts):
        with virtual_hosts(hosts, process_index=h), mesh:
            out.append(shard_options(ts.P("dp") if partition is None else partition, **kw))
    return out


def _rows(n=N):
    return grain.MapDataset.range(n).map(lambda i: {"id": np.int64(i), "x": np.float32(i) / 2})


def test_shard_options_is_the_feed_and_tp_peers_read_grains_same_records(mesh8):
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    opts = _options(mesh, 4, drop_remainder=False)  # hosts 0, 1 hold the first dp row
    options = [(o.shard_index, o.shard_count, o.drop_remainder) for o in opts]
    assert options == [(0, 2, False), (0, 2, False), (1, 2, False), (1, 2, False)]
    assert [o.shard_count for o in _options(mesh, 4, ts.P(("dp", "tp")))] == [4] * 4
    with virtual_hosts(4, process_index=3), mesh:  # the default: dim 0 over every axis
        assert shard_options().shard_index == 3
        with pytest.raises(TypeError, match="drop_remainder must be a bool"):
            shard_options(ts.P("dp"), drop_remainder=1)
    records = []
    for o in opts:  # what grain's own DataLoader reads with this process's options
        sampler = grain.samplers.IndexSampler(N + 1, shard_options=o, num_epochs=1)
        loader = grain.DataLoader(data_source=range(N + 1), sampler=sampler, worker_count=0)
        records.append([int(r) for r in loader])
    # grain's own loader, given the feed: the tp peers read the same records, the two feeds
    # disjoint ones (the old recipe, ShardByJaxProcess, gave each of the 4 processes its own).
    assert records[0] == records[1] and records[2] == records[3]
    assert records[0] and not set(records[0]) & set(records[2])


def _pipeline(kind, opts, batch):
    """A grain pipeline over this feed's shard (``opts``), in batches of ``batch``."""
    ds = _rows()
    if kind == "DataLoader":
        sampler = grain.samplers.IndexSampler(N, shard_options=opts, num_epochs=1)
        return grain.DataLoader(
            data_source=[{"id": np.int64(i), "x": np.float32(i) / 2} for i in range(N)],
            sampler=sampler,
            operations=[grain.transforms.Batch(batch, drop_remainder=True)],
            worker_count=0,
        )
    ds = ds[opts.shard_index :: opts.shard_count]
    if kind == "IterDataset":
        return ds.to_iter_dataset().batch(batch)
    return ds.batch(batch)


KINDS = ["MapDataset", "IterDataset", "DataLoader"]


@pytest.mark.parametrize("kind", KINDS)
def test_grain_pipelines_feed_the_loader_and_resume(mesh8, kind):
    """4 virtual hosts on (dp=2, tp=4) -> P("dp"): two feeds, each read by two hosts. The
    global batches are grain's own batches of each feed, stacked; two passes; a state after 2
    batches resumes a new loader (over new grain objects) with exactly the rest."""
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    opts = _options(mesh, 4)
    assert [o.shard_index for o in opts] == [0, 0, 1, 1]

    def loader():
        return global_batch_loader_per_host(
            [_pipeline(kind, o, 2) for o in opts], partition=ts.P("dp"), mesh=mesh
        )

    oracle = [[b["id"].tolist() for b in _pipeline(kind, opts[h], 2)] for h in (0, 2)]
    expected = [a + b for a, b in zip(*oracle, strict=True)]
    with virtual_hosts(4), mesh:
        first = loader()
        it = iter(first)
        taken = [ts.replicate_to_local_data(next(it)["id"]).tolist() for _ in range(2)]
        state = pickle.loads(pickle.dumps(first.state_dict()))
        rest = [ts.replicate_to_local_data(b["id"]).tolist() for b in it]
        again = [ts.replicate_to_local_data(b["id"]).tolist() for b in first]
        resumed = loader()
        resumed.load_state_dict(state)
        after = [ts.replicate_to_local_data(b["id"]).tolist() for b in resumed]
        blocks = [global_to_host_array_per_host(b)[1]["id"].tolist() for b in resumed]
    assert taken + rest == expected and again == expected  # a pass is grain's, twice
    assert after == expected[2:]  # the resumed loader: exactly the rest
    assert blocks[:1] == [oracle[0][0]]  # host 1 (a tp peer of host 0) holds feed 0's rows


class LoaderAsDataset:
    """A ``GlobalBatchLoader`` seen as a grain dataset, for grain's own checkpoint helper:
    ``iter()`` a new loader over new grain pipelines; its iterator's ``get_state`` is the
    loader's ``state_dict()``, ``set_state`` its ``load_state_dict``, each value the global
    batch read back."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return LoaderIterator(self.make())


class LoaderIterator:
    def __init__(self, loader):
        self.loader = loader
        self.it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.it)
        return {k: ts.replicate_to_local_data(v).numpy() for k, v in batch.items()}

    def get_state(self):
        return self.loader.state_dict()

    def set_state(self, state):
        self.loader.load_state_dict(state)
        self.it = iter(self.loader)


@pytest.mark.parametrize("kind", KINDS)
def test_grains_own_checkpoint_helper_passes_through_the_loader(mesh8, kind):
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    opts = _options(mesh, 2)
    with virtual_hosts(2), mesh:
        ds = LoaderAsDataset(
            lambda: global_batch_loader_per_host(
                [_pipeline(kind, o, 4) for o in opts], partition=ts.P("dp"), mesh=mesh
            )
        )
        assert_equal_output_after_checkpoint(ds)


def test_an_elastic_iterator_resumes_on_another_host_count_as_grains_own(mesh8):
    """4 hosts (dp=4 x tp=2) read 3 global batches of 8 through grain's ElasticIterator; the
    state resumes on 2 hosts (dp=2 x tp=4), the global batch kept: what each host reads is what
    grain's own ElasticIterator, resumed on 2 shards from the same global index, reads."""
    ds = _rows()
    mesh4 = ts.Mesh(np.arange(8).reshape(4, 2), ("dp", "tp"))
    sources = []
    for h in range(4):
        with virtual_hosts(4, process_index=h), mesh4:
            sources.append(elastic_iterator(ds, 8, ts.P("dp")))
    with virtual_hosts(4), mesh4:
        loader = global_batch_loader_per_host(sources, partition=ts.P("dp"), mesh=mesh4)
        it = iter(loader)
        taken = [ts.replicate_to_local_data(next(it)["id"]).tolist() for _ in range(3)]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        loader.close()
    assert json.loads(state["common"]["elastic"])["position"] == {"global_next_index": 24}
    mesh2 = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
    sources = []
    for h in range(2):
        with virtual_hosts(2, process_index=h), mesh2:
            sources.append(elastic_iterator(ds, 8, ts.P("dp")))
    with virtual_hosts(2), mesh2:
        resumed = global_batch_loader_per_host(sources, partition=ts.P("dp"), mesh=mesh2)
        resumed.load_state_dict(state)
        rest = [global_to_host_array_per_host(b) for b in resumed]
    oracle = []
    for h in range(2):  # grain's own, without torchshard
        own = grain.experimental.ElasticIterator(ds, 8, grain.sharding.ShardOptions(h, 2, True))
        own.set_state({"global_next_index": 24})
        oracle.append([b["id"].tolist() for b in own])
    assert [[blk["id"].tolist() for blk in step] for step in rest] == [
        list(step) for step in zip(*oracle, strict=True)
    ]
    every = [i for b in taken for i in b] + [
        i for step in rest for blk in step for i in blk["id"].tolist()
    ]
    assert sorted(every) == list(range(N))  # each example once


def test_gloo_elastic_resume_from_4_processes_on_2_through_dcp(pools, tmp_path):
    """4 processes (dp=4) read 3 global batches of 8 and save with torch.distributed.checkpoint;
    2 processes (dp=2) load it (allow_partial_load) and read the rest: each example once, and
    each what grain's own ElasticIterator reads on its shard from the saved global index."""
    path = str(tmp_path / "ckpt")
    saved = pools(4).run("_grain_cases:elastic_save", path=path, steps=3)
    assert all(
        json.loads(r["state"]["elastic"])["position"] == {"global_next_index": 24} for r in saved
    )
    loaded = pools(2).run("_grain_cases:elastic_resume", path=path, index=24)
    taken = [i for r in saved for i in r["taken"]]
    rest = [i for r in loaded for i in r["rest"]]
    assert sorted(taken + rest) == list(range(_grain_cases.N))
    for r in loaded:
        assert r["rest"] == r["oracle"] and r["rest"]
