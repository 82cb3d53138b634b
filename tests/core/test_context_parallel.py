"""Context parallelism on the host (torchshard._core.context_parallel): ``head_tail_order`` is
the order of torch's own ``context_parallel`` load balancer (its private balancer, through
``_torch_private``, is the oracle), and the recipe (each host reads ``feed_read_config``'s rows
and ``context_parallel_positions``' part of each sequence, feeds ``P("dp", "cp")``) gives every
cp rank exactly the shard torch's ``context_parallel`` keeps, on gloo processes (cp=2 on 2
ranks, dp=2 x cp=2 on 4)."""

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
from torchshard._backend.dtensor._torch_private import context_parallel_indices
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
