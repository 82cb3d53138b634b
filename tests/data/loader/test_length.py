"""``len(GlobalBatchLoader)`` (torchshard.data._loader.length): the batches the loop yields under
every ``last_batch`` policy, the same on every process: each source's count (a DataLoader's
batches and whole batches against torch's own DataLoader as the oracle; a list's batches), the
longest under "pad", the fewest whole under "drop"; on virtual hosts and on real gloo processes
whose sources differ in length (the counts exchanged); refused, saying why, where the length
cannot be known."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset

import torchshard as ts
from torchshard._core.verdict import Verdict
from torchshard.data._loader import length
from torchshard.data._loader.length import Count, epoch_length
from torchshard.testing import global_batch_loader_per_host, virtual_hosts

CASES = "_loader_cases:"


def rows(batch):
    return int(batch["x"].shape[0])


def dataset(n):
    return [{"x": np.full(2, i, np.float32)} for i in range(n)]


def oracle(loader):
    """(batches, whole batches before the first short one: fewer rows than its batch_size) by
    iterating torch's DataLoader."""
    sizes = [len(b["x"]) for b in loader]
    whole = next((i for i, s in enumerate(sizes) if s < loader.batch_size), len(sizes))
    return len(sizes), whole


@given(n=st.integers(0, 40), batch=st.integers(1, 9), drop_last=st.booleans())
def test_a_dataloaders_count_is_what_it_yields(n, batch, drop_last):
    source = DataLoader(dataset(n), batch_size=batch, drop_last=drop_last)
    got = length.count(source, rows)
    assert (got.batches, got.whole) == oracle(source)


def test_a_lists_count_stops_at_its_first_short_batch():
    batches = [{"x": np.zeros((n, 2))} for n in (4, 4, 2, 4)]
    assert length.count(batches, rows) == Count(4, 2, "", "list")
    assert length.count(batches[:2], rows) == Count(2, 2, "", "list")


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        yield from dataset(self.n)


class Sized(Stream):
    def __len__(self):
        return self.n


def test_counts_that_cannot_be_known_say_why():
    assert length.count((x for x in []), rows) == Count(None, None, "has no len()", "generator")
    custom = DataLoader(dataset(8), batch_sampler=[[0, 1, 2], [3, 4]])
    assert length.count(custom, rows) == Count(
        2, None, "has no batch_size to tell a short batch from a whole one", "DataLoader"
    )
    workers = DataLoader(Sized(10), batch_size=4, num_workers=2)
    assert length.count(workers, rows).why == (
        "reads a stream with 2 worker processes, each of which may end on a short batch of its own"
    )
    assert length.count(DataLoader(Sized(10), batch_size=4), rows) == Count(3, 2, "", "DataLoader")
    assert length.count(DataLoader(Stream(10), batch_size=4), rows).batches is None


def where(p, h):
    return f"process {p}'s source"


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=4))
def test_the_policies_lengths(counts):
    """Pad runs to the longest source, drop stops at the fewest whole batches (a simulation of
    the loop over per-source batch sizes: whole ones, then the short last one if any)."""
    every = [[Count(b, min(w, b))] for b, w in counts]
    steps = 0
    while all(steps < c.whole for (c,) in every):  # drop: every source gives a whole batch
        steps += 1
    assert epoch_length("drop", every, where=where) == steps
    assert epoch_length("pad", every, where=where) == max(b for b, _ in counts)
    if len({b for b, _ in counts}) == 1:
        assert epoch_length("error", every, where=where) == counts[0][0]
    else:
        with pytest.raises(ValueError, match=re.escape("the sources yield different numbers")):
            epoch_length("error", every, where=where)


class Checks:
    """A ``ProcessChecks`` stand-in whose exchange returns ``every``."""

    def __init__(self, every):
        self.every = every
        self.calls = []

    def exchange(self, mesh, items, *, what, force):
        self.calls.append((list(items), what, force))
        return None if self.every is None else Verdict.of(self.every)


def test_the_exchange_is_forced_and_parses_every_process_counts():
    mine = [Count(3, 2)]
    checks = Checks(None)
    assert length.exchange(checks, None, mine) == ([mine], ["every process"])
    assert checks.calls == [([Count(3, 2).item()], "GlobalBatchLoader: len()", True)]
    other = Count(2, 1)
    checks = Checks([[Count(3, 2).item()], [other.item()], [Count(3, 2).item()]])
    assert length.exchange(checks, None, mine) == ([mine, [other]], ["processes 0, 2", "process 1"])


# -- the loader, on torch_xla's virtual hosts ---------------------------------------------------


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sizes=st.lists(st.integers(1, 14), min_size=2, max_size=2))
def test_len_is_what_the_per_host_loop_yields(mesh8, sizes):
    """Two hosts with 4 rows each per batch (8 devices): len() equals the steps, pad and drop
    (the mesh is a value the examples only read)."""
    with virtual_hosts(2):
        for policy in ("pad", "drop"):
            sources = [DataLoader(dataset(n), batch_size=4) for n in sizes]
            loader = global_batch_loader_per_host(sources, last_batch=policy, prefetch=0)
            assert len(loader) == sum(1 for _ in loader), (policy, sizes)


def test_len_of_a_per_host_loader_the_issues_case(mesh8):
    """10 and 6 examples, batch 4: 3 and 2 batches; pad yields 3, drop 1, error refuses."""
    with virtual_hosts(2):
        loaders = {
            p: global_batch_loader_per_host(
                [DataLoader(dataset(n), batch_size=4) for n in (10, 6)], last_batch=p
            )
            for p in ("pad", "drop", "error")
        }
        assert (len(loaders["pad"]), len(loaders["drop"])) == (3, 1)
        msg = (
            "len(GlobalBatchLoader(last_batch='error')): the sources yield different numbers of "
            "batches (host 0's source: 3, host 1's source: 2), and the loop raises at the first "
            "batch where they differ."
        )
        with pytest.raises(ValueError, match=re.escape(msg)):
            len(loaders["error"])


def test_len_of_a_list_counts_on_the_leaf_that_holds_the_batch(mesh8):
    """A per-batch table as the first key (not split: P()) does not count; under drop the
    list's short batch ends the epoch."""
    table = np.ones((8, 3), np.float32)
    source = [{"a_table": table, "x": np.zeros((n, 2), np.float32)} for n in (8, 8, 4)]
    partition = {"a_table": ts.P(), "x": ts.P("data")}
    drop = ts.GlobalBatchLoader(source, last_batch="drop", partition=partition)
    assert len(drop) == sum(1 for _ in drop) == 2
    pad = ts.GlobalBatchLoader(source, last_batch="pad", partition=partition)
    assert len(pad) == sum(1 for _ in pad) == 3


def test_len_of_per_host_lists_takes_the_largest_first_batch_as_whole(mesh8):
    """Host 1's only batch is short: drop stops before it (0 batches), pad runs 2."""
    full = {"x": np.ones((4, 2), np.float32)}
    short = {"x": np.ones((2, 2), np.float32)}
    with virtual_hosts(2):
        for policy, steps in (("drop", 0), ("pad", 2)):
            loader = global_batch_loader_per_host([[full, full], [short]], last_batch=policy)
            assert len(loader) == sum(1 for _ in loader) == steps, policy


def test_len_refused_says_why(mesh8):
    with pytest.raises(
        TypeError,
        match=re.escape(
            "len(GlobalBatchLoader): the source (generator) has no len(), so the epoch's length "
            "is not known; iterate without len() (Lightning: an iterable without a length, "
            "sized by max_steps), or give the source a len()."
        ),
    ):
        len(ts.GlobalBatchLoader(x for x in []))
    custom = DataLoader(dataset(8), batch_sampler=[[0, 1, 2], [3, 4]])
    assert len(ts.GlobalBatchLoader(custom)) == 2
    with pytest.raises(
        TypeError,
        match=re.escape(
            "len(GlobalBatchLoader(last_batch='drop')): every process stops at the first short "
            "batch of any source, but the source (DataLoader) has no batch_size to tell a short "
            "batch from a whole one, so where that is is not known before the epoch."
        ),
    ):
        len(ts.GlobalBatchLoader(custom, last_batch="drop"))


# -- gloo processes -----------------------------------------------------------------------------


def test_gloo_len_is_what_every_process_yields(pools):
    """The issue's case on 4 processes (10, 6, 10, 10 examples, batch 4: 3, 2, 3, 3 batches):
    pad yields 3 everywhere, drop 1, and len() says so on every process (also with the
    agreement check off); "error" refuses alike everywhere. Then list sources whose first batch
    is short on one process only: every process raises the same clear error at batch 0, and
    stays in step."""
    results = pools(4).run(CASES + "loader_lengths", sizes=[10, 6, 10, 10])
    for r in results:
        assert r["pad True"] == (3, 3) and r["pad False"] == (3, 3), r
        assert r["drop True"] == (1, 1), r
        message, _ = r["error True"]
        assert message == (
            "ValueError: len(GlobalBatchLoader(last_batch='error')): the sources yield "
            "different numbers of batches (processes 0, 2, 3's source: 3, process 1's source: "
            "2), and the loop raises at the first "
            "batch where they differ. Give every source the same number of batches "
            "(torchshard.host_sampler with drop_last=True), or pass last_batch='pad' (every "
            "process runs to the longest, padding with masked rows) or last_batch='drop' (every "
            "process stops at the shortest)."
        )
        assert r["lists"].startswith(
            "ProcessDisagreementError: GlobalBatchLoader: batch 0: last_batch='pad' needs one "
            "size of a whole batch, but it has 4 on processes 0, 2, 3; 2 on process 1: each "
            "process takes its source's batch_size"
        ), r["lists"]
        assert r["after"] == (4, 2)
    assert len({r["lists"] for r in results}) == 1


def test_len_under_a_mesh_of_one_process_needs_no_exchange(mesh8):
    source = [{"x": torch.zeros(8, 2)}] * 3
    assert len(ts.GlobalBatchLoader(source, last_batch="pad")) == 3
