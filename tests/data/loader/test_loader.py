"""GlobalBatchLoader: order, bit-exactness, types, prefetch bound, errors, shutdown, resume."""

import dataclasses
import gc
import re
import time
import traceback
from typing import NamedTuple

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
import torch_xla.distributed.spmd as xs
from data_helpers import (
    FakeDispatcher,
    Rows,
    ids,
    loader_threads,
    no_loader_thread_left,
    save_resume,
    wait_until,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import torchshard as ts
from torchshard.testing import global_batch_loader_per_host, virtual_hosts


def endless():
    i = 0
    while True:
        yield {"id": np.arange(8) + i}
        i += 1


class Pair(NamedTuple):
    x: torch.Tensor
    y: np.ndarray


@dataclasses.dataclass
class Record:
    image: torch.Tensor
    extra: list


def host_batches(n, rows=8):
    out = []
    for i in range(n):
        base = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * i
        out.append(
            {
                "pair": Pair(base, np.arange(rows, dtype=np.int64) + i),
                "tuple": (base.to(torch.bfloat16), (base > 50 * i).numpy()),
                "record": Record(base.to(torch.int8), [base.double()]),
            }
        )
    return out


def assert_same_tree(host, back):
    if not isinstance(host, (np.ndarray, torch.Tensor)):
        assert type(host) is type(back)
    if isinstance(host, dict):
        assert host.keys() == back.keys()
        for k in host:
            assert_same_tree(host[k], back[k])
    elif isinstance(host, (tuple, list)):
        assert len(host) == len(back)
        for a, b in zip(host, back, strict=True):
            assert_same_tree(a, b)
    elif dataclasses.is_dataclass(host):
        for f in dataclasses.fields(host):
            assert_same_tree(getattr(host, f.name), getattr(back, f.name))
    else:
        expected = torch.as_tensor(host)
        assert back.dtype == expected.dtype
        assert torch.equal(back, expected)


def xla_types(host, glob):
    """Same container types all the way down, XLA tensors at the leaves."""
    if isinstance(host, dict):
        return type(glob) is dict and all(xla_types(host[k], glob[k]) for k in host)
    if isinstance(host, (tuple, list)):
        return type(glob) is type(host) and all(
            xla_types(a, b) for a, b in zip(host, glob, strict=True)
        )
    if dataclasses.is_dataclass(host):
        return type(glob) is type(host) and all(
            xla_types(getattr(host, f.name), getattr(glob, f.name))
            for f in dataclasses.fields(host)
        )
    return isinstance(glob, torch.Tensor) and glob.device.type == "xla"


# -- order, values, types -------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(n=st.integers(0, 5), prefetch=st.integers(0, 3))
def test_batches_arrive_in_order_bit_exact_with_types_kept(n, prefetch):
    source = host_batches(n)
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    with mesh, ts.GlobalBatchLoader(source, prefetch=prefetch) as loader:
        out = list(loader)
        assert len(out) == n
        for host, glob in zip(source, out, strict=True):
            assert xla_types(host, glob)
            assert_same_tree(host, ts.global_to_host_array(glob))
    assert no_loader_thread_left()


def test_full_partition_splits_the_batch_over_every_device(mesh42):
    (batch,) = ts.GlobalBatchLoader([{"x": np.arange(16).reshape(8, 2)}])
    assert torch_xla._XLAC._get_xla_sharding_spec(batch["x"]) == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def test_partition_type_is_converted_once_without_warnings(mesh42):
    # pytest turns warnings into errors: a DeprecationWarning per batch would fail here.
    source = [{"x": np.ones((8, 2), np.float32)}] * 3
    out = list(ts.GlobalBatchLoader(source, partition=ts.DataPartitionType.REPLICATED))
    assert [torch_xla._XLAC._get_xla_sharding_spec(b["x"]) for b in out] == ["{replicated}"] * 3
    out = list(ts.GlobalBatchLoader(source, partition=ts.DataPartitionType.FULL))
    assert torch_xla._XLAC._get_xla_sharding_spec(out[0]["x"]) == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def test_dispatcher_runs_per_batch_and_its_spec_is_the_default(mesh42):
    dispatcher = FakeDispatcher(ts.P("data"), add_key=True)
    source = [{"id": np.arange(8) + 8 * i, "x": np.ones((8, 3), np.float32)} for i in range(3)]
    out = list(ts.GlobalBatchLoader(source, dispatcher=dispatcher))
    assert dispatcher.calls == 3
    assert [ids(b) for b in out] == [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    key = "__physical_to_logical_batch_dispatch"
    assert ts.replicate_to_local_data(out[0][key]).tolist() == list(range(8))
    spec = "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert torch_xla._XLAC._get_xla_sharding_spec(out[0]["x"]) == spec


def test_dataloader_with_worker_processes(mesh42):
    source = DataLoader(Rows(64), batch_size=8, num_workers=2)
    with ts.GlobalBatchLoader(source) as loader:
        assert len(loader) == 8
        assert [i for b in loader for i in ids(b)] == list(range(64))
    assert no_loader_thread_left()


# -- the prefetch bound --------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_never_more_than_prefetch_batches_ahead(mesh42, prefetch):
    pulled = []
    dispatcher = FakeDispatcher(ts.P(("data", "model")))

    def source():
        for i in range(10):
            pulled.append(i)
            yield {"id": np.arange(8) + i}

    it = iter(ts.GlobalBatchLoader(source(), dispatcher=dispatcher, prefetch=prefetch))
    for consumed in range(10):
        # Holding batch consumed-1, the loader may have read and transferred (dispatch runs
        # right before the transfer) at most `prefetch` batches beyond it. Let it fill up,
        # then check it stays there.
        limit = min(consumed + prefetch, 10)
        assert wait_until(lambda n=limit: len(pulled) == n and dispatcher.calls == n)
        time.sleep(0.02)
        assert len(pulled) == limit and dispatcher.calls == limit
        assert ids(next(it))[0] == consumed
    assert next(it, None) is None


@pytest.mark.parametrize(("budget_batches", "ahead"), [(1, 1), (2.5, 2), (3, 3), (0.25, 1)])
def test_prefetch_bytes_bounds_the_batches_ahead(mesh42, budget_batches, ahead):
    """Batches of 32 KiB, prefetch 8, a budget of ``budget_batches`` batches' bytes: at most
    ``ahead`` batches are read and transferred beyond the one the consumer holds (one always
    moves, even when a batch alone is over the budget)."""
    pulled = []
    nbytes = 8 * 1024 * 4

    def source():
        for i in range(10):
            pulled.append(i)
            yield {"x": np.full((8, 1024), i, np.float32)}

    loader = ts.GlobalBatchLoader(
        source(), prefetch=8, prefetch_bytes=int(budget_batches * nbytes), partition=ts.P("data")
    )
    it = iter(loader)
    for consumed in range(10):
        limit = min(consumed + ahead, 10)
        assert wait_until(lambda n=limit: len(pulled) == n)
        time.sleep(0.02)
        assert len(pulled) == limit
        assert float(ts.replicate_to_local_data(next(it)["x"])[0, 0]) == consumed
    assert next(it, None) is None
    assert loader.stats.bytes == 10 * nbytes


def test_prefetch_zero_transfers_inside_next(mesh42):
    dispatcher = FakeDispatcher(ts.P("data"))
    it = iter(ts.GlobalBatchLoader([{"id": np.arange(8)}] * 3, dispatcher=dispatcher, prefetch=0))
    assert dispatcher.calls == 0
    next(it)
    assert dispatcher.calls == 1
    assert loader_threads() == []


# -- errors arrive with their batch ----------------------------------------------------------


class SourceError(Exception):
    pass


def failing_source(k):
    for i in range(10):
        if i == k:
            raise SourceError(f"cannot read batch {i}")
        yield {"id": np.arange(8) + i}


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("k", [0, 4])
def test_source_error_reaches_the_consumer_at_that_batch(mesh42, prefetch, k):
    loader = ts.GlobalBatchLoader(failing_source(k), prefetch=prefetch)
    it = iter(loader)
    for i in range(k):
        assert ids(next(it))[0] == i
    with pytest.raises(SourceError, match=f"cannot read batch {k}") as info:
        next(it)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_source" in frames  # the original traceback
    note = info.value.__notes__[-1]
    if prefetch:
        thread = r"'torchshard-loader-\d+'"
        assert re.fullmatch(rf"\(raised in torchshard's thread {thread} at batch {k}\)", note)
    else:
        assert note == f"(raised by GlobalBatchLoader at batch {k})"
    assert next(it, None) is None  # the epoch ended with the error
    assert no_loader_thread_left()


def test_transfer_error_reaches_the_consumer(mesh42):
    it = iter(ts.GlobalBatchLoader([{"id": np.array(["a"] * 8)}], prefetch=2))
    with pytest.raises(TypeError, match=re.escape("batch['id']: numpy dtype <U1 is not")):
        next(it)


def test_dispatcher_error_reaches_the_consumer_at_that_batch(mesh42):
    class Failing(FakeDispatcher):
        def logical_to_physical_batch(self, batch):
            if self.calls == 2:
                raise ValueError("batch['id']: expected 8 rows")
            return super().logical_to_physical_batch(batch)

    it = iter(ts.GlobalBatchLoader([{"id": np.arange(8)}] * 4, dispatcher=Failing()))
    next(it), next(it)
    with pytest.raises(ValueError, match=re.escape("batch['id']: expected 8 rows")) as info:
        next(it)
    assert info.value.__notes__[-1].endswith("at batch 2)")


# -- meshes and hosts ------------------------------------------------------------------------


def test_iter_needs_a_mesh():
    msg = (
        "GlobalBatchLoader: iter() needs a mesh: call it inside `with mesh:` or pass "
        "GlobalBatchLoader(..., mesh=mesh)."
    )
    with pytest.raises(ts.errors.NoMeshError, match=f"^{re.escape(msg)}$"):
        iter(ts.GlobalBatchLoader([]))


def test_mesh_argument_is_used_by_the_thread():
    mesh = ts.Mesh(np.arange(8), ("data",))
    out = list(ts.GlobalBatchLoader([{"id": np.arange(8)}], mesh=mesh, partition=ts.P("data")))
    assert ts.current_mesh() is None
    with mesh:
        assert ids(out[0]) == list(range(8))


def test_the_threads_mesh_does_not_reset_torch_xlas_global_mesh(mesh42):
    before = xs.get_global_mesh()
    assert before is not None
    with ts.GlobalBatchLoader([{"id": np.arange(8)}] * 3) as loader:
        list(loader)
    assert no_loader_thread_left()
    assert xs.get_global_mesh() is before


def test_one_source_under_virtual_hosts_is_refused(mesh42):
    msg = (
        "GlobalBatchLoader inside virtual_hosts(2) has only one host's source; use "
        "torchshard.testing.global_batch_loader_per_host with one source per host."
    )
    with virtual_hosts(2), pytest.raises(ts.ShardingError, match=f"^{re.escape(msg)}$"):
        iter(ts.GlobalBatchLoader([]))


# -- shutdown and epochs ---------------------------------------------------------------------


def test_close_and_context_manager_leave_no_thread(mesh42):
    loader = ts.GlobalBatchLoader(endless(), prefetch=3)
    it = iter(loader)
    next(it)
    assert len(loader_threads()) == 1
    loader.close()
    loader.close()
    assert no_loader_thread_left()
    assert next(it, None) is None
    with ts.GlobalBatchLoader(endless()) as loader:
        next(iter(loader))
    assert no_loader_thread_left()


def test_an_abandoned_iterator_is_collected_and_its_thread_ends(mesh42):
    loader = ts.GlobalBatchLoader(endless(), prefetch=2)
    it = iter(loader)
    next(it)
    assert wait_until(lambda: loader.stats.bytes >= 3 * 64)  # the thread is filling up
    del it
    gc.collect()
    assert no_loader_thread_left()


def _held(inside, release):
    """The first batch at once; then the thread waits inside the source (reading the second)
    until the test releases it."""
    yield {"id": np.arange(8)}
    inside.set()
    assert release.wait(60)
    for i in range(1, 100):
        yield {"id": np.arange(8) + i}


@pytest.mark.parametrize("then", ["close()", "iter()"])
def test_a_break_then_close_or_a_new_iter_does_not_wait_for_the_thread_inside_the_source(
    mesh42, then
):
    """After ``for batch in loader: break`` with the thread held inside the source, ``close()``
    and the next ``iter()`` waited for it (``JOIN_SECONDS``, 10 s, if it stayed there). Now
    they return at once: told to stop, the thread leaves the source when it returns, making
    nothing more (nothing placed: nothing of torch's runs on into the next epoch or the
    interpreter's exit), and the batch it was reading from this one-pass source comes first in
    the next epoch."""
    import threading

    inside, release = threading.Event(), threading.Event()
    loader = ts.GlobalBatchLoader(_held(inside, release), prefetch=2)
    for _batch in loader:
        assert inside.wait(30)  # the thread is reading the next batch, held there
        break
    [abandoned] = loader_threads()  # the iterator is collected: told to stop, still reading
    placed = loader.stats.bytes
    if then == "close()":
        loader.close()
        assert abandoned.is_alive() and not release.is_set()  # returned, the source still held
        release.set()
        assert wait_until(lambda: not abandoned.is_alive())
        assert loader.stats.bytes == placed  # the batch it brought back was not placed
        it = iter(loader)
    else:
        it = iter(loader)  # its thread waits for the old one to leave the source
        assert abandoned.is_alive() and not release.is_set()
        release.set()
    assert [ids(b)[0] for b in it] == list(range(1, 100))  # batch 1 first: nothing lost
    assert not abandoned.is_alive()
    loader.close()
    assert no_loader_thread_left()


def test_a_new_iter_starts_a_new_epoch_and_stops_the_old_thread(mesh42):
    source = DataLoader(Rows(32), batch_size=8)
    loader = ts.GlobalBatchLoader(source)
    first = iter(loader)
    assert ids(next(first)) == list(range(8))
    second = iter(loader)
    with pytest.raises(RuntimeError, match=re.escape("ended before batch 1 by a later iter()")):
        next(first)  # the old epoch is closed, and says so instead of ending silently
    assert [i for b in second for i in ids(b)] == list(range(32))
    assert [i for b in loader for i in ids(b)] == list(range(32))
    assert no_loader_thread_left()


@pytest.mark.parametrize(
    ("kwargs", "error", "msg"),
    [
        ({"prefetch": -1}, ValueError, "prefetch must be an int >= 0, but got -1."),
        ({"prefetch": True}, ValueError, "prefetch must be an int >= 0, but got True."),
        ({"prefetch_bytes": 0}, ValueError, "prefetch_bytes must be a positive int, but got 0."),
        (
            {"prefetch_bytes": 1.5},
            ValueError,
            "prefetch_bytes must be a positive int, but got 1.5.",
        ),
        ({"mesh": "data"}, TypeError, "mesh: expected a torchshard.Mesh or None, but got 'data'."),
        (
            {"dispatcher": object()},
            TypeError,
            (
                "dispatcher: expected an input dispatcher (e.g. torchshard.InputDispatcher, with "
                "logical_to_physical_batch and physical_to_logical_batch), but got object."
            ),
        ),
    ],
)
def test_bad_arguments(kwargs, error, msg):
    with pytest.raises(error, match=f"^{re.escape(msg)}$"):
        ts.GlobalBatchLoader([], **kwargs)


def test_source_must_be_iterable():
    msg = (
        "loader: expected an iterable of host batches (a DataLoader, a list, a generator), but "
        "got int."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(msg)}$"):
        ts.GlobalBatchLoader(3)


# -- checkpointing: one save/resume harness for every stateful kind ---------------------------

ROWS, BATCH = 64, 8
BATCH_BYTES = BATCH * (8 + 3 * 4)


def stateful_single(workers):
    def make(prefetch):
        source = StatefulDataLoader(
            Rows(ROWS),
            batch_size=BATCH,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=workers,
        )
        return ts.GlobalBatchLoader(source, prefetch=prefetch, partition=ts.P("data"))

    return make


def stateful_per_host(hosts):
    def make(prefetch):
        dataset = Rows(ROWS)
        sources = [
            StatefulDataLoader(
                dataset,
                batch_size=BATCH // hosts,
                sampler=ts.host_sampler(dataset, {"num_shards": hosts, "shard_index": h}),
            )
            for h in range(hosts)
        ]
        return global_batch_loader_per_host(sources, prefetch=prefetch, partition=ts.P("data"))

    return make


KINDS = {
    "single": stateful_single(0),
    "single-2-workers": stateful_single(2),
    "2-hosts": stateful_per_host(2),
}


@pytest.mark.parametrize(
    ("kind", "prefetch", "midpoint"),
    [
        ("single", 0, 3),
        ("single", 2, 0),
        ("single", 2, 3),
        ("single", 3, ROWS // BATCH - 1),
        ("single", 2, ROWS // BATCH),
        ("single", 2, "end"),
        ("single-2-workers", 2, 3),
        ("2-hosts", 0, 3),
        ("2-hosts", 3, 3),
        ("2-hosts", 2, "end"),
    ],
)
def test_resume_yields_exactly_the_batches_not_taken(kind, prefetch, midpoint):
    mesh = ts.Mesh(np.arange(8), ("data",))
    with mesh:
        if kind == "2-hosts":
            with virtual_hosts(2):
                save_resume(
                    KINDS[kind], midpoint=midpoint, prefetch=prefetch, batch_bytes=BATCH_BYTES
                )
        else:
            save_resume(KINDS[kind], midpoint=midpoint, prefetch=prefetch, batch_bytes=BATCH_BYTES)


def test_state_before_iterating_asks_nothing_of_the_source(mesh42):
    class Watched(StatefulDataLoader):
        asked = 0

        def state_dict(self):
            Watched.asked += 1
            return super().state_dict()

    source = Watched(Rows(16), batch_size=8)
    loader = ts.GlobalBatchLoader(source)
    state = loader.state_dict()
    assert Watched.asked == 0  # a fresh source is not asked (torchdata.nodes would be disturbed)
    assert state["process_0"] == {"source": None, "next_batch": 0}
    assert state["common"]["loader"] == "GlobalBatchLoader"
    assert (state["common"]["processes"], state["common"]["hosts"]) == (1, 1)
    loader.load_state_dict(state)  # a new pass
    assert [i for b in loader for i in ids(b)] == list(range(16))


def test_state_needs_a_stateful_source(mesh42):
    loader = ts.GlobalBatchLoader(DataLoader(Rows(16), batch_size=8))
    msg = (
        "GlobalBatchLoader.state_dict: the source (DataLoader) has no state_dict()/"
        "load_state_dict() (nor get_state()/set_state()) and reads no torchshard.host_sampler; "
        "use torchdata.stateful_dataloader.StatefulDataLoader to checkpoint the input position."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(msg)}$"):
        loader.state_dict()


def test_load_state_checks_its_keys(mesh42):
    loader = ts.GlobalBatchLoader(StatefulDataLoader(Rows(16), batch_size=8))
    msg = (
        "state_dict: expected a dict from GlobalBatchLoader.state_dict() (keys 'process_<i>' and "
        "'common', with common['loader'] == 'GlobalBatchLoader'), but got keys ['sources']. It "
        "holds one process's entry ('source'/'sources', 'next_batch'): pass the whole dict that "
        "state_dict() returned."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        loader.load_state_dict({"sources": []})


def test_public_names():
    for name in ts.data.__all__:
        assert getattr(ts.data, name) is not None
    assert ts.GlobalBatchLoader is ts.data.GlobalBatchLoader
    assert ts.host_sampler is ts.data.host_sampler
    assert ts.sharded_collate is ts.data.sharded_collate
    assert sorted(ts.__all__) == ts.__all__
    assert all(hasattr(ts, name) for name in ts.__all__)


def test_an_ordereddict_batch_with_a_dict_partition_is_matched_by_key(mesh42):
    """A DataLoader's default_collate keeps the dataset's mapping type: an OrderedDict(b=...,
    a=...) batch with the partition written as a literal dict gave ``a`` the spec of ``b``."""
    import collections

    from sharding_oracle import assert_sharded_as

    dataset = [
        collections.OrderedDict(b=np.full(2, i, np.float32), a=np.full(3, i, np.int32))
        for i in range(16)
    ]
    source = DataLoader(dataset, batch_size=8)
    loader = ts.GlobalBatchLoader(source, partition={"a": ts.P(), "b": ts.P(("data", "model"))})
    batches = list(loader)
    assert len(batches) == 2
    for k, batch in enumerate(batches):
        assert type(batch) is collections.OrderedDict and list(batch) == ["b", "a"]
        assert_sharded_as(batch["a"], mesh42, ts.P())
        assert_sharded_as(batch["b"], mesh42, ts.P(("data", "model")))
        host = ts.global_to_host_array(batch)
        np.testing.assert_array_equal(host["a"][:, 0], np.arange(8 * k, 8 * k + 8))


@pytest.mark.parametrize("how", ["copy.copy", "copy.deepcopy", "pickle.dumps"])
@pytest.mark.parametrize("what", ["loader", "iterator", "local iterator", "in a dict"])
def test_copies_mid_epoch_are_refused_with_the_way_to_clone_the_position(mesh8, what, how):
    """``copy.deepcopy`` of a loader's iterator mid-epoch failed on a lock ("cannot pickle
    '_thread.lock'"), as did pickling; ``copy.copy`` of the loader or of its iterator gave an
    object sharing the thread, the counters and the cursor with the original (each ``next()``
    of either moved both). Every copy is now refused, naming the call and the way to clone the
    position, and the refusal changes nothing."""
    import copy
    import pickle

    loader = ts.GlobalBatchLoader(
        [{"id": np.arange(8) + i} for i in range(3)], local=what == "local iterator"
    )
    it = iter(loader)
    next(it)
    obj = {
        "loader": loader,
        "iterator": it,
        "local iterator": it,
        "in a dict": {"train": loader},
    }[what]
    copier = {"copy.copy": copy.copy, "copy.deepcopy": copy.deepcopy, "pickle.dumps": pickle.dumps}
    name = (
        "a GlobalBatchLoader"
        if what in ("loader", "in a dict")
        else "an iterator of a GlobalBatchLoader"
    )
    if what == "in a dict" and how == "copy.copy":
        name = None  # a shallow copy of the dict shares the loader: nothing to refuse
    msg = (
        f"{how} of {name} is not supported: it holds the source's iterator (DataLoader "
        "workers), a thread and locks, which a copy would share or lose, and with them the "
        "position in the source. To clone the position, take loader.state_dict() and load it "
        "into a new GlobalBatchLoader over a new source (load_state_dict()); for a second "
        "stream over the same data, make a second GlobalBatchLoader."
    )
    if name is None:
        assert copier[how](obj)["train"] is loader
    else:
        with pytest.raises(TypeError, match=f"^{re.escape(msg)}$"):
            copier[how](obj)
    batch = next(it)  # unchanged: the epoch goes on
    assert ts.replicate_to_local_data(batch["id"]).tolist() == list(range(1, 9))
    loader.close()


def _blocked_source(entered, release, returned):
    """Two batches, then a source blocked until ``release`` (a slow dataset, a stuck worker)."""
    yield {"x": np.zeros((8, 2), np.float32)}
    yield {"x": np.ones((8, 2), np.float32)}
    entered.set()
    release.wait(60)
    returned.set()


@pytest.mark.parametrize("how", ["close(timeout=0)", "KeyboardInterrupt in with"])
def test_close_need_not_wait_for_a_thread_blocked_in_the_source(mesh8, how, caplog):
    """Before, ``close()`` after Ctrl-C waited 10 s for a thread blocked in the source, and
    there was no way to say not to. ``close(timeout=0)`` and leaving a ``with`` block by
    ``KeyboardInterrupt`` return while the source is still blocked; the thread ends when the
    source returns."""
    import threading

    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    source = _blocked_source(entered, release, returned)
    loader = ts.GlobalBatchLoader(source, partition=ts.P("data"), prefetch=2)
    with mesh8:
        if how == "close(timeout=0)":
            it = iter(loader)
            next(it)
            assert entered.wait(30)  # the loader's thread is inside the source
            loader.close(timeout=0)
        else:
            with pytest.raises(KeyboardInterrupt), loader:
                it = iter(loader)
                next(it)
                assert entered.wait(30)
                raise KeyboardInterrupt
    assert not returned.is_set()  # close returned while the source was still blocked ...
    assert "did not stop within" not in caplog.text  # ... without waiting for it (was: 10 s)
    with pytest.raises(StopIteration):
        next(it)  # closed: it just stops
    release.set()
    assert returned.wait(30)
    assert wait_until(no_loader_thread_left)


def test_close_from_another_thread_stops_a_consumer_waiting_on_a_held_source(mesh8, monkeypatch):
    """The consumer waits in ``next()`` for a batch held in ``__getitem__``; another thread
    calls ``close(timeout=0)``. The consumer then waited ``JOIN_SECONDS`` (10 s) in its own
    close of the epoch, and ended the epoch as if the source had: ``state_dict()`` went back to
    the start of the pass. Now its ``next()`` stops at once and the position stays after the
    batch it took. ``JOIN_SECONDS`` is an hour here: a wait hangs the consumer (guard: 60 s)."""
    import threading

    from torchshard.data._loader import prefetch

    monkeypatch.setattr(prefetch, "JOIN_SECONDS", 3600.0)
    entered, release = threading.Event(), threading.Event()

    class Held(Rows):
        def __getitem__(self, i):
            if i >= 8:  # the second batch is held until the test releases it
                entered.set()
                release.wait(60)
            return super().__getitem__(i)

    loader = ts.GlobalBatchLoader(StatefulDataLoader(Held(32), batch_size=8), prefetch=2)
    it = iter(loader)
    assert ids(next(it)) == list(range(8))
    assert entered.wait(30)
    out = []
    consumer = threading.Thread(target=lambda: out.append(next(it, "stopped")))
    consumer.start()
    time.sleep(0.2)  # into next()'s wait (not needed for the outcome)
    loader.close(timeout=0)
    consumer.join(60)
    assert out == ["stopped"]
    state = loader.state_dict()
    assert state["process_0"]["next_batch"] == 1  # was 0, the source's state None: a new pass
    release.set()
    loader.load_state_dict(state)
    assert [ids(b)[0] for b in loader] == [8, 16, 24]
    assert no_loader_thread_left()
