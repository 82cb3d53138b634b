"""Streams split over processes and DataLoader workers (torchshard.data._stream_shard):
``stream_shard`` from the mesh and partition (replicas share a shard; inside a worker the worker
is included, from what the main process recorded), and a stream split with it read whole, each
example once, through the loader; on torch_xla and on gloo processes."""

from __future__ import annotations

import re

import numpy as np
import pytest
from torch.utils.data import DataLoader, IterableDataset

import torchshard as ts
from torchshard.data import _stream_shard

CASES = "_loader_cases:"


class Where(IterableDataset):
    """Yields what ``stream_shard`` answers where it runs (a worker, or the main process)."""

    def __init__(self, partition=None):
        self.partition = partition

    def __iter__(self):
        index, count = ts.stream_shard(self.partition)
        yield {"index": np.int64(index), "count": np.int64(count)}


def _answers(workers, partition=None, **kwargs):
    source = DataLoader(Where(partition), batch_size=None, num_workers=workers, **kwargs)
    return sorted((int(b["index"]), int(b["count"])) for b in source)


def test_one_process_reads_the_whole_stream(mesh8):
    assert ts.stream_shard() == (0, 1)
    assert ts.stream_shard(ts.P("data")) == (0, 1)


def test_virtual_hosts_get_their_feed_and_replicas_share_it(mesh42):
    from torchshard.testing import virtual_hosts

    for h in range(4):
        with virtual_hosts(4, process_index=h):
            assert ts.stream_shard() == (h, 4)  # dim 0 over every axis: one feed per host
            assert ts.stream_shard(ts.P("data")) == (h, 4)
            assert ts.stream_shard(ts.P("model")) == (0, 1)  # the hosts split only "data"
            assert ts.stream_shard(ts.P()) == (0, 1)  # replicated: everyone reads it all
    with virtual_hosts(2, process_index=1):
        assert ts.stream_shard(ts.P("data")) == (1, 2)


def test_inside_a_worker_the_worker_is_included(mesh8):
    ts.stream_shard()  # records the mesh and this process's place for the workers
    assert _answers(2) == [(0, 2), (1, 2)]
    assert _answers(2, multiprocessing_context="spawn") == [(0, 2), (1, 2)]


def test_inside_a_worker_of_a_virtual_host(mesh8):
    from torchshard.testing import virtual_hosts

    with virtual_hosts(2, process_index=1):
        ts.stream_shard()
        assert _answers(2) == [(2, 4), (3, 4)]


def test_a_worker_without_a_record_names_the_fix(mesh8, monkeypatch):
    monkeypatch.delenv(_stream_shard.WORKER_RECORD, raising=False)
    with pytest.raises(ts.errors.NoMeshError) as info:
        _answers(1)
    assert (
        "stream_shard: inside a DataLoader worker, but the main process recorded no mesh for its "
        "workers: call torchshard.stream_shard() (inside `with mesh:`) in the main process before "
        "the DataLoader starts its workers, or iterate it through GlobalBatchLoader."
    ) in str(info.value)


def test_stream_shard_needs_a_mesh_and_a_spec():
    msg = "stream_shard: needs a mesh: call it inside `with mesh:` or pass stream_shard(mesh=mesh)."
    with pytest.raises(ts.errors.NoMeshError, match=f"^{re.escape(msg)}$"):
        ts.stream_shard()
    mesh = ts.Mesh(np.arange(8), ("data",))
    with pytest.raises(TypeError, match=re.escape("stream_shard: partition must be a")):
        ts.stream_shard({"x": ts.P("data")}, mesh=mesh)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stream_split_with_stream_shard_yields_every_example_once(mesh8, prefetch):
    from _loader_cases import Shards

    source = DataLoader(Shards(8, 4, split=True), batch_size=4, num_workers=2)
    with ts.GlobalBatchLoader(source, prefetch=prefetch, partition=ts.P()) as loader:
        seen = [i for b in loader for i in ts.replicate_to_local_data(b["id"]).tolist()]
    assert sorted(seen) == list(range(32))


def test_forkserver_workers_read_their_own_loaders_record(mesh8):
    """forkserver workers inherit the server's environment, taken when it started (for an
    earlier loader). 2 virtual hosts x 2 workers: every one of the 96 examples once (the
    server's record gave 48 twice and 48 never); then a loader on another mesh, whose stream
    splits by P("dp"), which the first mesh lacks."""
    from _loader_cases import Shards

    from torchshard.testing import global_batch_loader_per_host, virtual_hosts

    def source(partition=None, workers=2):
        stream = Shards(24 if partition is None else 8, 4, split=True, partition=partition)
        return DataLoader(
            stream, batch_size=4, num_workers=workers, multiprocessing_context="forkserver"
        )

    with virtual_hosts(2):
        loader = global_batch_loader_per_host([source(), source()], last_batch="pad")
        seen = []
        for b, mask in loader:
            seen += ts.replicate_to_local_data(b["id"])[ts.replicate_to_local_data(mask)].tolist()
    assert sorted(seen) == list(range(96))
    with ts.Mesh(np.arange(8).reshape(4, 2), ("dp", "tp")):
        other = ts.GlobalBatchLoader(source(ts.P("dp"), workers=1), partition=ts.P("dp"))
        seen = [i for b in other for i in ts.replicate_to_local_data(b["id"]).tolist()]
    assert sorted(seen) == list(range(32))
    kept = DataLoader(Shards(8, 4, split=True), num_workers=2, worker_init_fn=print)
    with _stream_shard.workers_recorded(kept):
        assert isinstance(kept.worker_init_fn, _stream_shard.WorkerInit)
        assert kept.worker_init_fn.inner is print  # the source's own runs after
    assert kept.worker_init_fn is print  # and is put back


# -- gloo processes ---------------------------------------------------------------------------


def test_gloo_processes_and_workers_split_a_stream(pools):
    results = pools(2).run(CASES + "stream_workers", split=True)
    seen = sorted(results[0]["got"])
    assert seen == list(range(2 * 2 * 4 * 4))  # every example of every shard, once
    for rank, r in enumerate(results):
        assert r["error"] == "no error"
        assert r["got"] == results[0]["got"]
        assert r["shard"] == [rank, 2] or tuple(r["shard"]) == (rank, 2)
        assert r["after"] == (2, 2)
