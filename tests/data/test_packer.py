"""``torchshard.data.Packer`` (torchshard.data._packer): batches of packed rows equal to the
plain-Python reference (every method, a bound on documents per row, documents padded to a
multiple; lengths drawn by hypothesis) and to grain's own packers where grain is installed (its
first fit and best fit without shuffled bins, its concat-then-split); resumable at every batch
(documents read again and skipped, or a stateful source's own position), alone and inside a
``GlobalBatchLoader``'s snapshot (a resumed job packs the same rows); clear errors for bad
documents and states; and the loader's refusal of a packer whose rows the partition would cut
along the sequence as they come."""

from __future__ import annotations

import importlib.util
import pickle
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from packing_reference import reference_arrays, reference_rows
from strategies import SETTINGS

import torchshard as ts
from torchshard.data import Packer

KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
GRAIN = importlib.util.find_spec("grain") is not None
NO_GRAIN = "grain is not installed (pip install grain==0.2.18): the reference alone checks packing"


def documents(lengths, seed=0, dtype=np.int32):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50_000, n).astype(dtype) for n in lengths]


def lognormal_lengths(n, seq_len, seed=0):
    """Lengths log-normal around ~1.5k tokens, cut at seq_len."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1500), 0.8, n).astype(int), 1, seq_len).tolist()


def as_lists(batch):
    return {k: batch[k].astype(np.int64).tolist() for k in KEYS}


@st.composite
def cases(draw):
    multiple = draw(st.sampled_from([1, 1, 2, 4]))
    seq_len = multiple * draw(st.integers(1, 10))
    method = draw(st.sampled_from(["best_fit", "first_fit", "concat_split"]))
    top = seq_len if method != "concat_split" else 3 * seq_len
    lengths = draw(st.lists(st.integers(0, top), max_size=25))
    if method != "concat_split":
        lengths = [n for n in lengths if -(-n // multiple) * multiple <= seq_len]
    return {
        "lengths": lengths,
        "seq_len": seq_len,
        "rows": draw(st.integers(1, 4)),
        "method": method,
        "max_documents": draw(st.none() | st.integers(1, 3)),
        "pad_to_multiple_of": multiple,
        "pad_id": draw(st.sampled_from([0, 7])),
    }


def make(case, docs=None):
    kw = {k: v for k, v in case.items() if k != "lengths"}
    return Packer(documents(case["lengths"]) if docs is None else docs, **kw)


@SETTINGS
@given(cases())
def test_batches_equal_the_reference(case):
    docs = documents(case["lengths"])
    got = list(make(case, docs))
    expected = reference_rows(
        [d.tolist() for d in docs],
        case["seq_len"],
        case["rows"],
        case["method"],
        case["max_documents"],
        case["pad_to_multiple_of"],
    )
    assert [as_lists(b) for b in got] == [
        reference_arrays(e, case["seq_len"], case["pad_id"]) for e in expected
    ]
    for b in got:
        assert b["tokens"].dtype == np.int32 and b["segment_ids"].dtype == np.int32
        assert b["positions"].dtype == np.int32 and b["loss_mask"].dtype == bool
        assert all(b[k].shape == (case["rows"], case["seq_len"]) for k in KEYS)
        if case["max_documents"]:
            assert b["segment_ids"].max(initial=0) <= case["max_documents"]
        assert not b["loss_mask"][b["segment_ids"] == 0].any()  # no loss on padding


@SETTINGS
@given(cases(), st.data())
def test_a_resumed_packer_packs_the_same_rows(case, data):
    whole = [as_lists(b) for b in make(case)]
    cut = data.draw(st.integers(0, len(whole)))
    first = make(case)
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = pickle.loads(pickle.dumps(first.state_dict()))  # as a checkpoint keeps it
    resumed = make(case)
    resumed.load_state_dict(state)
    assert [as_lists(b) for b in resumed] == whole[cut:]
    assert [as_lists(b) for b in resumed] == whole  # the next epoch starts over


class Stream:
    """A stateful stream of documents (its position saved by state_dict), which counts how
    many documents it was asked for."""

    def __init__(self, docs):
        self.docs, self.at, self.asked = docs, 0, 0

    def __iter__(self):
        while self.at < len(self.docs):
            self.at += 1
            self.asked += 1
            yield self.docs[self.at - 1]
        self.at = 0

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


@pytest.mark.parametrize("method", ["best_fit", "first_fit", "concat_split"])
def test_a_stateful_source_resumes_from_its_own_position(method):
    docs = documents(lognormal_lengths(200, 4096, seed=1))
    whole = [as_lists(b) for b in Packer(docs, seq_len=4096, rows=4, method=method)]
    first = Packer(Stream(docs), seq_len=4096, rows=4, method=method)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    assert state["documents"]["at"] == state["documents_read"]
    source = Stream(docs)
    resumed = Packer(source, seq_len=4096, rows=4, method=method)
    resumed.load_state_dict(state)
    assert [as_lists(b) for b in resumed] == whole[3:]
    assert source.asked == len(docs) - state["documents_read"]  # nothing read twice


def test_the_issues_methods_on_a_realistic_distribution():
    docs = documents(lognormal_lengths(2000, 8192))
    tokens = sum(len(d) for d in docs)
    padding = {}
    for method in ("best_fit", "first_fit", "concat_split"):
        batches = list(Packer(docs, seq_len=8192, rows=8, method=method))
        packed = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches])
        assert len(packed) == tokens  # nothing dropped, nothing repeated
        if method != "concat_split":  # documents whole and in their rows' order
            assert np.array_equal(np.sort(packed), np.sort(np.concatenate(docs)))
        real = sum(int((b["segment_ids"] > 0).sum()) for b in batches[:-1])
        padding[method] = 1 - real / (8192 * 8 * (len(batches) - 1))
    assert padding["concat_split"] == 0
    assert padding["best_fit"] <= padding["first_fit"]


def test_documents_are_checked_and_named():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Packer(method='best_fit'): documents[1] has 9 tokens, more than a row of "
            "seq_len=8, and best_fit keeps documents whole. Truncate or split the documents to 8 "
            "tokens before packing (e.g. (d[:8] for d in documents)), or use "
            "method='concat_split', which splits them where a row ends."
        ),
    ):
        list(Packer([np.arange(3), np.arange(9)], seq_len=8, rows=2))
    with pytest.raises(ValueError, match=re.escape("documents[0] has 7 tokens (8 padded to a")):
        list(Packer([np.arange(7)], seq_len=4, rows=2, pad_to_multiple_of=4))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Packer: documents[0] must be a 1-D array of integer tokens, but got shape (2, 2) "
            "and dtype int64."
        ),
    ):
        list(Packer([np.zeros((2, 2), np.int64)], seq_len=8, rows=2))
    with pytest.raises(ValueError, match=re.escape("but got shape (3,) and dtype float64")):
        list(Packer([[1.0, 2.0, 3.0]], seq_len=8, rows=2))
    with pytest.raises(ValueError, match=re.escape("Packer: method must be one of 'best_fit'")):
        Packer([], seq_len=8, rows=2, method="greedy")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Packer: seq_len 10 is not a multiple of pad_to_multiple_of 4: the row's end would "
            "be padding of another length. Pass a seq_len that is a multiple of 4 (e.g. 12)."
        ),
    ):
        Packer([], seq_len=10, rows=2, pad_to_multiple_of=4)
    with pytest.raises(ValueError, match=re.escape("Packer: rows must be a positive int")):
        Packer([], seq_len=8, rows=0)
    with pytest.raises(TypeError, match=re.escape("Packer: documents must be an iterable")):
        Packer(3, seq_len=8, rows=2)
    with pytest.raises(TypeError, match=re.escape("Packer: pad_id must be an int, but got 0.5")):
        Packer([], seq_len=8, rows=2, pad_id=0.5)
    # torch tensors and lists are documents too; empty ones are skipped
    import torch

    batch = next(iter(Packer([torch.arange(1, 4), [], [5, 6]], seq_len=8, rows=1)))
    assert batch["tokens"].tolist() == [[1, 2, 3, 5, 6, 0, 0, 0]]


def test_states_are_checked_before_anything_changes():
    packer = Packer([np.arange(4)] * 4, seq_len=8, rows=1)
    with pytest.raises(TypeError, match=re.escape("Packer.load_state_dict: expected a dict")):
        packer.load_state_dict([1])
    with pytest.raises(ValueError, match=re.escape("state is missing ['pending', 'pending_pad']")):
        packer.load_state_dict({"batches": 1, "documents_read": 2})
    bad = {"batches": 1, "documents_read": -2, "pending": None, "pending_pad": 0}
    with pytest.raises(
        ValueError, match=re.escape("state['documents_read'] must be an int >= 0, but got -2.")
    ):
        packer.load_state_dict(bad)
    assert [b["tokens"].tolist() for b in packer] == [[[0, 1, 2, 3, 0, 1, 2, 3]]] * 2
    one_shot = Packer(iter([np.arange(4)] * 4), seq_len=8, rows=1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Packer.load_state_dict: documents (list_iterator) is an iterator that cannot start "
            "over and saves no position (no state_dict), so the 2 documents read before cannot "
            "be skipped."
        ),
    ):
        one_shot.load_state_dict({**bad, "documents_read": 2})
    fewer = Packer([np.arange(4)], seq_len=8, rows=1)
    fewer.load_state_dict({**bad, "documents_read": 3})
    with pytest.raises(ValueError, match=re.escape("now hold only 1: they are not the documents")):
        list(fewer)


def test_set_epoch_reaches_the_documents():
    class Epochs(list):
        epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

    docs = Epochs([np.arange(3)])
    Packer(docs, seq_len=4, rows=1).set_epoch(3)
    assert docs.epoch == 3
    with pytest.raises(TypeError, match=re.escape("Packer.set_epoch(1): documents (list) has no")):
        Packer([np.arange(3)], seq_len=4, rows=1).set_epoch(1)


# -- grain's packers, the oracle ---------------------------------------------------------------


def grain_rows(docs, seq_len, rows, method, max_documents):
    import grain

    ds = grain.MapDataset.source([{"tokens": d} for d in docs]).to_iter_dataset()
    length = {"tokens": seq_len}
    if method == "concat_split":
        packed = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=length)
    else:
        cls = {
            "first_fit": grain.experimental.FirstFitPackIterDataset,
            "best_fit": grain.experimental.BestFitPackIterDataset,
        }[method]
        packed = cls(
            ds,
            length_struct=length,
            num_packing_bins=rows,
            shuffle_bins=False,
            max_sequences_per_bin=max_documents,
        )
    return list(packed)


@pytest.mark.skipif(not GRAIN, reason=NO_GRAIN)
@pytest.mark.parametrize(
    ("method", "max_documents"),
    [
        ("best_fit", None),
        ("first_fit", None),
        ("best_fit", 3),
        ("first_fit", 2),
        ("concat_split", None),
    ],
)
def test_rows_equal_grains(method, max_documents):
    seq_len, rows = 2048, 4
    docs = documents(lognormal_lengths(300, seq_len, seed=2), dtype=np.int64)
    ours = list(
        Packer(docs, seq_len=seq_len, rows=rows, method=method, max_documents=max_documents)
    )
    theirs = grain_rows(docs, seq_len, rows, method, max_documents)
    flat = [{k: b[k][r] for k in KEYS} for b in ours for r in range(rows)]
    assert len(theirs) <= len(flat) < len(theirs) + rows  # our last batch is filled up
    for i, g in enumerate(theirs):
        assert np.array_equal(flat[i]["tokens"], g["tokens"]), i
        assert np.array_equal(flat[i]["segment_ids"], g["tokens_segment_ids"]), i
        assert np.array_equal(flat[i]["positions"], g["tokens_positions"]), i
    for extra in flat[len(theirs) :]:  # rows of padding
        assert not extra["segment_ids"].any()


@pytest.mark.skipif(not GRAIN, reason=NO_GRAIN)
@SETTINGS
@given(cases())
def test_rows_equal_grains_over_drawn_lengths(case):
    if (
        case["pad_to_multiple_of"] != 1
        or case["pad_id"]
        or (case["method"] == "concat_split" and case["max_documents"])
    ):  # grain pads between documents, with another id; its concat-then-split has no bound
        case = {**case, "pad_to_multiple_of": 1, "pad_id": 0, "max_documents": None}
        case["lengths"] = [
            n for n in case["lengths"] if case["method"] == "concat_split" or n <= case["seq_len"]
        ]
    docs = [d for d in documents(case["lengths"], dtype=np.int64) if len(d)]
    ours = list(make(case, docs))
    theirs = grain_rows(docs, case["seq_len"], case["rows"], case["method"], case["max_documents"])
    flat = [b[k][r] for b in ours for r in range(case["rows"]) for k in ("segment_ids",)]
    tokens = [b["tokens"][r] for b in ours for r in range(case["rows"])]
    assert len(theirs) <= len(flat)
    for i, g in enumerate(theirs):
        assert np.array_equal(tokens[i], g["tokens"]) and np.array_equal(
            flat[i], g["tokens_segment_ids"]
        )
    assert not any(f.any() for f in flat[len(theirs) :])


# -- inside a GlobalBatchLoader ----------------------------------------------------------------


@pytest.mark.xla  # a loader on torch_xla's emulated devices (the gloo example covers DTensor)
@pytest.mark.parametrize(("prefetch", "cut"), [(0, 2), (2, 3)])
def test_a_resumed_loader_packs_the_same_rows(prefetch, cut):
    docs = documents(lognormal_lengths(400, 4096, seed=3))
    mesh = ts.Mesh(np.arange(8), ("data",))

    def loader():
        packer = Packer(docs, seq_len=4096, rows=8, method="best_fit")
        return ts.data.GlobalBatchLoader(packer, partition=ts.P("data"), prefetch=prefetch)

    with mesh:
        whole = [{k: v.cpu().numpy() for k, v in b.items()} for b in loader()]
        first = loader()
        it = iter(first)
        for _ in range(cut):
            next(it)
        state = first.state_dict()
        first.close()
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [{k: v.cpu().numpy() for k, v in b.items()} for b in resumed]
    assert len(rest) == len(whole) - cut > 0
    for a, b in zip(rest, whole[cut:], strict=True):
        for k in KEYS:
            assert np.array_equal(a[k], b[k]), k


@pytest.mark.xla
def test_a_packer_cut_along_the_sequence_is_refused():
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("dp", "cp"))
    packer = Packer(documents([5, 6, 7]), seq_len=16, rows=8)
    with mesh:
        by_key = {k: ts.P("dp") for k in KEYS} | {"segment_ids": ts.P("dp", "cp")}
        for partition in (ts.P("dp", "cp"), by_key):
            loader = ts.data.GlobalBatchLoader(packer, partition=partition)
            leaf = "batch['segment_ids']" if isinstance(partition, dict) else "batch['loss_mask']"
            with pytest.raises(
                ts.ShardingError,
                match=re.escape(
                    "GlobalBatchLoader: the source is a torchshard.data.Packer, and partition "
                    f"P('dp', 'cp') splits {leaf} (shape [rows, seq_len] = [8, 16]) "
                    "along dim 1 into 2 context-parallel shards as the rows come, a layout that "
                    "ignores their documents"
                ),
            ):
                iter(loader)
        # rows whole (dim 0 only): fine
        assert len(list(ts.data.GlobalBatchLoader(packer, partition=ts.P(("dp", "cp"))))) == 1
