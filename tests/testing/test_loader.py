"""global_batch_loader_per_host (torchshard.testing._loader): a GlobalBatchLoader that plays
every host of virtual_hosts(n), one source (and dispatcher) per host, assembled as
host_to_global_array_per_host does."""

import re

import numpy as np
import pytest
from data_helpers import FakeDispatcher, no_loader_thread_left

import torchshard as ts
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


def test_per_host_sources_must_match_the_hosts(mesh42):
    msg = (
        "global_batch_loader_per_host: expected one source per host, 4 in all "
        "(virtual_hosts(4) is active), but got 2."
    )
    with virtual_hosts(4), pytest.raises(ts.ShardingError, match=f"^{re.escape(msg)}$"):
        iter(global_batch_loader_per_host([[], []]))


@pytest.mark.parametrize("loaders", [(), [], "ab", iter([[1]]), None])
def test_loaders_must_be_a_non_empty_list(loaders):
    with pytest.raises(
        TypeError,
        match="^"
        + re.escape(
            "loaders: expected a non-empty list with one source per host, but got "
            f"{type(loaders).__name__}."
        )
        + "$",
    ):
        global_batch_loader_per_host(loaders)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_each_step_takes_one_batch_from_every_host(mesh8, prefetch):
    sources = [[{"id": np.arange(4) + 100 * h + 10 * k} for k in range(3)] for h in range(2)]
    with virtual_hosts(2):
        loader = global_batch_loader_per_host(sources, partition=ts.P("data"), prefetch=prefetch)
        assert len(loader) == 3
        got = [ts.replicate_to_local_data(b["id"]).tolist() for b in loader]
    assert got == [
        [*range(10 * k, 10 * k + 4), *range(100 + 10 * k, 104 + 10 * k)] for k in range(3)
    ]
    assert loader.stats.batches == 3 and loader.stats.bytes == 3 * 2 * 4 * 8
    assert no_loader_thread_left()


def test_each_host_has_its_own_dispatcher(mesh8):
    dispatchers = [FakeDispatcher(ts.P("data")) for _ in range(2)]
    sources = [[{"id": np.arange(4)}] * 2, [{"id": np.arange(4)}] * 2]
    with virtual_hosts(2):
        list(global_batch_loader_per_host(sources, dispatchers=dispatchers))
    assert [d.calls for d in dispatchers] == [2, 2]
    with (
        virtual_hosts(2),
        pytest.raises(
            ValueError, match=re.escape("dispatchers: expected one per source (2), but got 1.")
        ),
    ):
        global_batch_loader_per_host(sources, dispatchers=dispatchers[:1])
