"""Packing's index maths (torchshard._core.packing): ``RowBatch`` places documents as the
plain-Python reference does (first fit, best fit, concat-then-split, a bound on documents per
row, documents padded to a multiple), over lengths hypothesis draws; ``Pending.split`` keeps a
padded document's tokens and pads apart."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from packing_reference import reference_arrays, reference_rows
from strategies import SETTINGS

from torchshard._core.packing import Pending, RowBatch, padded


def pack(lengths, seq_len, rows, method, max_documents, multiple):
    """Every batch's arrays, packed with RowBatch alone."""
    out, batch = [], RowBatch(rows=rows, seq_len=seq_len, max_documents=max_documents)
    docs = [Pending(np.arange(1, n + 1), padded(n, multiple) - n) for n in lengths if n]
    queue = list(docs)
    while queue:
        doc = queue.pop(0)
        if method == "concat_split":
            rest = batch.concat(doc)
            if rest is not None or batch.full:
                out.append(batch.assemble(np.int64, 0))
                batch = RowBatch(rows=rows, seq_len=seq_len, max_documents=max_documents)
                if rest is not None:
                    queue.insert(0, rest)
            continue
        row = batch.fit(doc.length, method)
        if row is None:
            out.append(batch.assemble(np.int64, 0))
            batch = RowBatch(rows=rows, seq_len=seq_len, max_documents=max_documents)
            row = batch.fit(doc.length, method)
        batch.place(row, doc)
    if not batch.empty:
        out.append(batch.assemble(np.int64, 0))
    return out


@st.composite
def cases(draw):
    multiple = draw(st.sampled_from([1, 1, 2, 4]))
    seq_len = multiple * draw(st.integers(1, 12))
    method = draw(st.sampled_from(["best_fit", "first_fit", "concat_split"]))
    top = seq_len if method != "concat_split" else 3 * seq_len
    lengths = draw(st.lists(st.integers(0, top), max_size=30))
    if method != "concat_split":
        lengths = [n for n in lengths if padded(n, multiple) <= seq_len]
    rows = draw(st.integers(1, 4))
    max_documents = draw(st.none() | st.integers(1, 4))
    return lengths, seq_len, rows, method, max_documents, multiple


@SETTINGS
@given(cases())
def test_row_batches_place_documents_as_the_reference(case):
    lengths, seq_len, rows, method, max_documents, multiple = case
    got = pack(*case)
    docs = [list(range(1, n + 1)) for n in lengths]
    expected = reference_rows(docs, seq_len, rows, method, max_documents, multiple)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        ref = reference_arrays(e, seq_len)
        for key in ("tokens", "segment_ids", "positions", "loss_mask"):
            assert g[key].shape == (rows, seq_len)
            assert g[key].astype(np.int64).tolist() == ref[key], key


def test_split_keeps_tokens_and_pads_apart():
    doc = Pending(np.arange(5), 3)  # 5 tokens, padded to 8
    head, rest = doc.split(6)
    assert head.tokens.tolist() == [0, 1, 2, 3, 4] and head.pad == 1
    assert rest is not None and rest.tokens.tolist() == [] and rest.pad == 2
    head, rest = doc.split(3)
    assert head.tokens.tolist() == [0, 1, 2] and head.pad == 0
    assert rest.tokens.tolist() == [3, 4] and rest.pad == 3
    head, rest = doc.split(20)  # more room than it needs: all of it
    assert head.length == 8 and rest is None


def test_best_fit_picks_the_fullest_row_with_room():
    batch = RowBatch(rows=3, seq_len=10, max_documents=2)
    for row, n in ((0, 4), (1, 7), (2, 6)):
        batch.place(row, Pending(np.arange(n)))
    assert batch.fit(3, "best_fit") == 1  # 7 + 3 fits exactly
    assert batch.fit(3, "first_fit") == 0
    batch.place(1, Pending(np.arange(3)))
    assert batch.fit(1, "best_fit") == 2  # row 1 holds max_documents=2
    assert batch.fit(7, "best_fit") is None
