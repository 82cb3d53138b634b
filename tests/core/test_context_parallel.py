"""Context parallelism on the host (torchshard._core.context_parallel): ``head_tail_order`` is
the order of torch's own ``context_parallel`` load balancer (its private balancer, through
``_torch_private``, is the oracle); ``context_parallel_order``'s ``per_document`` and ``ptrr``
are torch's ``_PerDocumentHeadTailLoadBalancer`` and ``_PTRRLoadBalancer`` (oracles where torch
has them, >= 2.13; everywhere a plain-Python reference written from their description, PTRR's
work counted from the element mask itself); packed rows are refused under whole-row head-tail,
and lengths a balancer cannot cut are refused with the numbers; and the recipe (each host
reads ``feed_read_config``'s rows and ``context_parallel_positions``' part of each sequence,
feeds ``P("dp", "cp")``) gives every cp rank exactly the shard torch's ``context_parallel``
keeps, on gloo processes (cp=2 on 2 ranks, dp=2 x cp=2 on 4)."""

from __future__ import annotations

import contextlib
import re

import _stacks_cases  # noqa: F401 -- the workers import it; here it must import too
import numpy as np
import pytest
import torch
from helpers import virtual_host_of
from hypothesis import given
from hypothesis import strategies as st
from strategies import SETTINGS

import torchshard as ts
from torchshard._backend.dtensor._torch_private import (
    context_parallel_indices,
    document_load_balancer,
)
from torchshard._core.topology import Topology, override_topology

P = ts.P


def test_the_issues_example():
    # 16 tokens over cp=2: torch's context_parallel gives rank 0 positions 0-3 and 12-15.
    order = ts.head_tail_order(16, 2)
    assert order[:8] == [0, 1, 2, 3, 12, 13, 14, 15]
    assert order[8:] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert ts.head_tail_order(4, 1) == [0, 1, 2, 3]  # one rank: the identity


@SETTINGS
@given(st.integers(1, 8), st.integers(1, 6), st.booleans())
def test_head_tail_order_is_torchs(cp, chunk, inverse):
    seq_len = 2 * cp * chunk
    order = ts.head_tail_order(seq_len, cp, inverse=inverse)
    assert order == context_parallel_indices(seq_len, cp, restore=inverse)
    forward = ts.head_tail_order(seq_len, cp)
    restore = ts.head_tail_order(seq_len, cp, inverse=True)
    assert sorted(forward) == list(range(seq_len))
    assert [forward[i] for i in restore] == list(range(seq_len))


def test_head_tail_order_arguments():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "head_tail_order: seq_len 10 is not a multiple of 2 * cp_size = 4: the head-tail "
            "order cuts each sequence into 4 equal chunks (torch's context_parallel does not "
            "balance such a sequence: torch 2.9 fails, torch 2.14 shards it in contiguous "
            "blocks). Pad the sequences to a multiple of 4."
        ),
    ):
        ts.head_tail_order(10, 2)
    with pytest.raises(
        ValueError, match=re.escape("head_tail_order: seq_len must be a positive int, but got 0.")
    ):
        ts.head_tail_order(0, 2)
    with pytest.raises(
        ValueError, match=re.escape("head_tail_order: cp_size must be a positive int, but got '2'.")
    ):
        ts.head_tail_order(8, "2")
    with pytest.raises(ValueError, match=re.escape("cp_size must be a positive int, but got True")):
        ts.head_tail_order(8, True)
    with pytest.raises(
        TypeError, match=re.escape("head_tail_order: inverse must be a bool, but got 1.")
    ):
        ts.head_tail_order(8, 2, inverse=1)
    assert ts.head_tail_order(np.int64(8), np.int32(2)) == [0, 1, 6, 7, 2, 3, 4, 5]


@contextlib.contextmanager
def hosts(num_hosts, process, devices=8):
    topology = Topology(process, num_hosts, virtual_host_of(num_hosts, devices))
    with override_topology(topology):
        yield


@pytest.mark.xla  # virtual hosts over torch_xla's emulated devices
def test_context_parallel_positions_per_host():
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), ("dp", "cp"))
    got = {}
    for h in range(4):  # hosts of 2 devices: two cp ranks each
        with hosts(4, h):
            got[h] = ts.context_parallel_positions(P("dp", "cp"), 16, mesh=mesh)
    order = ts.head_tail_order(16, 4)
    assert got[0] == got[2] == order[:8] == [0, 1, 14, 15, 2, 3, 12, 13]
    assert got[1] == got[3] == order[8:]
    # One device per process: each reads 1/cp of every sequence; the cp ranks' parts tile it.
    mesh = ts.Mesh(np.arange(4).reshape(2, 2), ("dp", "cp"))
    parts = []
    for h in range(4):
        with hosts(4, h, 4):
            parts.append(ts.context_parallel_positions(P("dp", "cp"), 8, mesh=mesh))
    assert parts[0] == parts[2] == [0, 1, 6, 7] and parts[1] == parts[3] == [2, 3, 4, 5]
    # The sequence dim may be another (seq_dim), and the cp axis any axis.
    with hosts(4, 1, 4):
        assert ts.context_parallel_positions(P("dp", None, "cp"), 8, seq_dim=2, mesh=mesh) == [
            2,
            3,
            4,
            5,
        ]


def test_a_cp_axis_of_size_1_reads_whole_sequences_in_order():
    """cp = 1 (a job's config without context parallelism, same code): torch's
    context_parallel keeps the whole sequence on its one cp rank, so every position, in
    order, for any length (no 2 * cp chunks to cut)."""
    mesh = ts.Mesh(np.arange(4).reshape(4, 1), ("dp", "cp"))
    for h in range(4):
        with hosts(4, h, 4):
            assert ts.context_parallel_positions(P("dp", "cp"), 7, mesh=mesh) == list(range(7))
            got = ts.context_parallel_positions(P("dp", None, "cp"), 6, seq_dim=2, mesh=mesh)
            assert got == list(range(6))


def test_context_parallel_positions_arguments():
    mesh = ts.Mesh(np.arange(4).reshape(2, 2), ("dp", "cp"))
    with hosts(4, 0, 4):
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "context_parallel_positions: P('dp',) does not split dim 1 (seq_dim) on "
                "Mesh({'dp': 2, 'cp': 2}), so there is no context parallelism: every process "
                "reads whole sequences, in their order."
            ),
        ):
            ts.context_parallel_positions(P("dp"), 8, mesh=mesh)
        with pytest.raises(
            ValueError,
            match=re.escape("head_tail_order: seq_len 6 is not a multiple of 2 * cp_size = 4"),
        ):
            ts.context_parallel_positions(P("dp", "cp"), 6, mesh=mesh)
        with pytest.raises(
            ValueError,
            match=re.escape("context_parallel_positions: seq_dim must be an int >= 0, but got -1."),
        ):
            ts.context_parallel_positions(P("dp", "cp"), 8, seq_dim=-1, mesh=mesh)
        with pytest.raises(
            ts.ShardingError,
            match=re.escape("context_parallel_positions: partition spec P('dp', 'sp') names"),
        ):
            ts.context_parallel_positions(P("dp", "sp"), 8, mesh=mesh)
    with pytest.raises(ts.errors.NoMeshError, match="context_parallel_positions must be called"):
        ts.context_parallel_positions(P("dp", "cp"), 8)


@pytest.mark.parametrize(("world", "dp", "cp"), [(2, 1, 2), (4, 2, 2), (4, 1, 4)])
def test_every_cp_rank_gets_torchs_shard(pools, world, dp, cp):
    batch, seq_len = 2 * dp, 8 * cp
    results = pools(world).run(
        "_stacks_cases:context_parallel_shards", dp=dp, cp=cp, batch=batch, seq_len=seq_len
    )
    rows_per_host = batch // dp
    for rank, r in enumerate(results):
        for leaf in ("tokens", "labels", "positions"):  # inputs, labels, positions alike
            assert torch.equal(r["local"][leaf], r["torch"][leaf]), (rank, leaf)
        # each host read only its 1/cp of each of its sequences
        assert r["read_positions"] == rows_per_host * seq_len // cp
        assert len(r["positions"]) == seq_len // cp
        assert r["restored_equal"], "the inverse order did not restore the global value"
        assert r["back_equal"]
    if (dp, cp) == (1, 2):  # the issue's picture, scaled: rank 0 holds 0-3 and 12-15 of 16
        assert results[0]["torch"]["positions"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


# -- packed rows: per-document head-tail and PTRR ------------------------------------------------


def runs(ids):
    """(start, length) of each run of equal ids, by hand."""
    out = []
    for i, v in enumerate(ids):
        if i and ids[i - 1] == v:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return out


def reference_per_document(ids, cp):
    """Each document in 2 cp chunks; rank r: chunk r then chunk 2 cp - 1 - r of every document."""
    order = []
    for r in range(cp):
        for start, length in runs(ids):
            c = length // (2 * cp)
            for chunk in (r, 2 * cp - 1 - r):
                order += range(start + chunk * c, start + (chunk + 1) * c)
    return order


def reference_ptrr(ids, cp, block):
    """PTRR from the element mask: a query block's work is the number of key blocks holding a
    key it may see (same document, kv <= q); sorted by work (stable, largest first), dealt in a
    snake, each rank's blocks ascending."""
    n = len(ids)
    doc = [0] * n
    for d, (start, length) in enumerate(runs(ids)):
        doc[start : start + length] = [d] * length
    blocks = n // block
    work = []
    for i in range(blocks):
        touched = {
            k // block
            for q in range(i * block, (i + 1) * block)
            for k in range(q + 1)
            if doc[k] == doc[q]
        }
        work.append(len(touched))
    ranked = sorted(range(blocks), key=lambda b: -work[b])  # sorted() is stable
    groups = [[] for _ in range(cp)]
    for j, b in enumerate(ranked):
        lap, g = divmod(j, cp)
        groups[g if lap % 2 == 0 else cp - 1 - g].append(b)
    return [b * block + t for g in groups for b in sorted(g) for t in range(block)]


def inverse_of(order):
    restore = [0] * len(order)
    for i, p in enumerate(order):
        restore[p] = i
    return restore


def packed_row(draw, n):
    """Segment ids of a packed row of n positions: documents 1, 2, ... and maybe padding."""
    ids, seg = [], 1
    pad = draw(st.integers(0, n // 2)) if draw(st.booleans()) else 0
    while len(ids) < n - pad:
        ids += [seg] * draw(st.integers(1, n))
        seg += 1
    return ids[: n - pad] + [0] * pad


@st.composite
def per_document_rows(draw):
    cp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    chunks = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    ids = []
    for d, c in enumerate(chunks):
        ids += [0 if d == len(chunks) - 1 and draw(st.booleans()) else d + 1] * (2 * cp * c)
    return ids, cp


@st.composite
def ptrr_rows(draw):
    cp = draw(st.sampled_from([1, 2, 3, 4]))
    block = draw(st.sampled_from([1, 2, 4, 8]))
    n = block * cp * draw(st.integers(1, 5))
    return packed_row(draw, n), cp, block


@SETTINGS
@given(per_document_rows(), st.booleans())
def test_per_document_order_is_torchs(row, inverse):
    ids, cp = row
    got = ts.context_parallel_order(ids, cp, balancer="per_document", inverse=inverse)
    expected = reference_per_document(ids, cp)
    assert got == (inverse_of(expected) if inverse else expected)
    torchs = document_load_balancer("per_document", cp, lengths=[[n for _, n in runs(ids)]])
    if torchs is not None:  # torch >= 2.13
        assert got == torchs._generate_indices(restore=inverse)[0].tolist()
    # every rank holds a head and a tail of every document: the same share of each
    part = len(ids) // cp
    for start, length in runs(ids):
        for r in range(cp):
            mine = expected[r * part : (r + 1) * part]
            held = [p for p in mine if start <= p < start + length]
            assert len(held) == length // cp


@SETTINGS
@given(ptrr_rows(), st.booleans())
def test_ptrr_order_is_torchs(row, inverse):
    from torch.nn.attention.flex_attention import create_block_mask

    ids, cp, block = row
    got = ts.context_parallel_order(ids, cp, balancer="ptrr", block_size=block, inverse=inverse)
    expected = reference_ptrr(ids, cp, block)
    assert got == (inverse_of(expected) if inverse else expected)
    doc = torch.tensor([d for d, (_, n) in enumerate(runs(ids)) for _ in range(n)])

    def document_causal(b, h, q, kv):
        return (kv <= q) & (doc[q] == doc[kv])

    n = len(ids)
    mask = create_block_mask(document_causal, 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
    torchs = document_load_balancer("ptrr", cp, block_mask=mask)
    if torchs is not None:  # torch >= 2.13
        assert got == torchs._generate_indices(restore=inverse)[0].tolist()


def test_the_packed_layouts_examples():
    ids = [1] * 8 + [2] * 4 + [0] * 4  # torch's docstring: documents of 8 and 4 over 2 ranks
    assert ts.context_parallel_order(ids, 2, balancer="per_document") == [
        0, 1, 6, 7, 8, 11, 12, 15,
        2, 3, 4, 5, 9, 10, 13, 14,
    ]  # fmt: skip
    # torch's PTRR docstring: documents of 4, 8 and 4 blocks (block 1) over 2 ranks
    ids = [1] * 4 + [2] * 8 + [3] * 4
    assert ts.context_parallel_order(ids, 2, balancer="ptrr", block_size=1) == [
        2, 3, 5, 6, 8, 11, 12, 13,
        0, 1, 4, 7, 9, 10, 14, 15,
    ]  # fmt: skip
    # a row of one document (and padding) is not packed: head-tail takes it
    assert ts.context_parallel_order([1] * 6 + [0] * 2, 2) == ts.head_tail_order(8, 2)
    assert ts.context_parallel_order(np.ones(8, np.int32), 2, inverse=True) == ts.head_tail_order(
        8, 2, inverse=True
    )
    one_rank = ts.context_parallel_order(torch.tensor([3] * 8), 1, balancer="ptrr", block_size=2)
    assert one_rank == list(range(8))


def test_packed_rows_are_refused_where_a_layout_ignores_documents():
    ids = [1] * 5 + [2] * 7 + [3] * 4
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "context_parallel_order: segment_ids holds 3 documents (length at offset of each run "
            "of segment ids: 5 at 0, 7 at 5, 4 at 12), but balancer='head_tail' ignores "
            "documents: it cuts the whole row into 2 * cp chunks, the layout of torch's "
            "context_parallel, whose causal SDPA attends across the documents of a packed row. "
            "Use a layout that respects documents, balancer='per_document' or balancer='ptrr'"
        ),
    ):
        ts.context_parallel_order(ids, 2)
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "context_parallel_order: balancer='per_document' cuts every document into "
            "2 * cp_size = 4 equal chunks, but segment_ids has 2 documents whose length is not "
            "a multiple of 4 (length at offset: 5 at 0, 7 at 5). Pack with "
            "torchshard.data.Packer(..., pad_to_multiple_of=4)"
        ),
    ):
        ts.context_parallel_order(ids, 2, balancer="per_document")
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "context_parallel_order: balancer='ptrr' deals whole blocks of block_size=4 to the 3 "
            "ranks, so seq_len must be a multiple of block_size * cp_size = 12, but segment_ids "
            "has 16 positions (4 blocks)."
        ),
    ):
        ts.context_parallel_order(ids, 3, balancer="ptrr", block_size=4)


def test_context_parallel_order_arguments():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "context_parallel_order: balancer must be one of 'head_tail', 'per_document', "
            "'ptrr', but got 'per_doc'."
        ),
    ):
        ts.context_parallel_order([1] * 8, 2, balancer="per_doc")
    with pytest.raises(TypeError, match=re.escape("expected integer segment ids (an array of")):
        ts.context_parallel_order([1.0] * 8, 2)
    with pytest.raises(ValueError, match=re.escape("segment_ids must be one row, of shape")):
        ts.context_parallel_order([[1] * 8], 2)
    with pytest.raises(TypeError, match=re.escape("inverse must be a bool, but got 1.")):
        ts.context_parallel_order([1] * 8, 2, inverse=1)
    with pytest.raises(ValueError, match=re.escape("block_size must be a positive int")):
        ts.context_parallel_order([1] * 8, 2, balancer="ptrr", block_size=0)


@pytest.mark.xla  # virtual hosts over torch_xla's emulated devices
def test_context_parallel_positions_of_packed_rows_per_host():
    mesh = ts.Mesh(np.arange(4).reshape(2, 2), ("dp", "cp"))
    ids = np.array([[1] * 8 + [2] * 4 + [0] * 4, [1] * 4 + [2] * 12])
    for balancer in ("per_document", "ptrr"):
        kw = {"block_size": 2} if balancer == "ptrr" else {}
        orders = [ts.context_parallel_order(r, 2, balancer=balancer, **kw) for r in ids]
        for h in range(4):  # one device per host; hosts 1 and 3 are cp rank 1
            with hosts(4, h, 4):
                got = ts.context_parallel_positions(
                    P("dp", "cp"), 16, mesh=mesh, balancer=balancer, segment_ids=ids, **kw
                )
                one = ts.context_parallel_positions(
                    P("dp", "cp"), 16, mesh=mesh, balancer=balancer, segment_ids=ids[1], **kw
                )
            rank = h % 2
            assert got.dtype == np.int64 and got.shape == (2, 8)
            assert got.tolist() == [o[rank * 8 : (rank + 1) * 8] for o in orders]
            assert one.tolist() == orders[1][rank * 8 : (rank + 1) * 8]
    with hosts(4, 0, 4):
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "context_parallel_positions: segment_ids[0] holds 2 documents (length at offset "
                "of each run of segment ids: 8 at 0, 4 at 8, 4 at 12), but balancer='head_tail' "
                "ignores documents"
            ),
        ):
            ts.context_parallel_positions(P("dp", "cp"), 16, mesh=mesh, segment_ids=ids)
        with pytest.raises(
            ValueError,
            match=re.escape(
                "context_parallel_positions: balancer='ptrr' orders each row by its documents, "
                "so it needs the segment ids"
            ),
        ):
            ts.context_parallel_positions(P("dp", "cp"), 16, mesh=mesh, balancer="ptrr")
        with pytest.raises(ValueError, match=re.escape("segment_ids must have seq_len = 8")):
            ts.context_parallel_positions(P("dp", "cp"), 8, mesh=mesh, segment_ids=ids)
        # one document per row (and padding): head-tail, as without segment ids
        plain = ts.context_parallel_positions(
            P("dp", "cp"), 16, mesh=mesh, segment_ids=np.ones((2, 16), np.int32)
        )
        assert plain.tolist() == [ts.context_parallel_positions(P("dp", "cp"), 16, mesh=mesh)] * 2
