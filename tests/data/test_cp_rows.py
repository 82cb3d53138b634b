"""``torchshard.data.context_parallel_rows`` (torchshard.data._cp_rows): each process's part of
every packed row, in the layout ``context_parallel_order`` gives (``per_document``, ``ptrr``),
every leaf cut alike; whole-row head-tail refused; the state is the packer's, so a loader over
it resumes the same rows; and each host of a (dp, cp) mesh feeds a global batch whose rows are
the packed rows in that layout."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import virtual_host_of

import torchshard as ts
from torchshard._core.topology import Topology, override_topology
from torchshard.data import Packer, context_parallel_rows

KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


def docs(seed=0, n=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, int(k)) for k in rng.integers(1, 60, n)]


def host(num_hosts, process, devices):
    return override_topology(Topology(process, num_hosts, virtual_host_of(num_hosts, devices)))


@pytest.mark.xla  # virtual hosts over torch_xla's emulated devices
@pytest.mark.parametrize("balancer", ["per_document", "ptrr"])
def test_each_process_reads_its_part_of_every_row_in_the_layouts_order(balancer):
    mesh = ts.Mesh(np.arange(4).reshape(2, 2), ("dp", "cp"))
    kw = {"block_size": 8} if balancer == "ptrr" else {}
    packer = Packer(docs(), seq_len=64, rows=2, pad_to_multiple_of=4)
    whole = list(packer)
    for h in range(4):  # one device per host; hosts 1 and 3 are cp rank 1
        rank = h % 2
        rows = context_parallel_rows(packer, ts.P("dp", "cp"), balancer=balancer, mesh=mesh, **kw)
        with host(4, h, 4):
            parts = list(rows)
        assert len(parts) == len(whole)
        for part, batch in zip(parts, whole, strict=True):
            for r in range(2):
                order = ts.context_parallel_order(
                    batch["segment_ids"][r], 2, balancer=balancer, **kw
                )
                mine = order[rank * 32 : (rank + 1) * 32]
                for k in KEYS:
                    assert part[k].shape == (2, 32) and part[k].dtype == batch[k].dtype
                    assert part[k][r].tolist() == batch[k][r][mine].tolist(), k


def test_head_tail_and_batches_without_documents_are_refused():
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "context_parallel_rows: balancer must be a layout that respects documents, "
            "'per_document' or 'ptrr', but got 'head_tail'. 'head_tail' ignores documents"
        ),
    ):
        context_parallel_rows(Packer([], seq_len=8, rows=1), ts.P("dp", "cp"), balancer="head_tail")
    mesh = ts.Mesh(np.arange(4).reshape(2, 2), ("dp", "cp"))
    rows = context_parallel_rows([{"tokens": np.zeros((2, 8))}], ts.P("dp", "cp"), mesh=mesh)
    with pytest.raises(ts.ShardingError, match=re.escape("batch 0 has no 'segment_ids'")):
        next(iter(rows))
    odd = Packer([np.arange(1, 4)], seq_len=8, rows=1)  # a document of 3 over cp 2
    with pytest.raises(
        ts.ShardingError, match=re.escape("segment_ids[0] has 2 documents whose length is not")
    ):
        next(iter(context_parallel_rows(odd, ts.P("dp", "cp"), mesh=mesh)))


def test_the_state_is_the_sources():
    packer = Packer(docs(1), seq_len=64, rows=2, pad_to_multiple_of=4)
    rows = context_parallel_rows(packer, ts.P("dp", "cp"))
    assert rows.batch_size == 2
    packer_state = {"batches": 1, "documents_read": 9, "pending": None, "pending_pad": 0}
    rows.load_state_dict(packer_state)
    assert rows.state_dict() == packer_state == packer.state_dict()
    with pytest.raises(TypeError, match=re.escape("the source (list) saves no position")):
        context_parallel_rows([], ts.P("dp", "cp")).state_dict()


@pytest.mark.xla  # a loader on torch_xla's emulated devices (the gloo example: processes)
def test_a_loader_over_the_parts_places_the_rows_in_the_layout_and_resumes():
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "cp"))  # one process: every cp rank
    partition = ts.P("dp", "cp")
    documents = docs(2, n=120)

    def loader(prefetch):
        packer = Packer(documents, seq_len=64, rows=2, pad_to_multiple_of=8)
        rows = context_parallel_rows(packer, partition, balancer="per_document")
        return ts.data.GlobalBatchLoader(rows, partition=partition, prefetch=prefetch)

    with mesh:
        got = [ts.replicate_to_local_data(b) for b in loader(2)]
        first = loader(0)
        it = iter(first)
        next(it)
        state = first.state_dict()
        first.close()
        resumed = loader(0)
        resumed.load_state_dict(state)
        rest = [ts.replicate_to_local_data(b) for b in resumed]
    packed = list(Packer(documents, seq_len=64, rows=2, pad_to_multiple_of=8))
    assert len(got) == len(packed) > 1
    for batch, rows in zip(got, packed, strict=True):
        for r in range(2):
            order = ts.context_parallel_order(rows["segment_ids"][r], 4, balancer="per_document")
            for k in KEYS:
                assert batch[k][r].cpu().numpy().tolist() == rows[k][r][order].tolist(), k
    for a, b in zip(rest, got[1:], strict=True):
        assert all(np.array_equal(a[k].cpu().numpy(), b[k].cpu().numpy()) for k in KEYS)
