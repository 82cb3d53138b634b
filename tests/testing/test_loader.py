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


@pytest.mark.xla  # two XLA meshes of virtual hosts, one per thread
@pytest.mark.parametrize("prefetch", [0, 2])
def test_loaders_of_two_threads_each_see_their_own_hosts(prefetch):
    """Two threads emulating 2 and 4 hosts at once, each with its loader (made, iterated and
    prefetched in its own thread): each loader's thread sees the hosts of the thread that
    started its epoch (before: the emulation was process-wide, so the two clashed)."""
    import threading

    got, errors = {}, []
    both = threading.Barrier(2, timeout=30)

    def run(hosts):
        try:
            sources = [
                [{"id": np.full(8 // hosts, h + 10 * k)} for k in range(2)] for h in range(hosts)
            ]
            with virtual_hosts(hosts), ts.Mesh(np.arange(8), ("data",)):
                loader = global_batch_loader_per_host(
                    sources, partition=ts.P("data"), prefetch=prefetch
                )
                it = iter(loader)
                both.wait()  # both emulations and both epochs are live from here
                got[hosts] = [ts.replicate_to_local_data(b["id"]).tolist() for b in it]
                both.wait()
        except BaseException as e:  # noqa: BLE001 -- reported below, in the test's thread
            both.abort()
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,), name=f"hosts-{n}") for n in (2, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == {
        2: [[0] * 4 + [1] * 4, [10] * 4 + [11] * 4],
        4: [[0, 0, 1, 1, 2, 2, 3, 3], [10, 10, 11, 11, 12, 12, 13, 13]],
    }
    assert no_loader_thread_left()
