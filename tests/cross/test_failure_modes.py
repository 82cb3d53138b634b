"""Inputs that used to be silently wrong or gave obscure errors, each now a clear error: the
leaf's path (or the argument), what was expected, what was found, and the fix. Every test here
failed on the code before these checks (a wrong result, a silent pass, or another message).
"""

import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import torchshard as ts
from torchshard import P
from torchshard.testing import (
    global_batch_loader_per_host,
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    virtual_hosts,
)

KEY = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY
DTYPES = (
    "bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, "
    "complex64, complex128"
)


def _exactly(message):
    return f"^{re.escape(message)}$"


def _no_transfers(monkeypatch, mesh):
    from torchshard._backend.registry import lookup

    transfers = []
    monkeypatch.setattr(lookup(mesh).place, "make_global", lambda *a, **k: transfers.append(a))
    return transfers


# -- hosts that supply the same block must pass the same values (virtual hosts) -------------
SHARED_MESH = np.array([[0, 4], [1, 5], [2, 6], [3, 7]])  # hosts 0 and 2 hold the same rows


@pytest.mark.xla
def test_hosts_sharing_shards_must_agree_on_values(monkeypatch):
    mesh = ts.Mesh(SHARED_MESH, ("data", "model"))
    blocks = [{"x": np.full((4, 2), h, np.float32)} for h in range(4)]
    message = (
        "per_host_arrays[2]['x']: hosts 0 and 2 supply the same block [0:2, 0:2] of this leaf "
        "under P('data',) (devices [0] take host 0's values, devices [4] host 2's), so they must "
        "pass equal values for it, but they differ: at global index (0, 0) host 0 has 0.0 and "
        "host 2 has 2.0. Pass the same values on every host that shares a block (every host, for "
        "a replicated leaf), or use a spec under which each host feeds its own rows (e.g. "
        "torchshard.input_partition_spec())."
    )
    with virtual_hosts(4), mesh:
        transfers = _no_transfers(monkeypatch, mesh)
        with pytest.raises(ts.ShardingError, match=_exactly(message)):
            host_to_global_array_per_host(blocks, partition=P("data"))
        assert transfers == []


@pytest.mark.xla
def test_hosts_sharing_shards_with_equal_values_assemble():
    """The same mesh with hosts 0/2 and 1/3 passing the same rows: the global array is every
    host's rows once, and each host reads back its block."""
    mesh = ts.Mesh(SHARED_MESH, ("data", "model"))
    rows = [np.arange(8.0).reshape(4, 2), np.arange(8.0, 16.0).reshape(4, 2)]
    with virtual_hosts(4), mesh:
        for _ in range(2):  # the second call takes the cached plan: still checked, same result
            g = host_to_global_array_per_host([rows[h % 2] for h in range(4)], partition=P("data"))
            np.testing.assert_array_equal(g.cpu().numpy(), np.concatenate(rows))
        back = global_to_host_array_per_host(g)
        for h in range(4):
            np.testing.assert_array_equal(back[h].numpy(), rows[h % 2])
        bad = [rows[h % 2] for h in range(4)]
        bad[3] = bad[3].copy()
        bad[3][3, 1] = -1.0
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "per_host_arrays[3]: hosts 1 and 3 supply the same block [6:8, 0:2] of this "
                "leaf under P('data',) (devices [3] take host 1's values, devices [7] host 3's), "
                "so they must pass equal values for it, but they differ: at global index (7, 1) "
                "host 1 has 15.0 and host 3 has -1.0."
            ),
        ):
            host_to_global_array_per_host(bad, partition=P("data"))  # a cached plan


@pytest.mark.parametrize("hosts", [2, 4])
def test_replicated_leaves_must_agree_on_every_host(mesh8, hosts):
    same = np.arange(6.0).reshape(3, 2)
    with virtual_hosts(hosts):
        g = host_to_global_array_per_host([{"w": same}] * hosts, partition=P())
        np.testing.assert_array_equal(g["w"].cpu().numpy(), same)
        other = same.copy()
        other[2, 0] = 99.0
        trees = [{"w": same}] * (hosts - 1) + [{"w": other}]
        with pytest.raises(
            ts.ShardingError,
            match=re.escape(
                f"per_host_arrays[{hosts - 1}]['w']: hosts 0 and {hosts - 1} supply the same "
                "block [0:3, 0:2] of this leaf under P() "
            )
            + ".*"
            + re.escape("at global index (2, 0) host 0 has 4.0 and host"),
        ):
            host_to_global_array_per_host(trees, partition={"w": P()})


def test_nan_equals_nan_in_shared_blocks(mesh8):
    with virtual_hosts(2):
        x = np.array([1.0, np.nan, 3.0])
        g = host_to_global_array_per_host([x, x.copy()], partition=P())
    assert np.isnan(g.cpu().numpy()[1])


def test_each_host_feeding_its_own_rows_is_not_compared(mesh8, monkeypatch):
    """Where no block has two owners there is nothing to compare (the plan says so once)."""
    from torchshard._place import replicas as _engine

    calls = []
    monkeypatch.setattr(_engine, "_differ", lambda *a: calls.append(a))
    with virtual_hosts(2):
        host_to_global_array_per_host([np.zeros(4), np.ones(4)], partition=P("data"))
    assert calls == []


def test_per_host_loader_refuses_disagreeing_replicas(mesh8):
    batches = [[{"w": np.zeros(2)}], [{"w": np.ones(2)}]]
    with virtual_hosts(2):
        loader = global_batch_loader_per_host(batches, partition=P(), prefetch=0)
        with pytest.raises(ts.ShardingError, match=re.escape("host_batches[1]['w']: hosts 0")):
            next(iter(loader))


# -- two InputDispatchers claiming the same physical feed -----------------------------------
def test_dispatchers_claiming_the_same_feed_fail_by_default(mesh8):
    message = (
        f"global_physical_batch[{KEY!r}]: row targets must name every logical index in [0, 4) "
        "exactly once (-1 for padding); 0 targets are out of range and logical indices [0, 1, 2, "
        "3] appear [2, 2, 0, 0] times. Logical index 0 is at physical rows [0, 4]: the feeds "
        "whose blocks hold those rows claim the same logical rows, as two hosts whose "
        "InputDispatchers have the same physical_feed_index do. Give each host its own "
        "physical_feed_index in [0, num_physical_feeds) (the default, process_index(), does)."
    )
    with virtual_hosts(2):
        feeds = [ts.InputDispatcher(4, physical_feed_index=0) for _ in range(2)]
        batches = [
            f.logical_to_physical_batch({"x": np.arange(2) + 10 * h}) for h, f in enumerate(feeds)
        ]
        g = host_to_global_array_per_host(batches, partition=feeds[0].partition_spec)
        with pytest.raises(ts.ShardingError, match=_exactly(message)):
            feeds[0].physical_to_logical_batch(g)
        # check=False opts out (the rows are then wrong, as before)
        out = feeds[0].physical_to_logical_batch(g, check=False)
        assert ts.replicate_to_local_data(out)["x"].tolist()[:2] == [10, 11]


def test_the_default_check_runs_once_per_dispatcher(mesh8, monkeypatch):
    from torchshard._step import input_dispatcher as _input_dispatcher

    seen = []
    real = _input_dispatcher.check_row_targets

    def spy(targets, logical, where):
        seen.append(len(calls))
        return real(targets, logical, where)

    calls = []
    monkeypatch.setattr(_input_dispatcher, "check_row_targets", spy)
    with virtual_hosts(2):
        feeds = [ts.InputDispatcher(4, physical_feed_index=h) for h in range(2)]
        batches = [
            f.logical_to_physical_batch({"x": np.arange(2) + 10 * h}) for h, f in enumerate(feeds)
        ]
        g = host_to_global_array_per_host(batches, partition=feeds[0].partition_spec)
        for _ in range(3):
            out = ts.replicate_to_local_data(feeds[0].physical_to_logical_batch(g))
            assert out["x"].tolist() == [0, 1, 10, 11]
            calls.append(None)
        feeds[0].physical_to_logical_batch(g, check=True)
    assert seen == [0, 3]  # the first call checks, then only the one that asks


# -- SpmdInputDispatcher: batches of another size ---------------------------------------------
def test_spmd_dispatcher_refuses_batches_of_another_size(mesh42):
    d = ts.SpmdInputDispatcher(8, partition_spec=P("data"))
    assert d.logical_to_physical_batch({"x": np.zeros((8, 2))})["x"].shape == (8, 2)
    with pytest.raises(
        ts.ShardingError,
        match=_exactly(
            "logical_feed_batch['x']: dim 0 of every leaf is the feed's batch of this "
            "SpmdInputDispatcher(global_logical_batch_size=8) over 1 feeds; expected 8, got dim "
            "0 of size 6 (shape (6, 2)). Batch feed_logical_batch_size=8 examples per feed, or "
            "make the dispatcher with the batch size the data has."
        ),
    ):
        d.logical_to_physical_batch({"x": np.zeros((6, 2))})
    g = ts.host_to_global_array({"x": np.zeros((16, 2)), "y": [np.zeros(16)]}, partition=P("data"))
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "global_physical_batch['x']: dim 0 of every leaf is the global batch of this "
            "SpmdInputDispatcher(global_logical_batch_size=8) over 1 feeds; expected 8, got dim "
            "0 of size 16 (shape (16, 2))."
        ),
    ):
        d.physical_to_logical_batch(g)
    with pytest.raises(ts.ShardingError, match=re.escape("expected 8, got a scalar (shape ())")):
        d.physical_to_logical_batch({"x": torch.tensor(1.0)})
    with pytest.raises(ts.ShardingError, match=re.escape("logical_feed_shapes['s']: dim 0")):
        d.logical_to_physical_shapes({"s": ts.TensorSpec((4, 2), torch.float32)})


def test_spmd_dispatcher_per_feed_size_under_virtual_hosts(mesh42):
    with virtual_hosts(2, process_index=1):
        d = ts.SpmdInputDispatcher(8, partition_spec=P("data"))
        d.logical_to_physical_batch({"x": np.zeros(4)})
        with pytest.raises(ts.ShardingError, match=re.escape("over 2 feeds; expected 4, got")):
            d.logical_to_physical_batch({"x": np.zeros(8)})


# -- host_to_global_specs / TensorSpec: shapes and dtypes ------------------------------------
class ShapeDtype:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


@pytest.mark.parametrize(
    ("leaf", "error", "message"),
    [
        (
            ShapeDtype((8, -2), torch.float32),
            ValueError,
            "host_specs['x']: every size of a shape must be >= 0, but dim 1 of (8, -2) is -2.",
        ),
        (
            ShapeDtype((8, 2.5), torch.float32),
            TypeError,
            (
                "host_specs['x']: every size of a shape must be an int, but dim 1 of (8, 2.5) is "
                "2.5 of type float (sizes count elements: nothing is rounded); pass one int per "
                "dimension."
            ),
        ),
        (
            ShapeDtype((8,), "float32"),
            TypeError,
            (
                "host_specs['x']: expected a dtype (a torch.dtype, a numpy dtype or a numpy scalar "
                "type), but got 'float32' of type str; write e.g. torch.float32 or "
                "np.dtype('float32')."
            ),
        ),
        (
            ShapeDtype((8,), 5),
            TypeError,
            (
                "host_specs['x']: expected a dtype (a torch.dtype, a numpy dtype or a numpy scalar "
                "type), but got 5 of type int; write e.g. torch.float32 or np.dtype('float32')."
            ),
        ),
        (
            ShapeDtype((8,), torch.float8_e4m3fn),
            TypeError,
            (
                "host_specs['x']: dtype torch.float8_e4m3fn is not supported; "
                f"expected one of {DTYPES}."
            ),
        ),
        (
            ShapeDtype((8,), np.dtype("U3")),
            TypeError,
            (
                f"host_specs['x']: numpy dtype <U3 is not supported; expected one of {DTYPES} "
                "(bfloat16 as a torch.Tensor)."
            ),
        ),
    ],
)
def test_host_to_global_specs_checks_shapes_and_dtypes(mesh8, leaf, error, message):
    with pytest.raises(error, match=_exactly(message)):
        ts.host_to_global_specs({"x": leaf})


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        (
            (8, 2.5),
            TypeError,
            (
                "TensorSpec: every size of a shape must be an int, but dim 1 of (8, 2.5) is 2.5 of "
                "type float (sizes count elements: nothing is rounded); pass one int per dimension."
            ),
        ),
        (
            (True,),
            TypeError,
            (
                "TensorSpec: every size of a shape must be an int, but dim 0 of (True,) is True of "
                "type bool (a bool is not a size); pass (1,) if that is the shape meant."
            ),
        ),
        (
            (4, -1),
            ValueError,
            "TensorSpec: every size of a shape must be >= 0, but dim 1 of (4, -1) is -1.",
        ),
        (
            8,
            TypeError,
            "TensorSpec: expected a shape (a sequence of ints >= 0), but got 8 of type int.",
        ),
    ],
)
def test_tensor_spec_checks_its_shape(shape, error, message):
    with pytest.raises(error, match=_exactly(message)):
        ts.TensorSpec(shape, torch.float32)
    assert ts.TensorSpec(np.array([8, 2]), torch.float32).shape == (8, 2)  # numpy ints are ints


# -- maybe_shard: one spec, never a tree of them ----------------------------------------------
TREE_FIX = (
    "maybe_shard applies one spec to every leaf of x. For a spec per subtree, call maybe_shard "
    "on each subtree, or use with_sharding_constraint(x, spec_tree), which takes a tree prefix "
    "of x whose leaves are PartitionSpecs or None (and raises where a spec cannot apply)."
)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"data": P("data")},
            (
                "spec: expected one PartitionSpec (or a sequence of its entries), but got dict "
                f"{{'data': P('data',)}}. {TREE_FIX}"
            ),
        ),
        (
            (P("data"), P()),
            (
                "spec: expected one PartitionSpec (or a sequence of its entries: None, an axis "
                "name, a tuple of axis names), but got a tuple whose entry 0 is the PartitionSpec "
                f"P('data',), which looks like a tree of specs. {TREE_FIX}"
            ),
        ),
        (
            {"data"},
            (
                "spec: expected one PartitionSpec (or a sequence of its entries), but got set "
                f"{{'data'}}. {TREE_FIX}"
            ),
        ),
        (
            ("data", 3),
            (
                "spec: PartitionSpec entry 1 must be None, an axis name or a tuple of axis names, "
                "but got 3 of type int."
            ),
        ),
    ],
)
def test_maybe_shard_refuses_what_is_not_one_spec(mesh42, spec, message):
    g = ts.host_to_global_array({"data": np.zeros((8, 2))})
    with pytest.raises(TypeError, match=_exactly(message)):
        ts.maybe_shard(g, spec)
    # checked without a mesh too: the mistake is in the program, not in the data
    with ts.Mesh(np.arange(8), ("data",)):
        pass
    with pytest.raises(TypeError, match=_exactly(message)):
        with warnings.catch_warnings():
            ts.maybe_shard({"data": torch.zeros(8)}, spec)


def test_maybe_shard_still_takes_one_spec_in_every_form(mesh42):
    from torchshard.testing import assert_sharded

    g = ts.host_to_global_array({"a": np.zeros((8, 2))}, partition=P())
    for spec in (P("data"), "data", ("data",), ["data", None]):
        assert_sharded(ts.maybe_shard(g, spec)["a"], P("data"))


# -- masked arrays, sparse and named tensors --------------------------------------------------
MASKED = (
    "expected a plain numpy array, but got a numpy masked array, whose mask would be lost (only "
    "its data would move). Pass x.filled(fill_value), and the mask as a leaf of its own "
    "(np.ma.getmaskarray(x)) if the step needs it."
)


def _named():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # named tensors are experimental
        return torch.zeros(8, 2, names=("N", "C"))


def _csr():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sparse CSR is in beta
        return torch.zeros(8, 2).to_sparse_csr()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: np.ma.masked_array(np.arange(8), mask=[0, 1] * 4), MASKED),
        (
            lambda: torch.zeros(8, 2).to_sparse(),
            (
                "expected a dense (strided) tensor, but got a tensor of layout torch.sparse_coo; "
                "global tensors are dense: pass x.to_dense()."
            ),
        ),
        (
            _csr,
            (
                "expected a dense (strided) tensor, but got a tensor of layout torch.sparse_csr; "
                "global tensors are dense: pass x.to_dense()."
            ),
        ),
        (
            _named,
            (
                "expected a tensor without dimension names, but got one named ('N', 'C'); named "
                "tensors are not supported: pass x.rename(None)."
            ),
        ),
    ],
)
def test_leaves_that_would_lose_information(mesh8, make, message):
    leaf = make()
    with pytest.raises(TypeError, match=_exactly(f"host_arrays['x'][1]: {message}")):
        ts.host_to_global_array({"x": [np.zeros(8), leaf]})
    # after calls with a dense leaf of the same shape and dtype (whose plan is kept): the kept
    # plan's fast path must not take the sparse, named or masked leaf as it is
    dense = np.zeros(8, leaf.dtype) if isinstance(leaf, np.ndarray) else torch.zeros(leaf.shape)
    for _ in range(2):
        ts.host_to_global_array({"y": dense})
    with pytest.raises(TypeError, match=_exactly(f"host_arrays['y']: {message}")):
        ts.host_to_global_array({"y": leaf})
    d = ts.InputDispatcher(8, global_physical_batch_size=16, num_physical_feeds=1)
    with pytest.raises(TypeError, match=_exactly(f"logical_feed_batch['x']: {message}")):
        d.logical_to_physical_batch({"x": leaf})


# -- partition= of an unsupported kind --------------------------------------------------------
ACCEPTED = (
    "expected a PartitionSpec (e.g. P('data')), a DataPartitionType, None (replicated), or a "
    "tree prefix of the data (dicts, lists, tuples, namedtuples, dataclasses) whose leaves are "
    "those."
)


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        (
            "data",
            (
                f"partition: Unsupported partition: data (of type str); {ACCEPTED} To split dim 0 "
                "over the mesh axis 'data', write P('data')."
            ),
        ),
        (
            "full",
            (
                f"partition: Unsupported partition: full (of type str); {ACCEPTED} To split dim 0 "
                "over the mesh axis 'full', write P('full'). For the partition type, write "
                "DataPartitionType.FULL."
            ),
        ),
        (0, f"partition: Unsupported partition: 0 (of type int); {ACCEPTED}"),
        (
            {"x": "data"},
            (
                f"partition['x']: Unsupported partition: data (of type str); {ACCEPTED} To split "
                "dim 0 over the mesh axis 'data', write P('data')."
            ),
        ),
    ],
)
def test_unsupported_partition_lists_the_accepted_forms(mesh42, monkeypatch, partition, message):
    transfers = _no_transfers(monkeypatch, mesh42)
    with pytest.raises(ts.errors.UnsupportedPartitionError, match=_exactly(message)):
        ts.host_to_global_array({"x": np.zeros(8)}, partition=partition)
    with pytest.raises(ts.errors.UnsupportedPartitionError, match=_exactly(message)):
        iter(ts.GlobalBatchLoader([{"x": np.zeros(8)}], partition=partition))
    assert transfers == []


# -- virtual_hosts arguments ------------------------------------------------------------------
@pytest.mark.xla
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (
            ("2",),
            {},
            "virtual_hosts: num_hosts must be an int, but got '2' of type str; pass num_hosts=2.",
        ),
        (
            (2.0,),
            {},
            "virtual_hosts: num_hosts must be an int, but got 2.0 of type float; pass num_hosts=2.",
        ),
        (
            (None,),
            {},
            (
                "virtual_hosts: num_hosts must be an int, but got None of type NoneType; pass "
                "num_hosts=<int>."
            ),
        ),
        (
            (2,),
            {"process_index": "1"},
            (
                "virtual_hosts: process_index must be an int, but got '1' of type str; pass "
                "process_index=1."
            ),
        ),
        (
            (True,),
            {},
            "virtual_hosts: num_hosts must be an int, but got True of type bool; pass num_hosts=1.",
        ),
    ],
)
def test_virtual_hosts_arguments(args, kwargs, message):
    with pytest.raises(TypeError, match=_exactly(message)):
        with virtual_hosts(*args, **kwargs):
            pass
    with virtual_hosts(np.int64(2)) as topo:  # a numpy int is an int
        assert topo.process_count == 2


# -- GlobalBatchLoader: one epoch at a time ----------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_later_iter_ends_the_earlier_iterator_loudly(mesh8, prefetch):
    batches = [{"x": np.full(8, i)} for i in range(4)]
    loader = ts.GlobalBatchLoader(batches, prefetch=prefetch)
    first = iter(loader)
    assert next(first)["x"].cpu().tolist() == [0] * 8
    second = iter(loader)
    message = (
        "GlobalBatchLoader: this iterator was ended before batch 1 by a later iter() on the same "
        "loader; a loader runs one epoch at a time, and each iter() starts a new one (the "
        "source's position moves with it). Use the newest iterator, or make a second "
        "GlobalBatchLoader for a second stream."
    )
    with pytest.raises(RuntimeError, match=_exactly(message)):
        next(first)
    with pytest.raises(RuntimeError, match=_exactly(message)):  # every time, not just once
        next(first)
    assert [b["x"].cpu()[0].item() for b in second] == [0, 1, 2, 3]
    loader.close()


def test_finished_or_closed_iterators_still_just_stop(mesh8):
    loader = ts.GlobalBatchLoader([{"x": np.zeros(8)}], prefetch=0)
    done = iter(loader)
    assert len(list(done)) == 1
    again = iter(loader)  # the first one had ended: nothing to complain about
    with pytest.raises(StopIteration):
        next(done)
    loader.close()  # an explicit close stops the current iterator
    with pytest.raises(StopIteration):
        next(again)


def test_a_loop_broken_off_then_restarted(mesh8):
    loader = ts.GlobalBatchLoader([{"x": np.full(8, i)} for i in range(3)], prefetch=1)
    for _ in loader:
        break
    assert [b["x"].cpu()[0].item() for b in loader] == [0, 1, 2]


# -- GlobalBatchLoader.load_state_dict ---------------------------------------------------------
class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {"x": np.full(2, i, np.float32)}


def _stateful_loader(prefetch=0):
    return ts.GlobalBatchLoader(StatefulDataLoader(Rows(), batch_size=8), prefetch=prefetch)


def _entry(saved, **change):
    """``saved`` with process 0's entry changed."""
    return {**saved, "process_0": {**saved["process_0"], **change}}


_KIND = (
    "state_dict: expected a dict from GlobalBatchLoader.state_dict() (keys 'process_<i>' and "
    "'common', with common['loader'] == 'GlobalBatchLoader'), but got "
)
_NEXT = "state_dict['process_0']['next_batch']: expected "


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        (
            lambda saved: [1, 2],
            TypeError,
            (
                "state_dict: expected a dict from GlobalBatchLoader.state_dict() (keys "
                "'process_<i>' and 'common'), but got list."
            ),
        ),
        (
            lambda saved: {"source": {}},
            ValueError,
            _KIND + "keys ['source']. It holds one process's entry ('source'/'sources', "
            "'next_batch'): pass the whole dict that state_dict() returned.",
        ),
        (
            lambda saved: {"_num_yielded": 1, "fetcher_state": None},
            ValueError,
            _KIND + "keys ['_num_yielded', 'fetcher_state']. It is not a GlobalBatchLoader's "
            "state (a source's own state, or another loader's?): pass what "
            "GlobalBatchLoader.state_dict() returned.",
        ),
        (
            lambda saved: {**saved, "common": {**saved["common"], "loader": "StatefulDataLoader"}},
            ValueError,
            _KIND + "keys ['common', 'process_0'].",
        ),
        (
            lambda saved: {**saved, "common": {"loader": "GlobalBatchLoader"}},
            ValueError,
            (
                "state_dict['common']: expected the keys ['consumed', 'epoch', 'hosts', "
                "'loader', 'num_examples', 'processes', 'seed', 'shards', 'shuffle'], but got "
                "['loader']."
            ),
        ),
        (
            lambda saved: {**saved, "common": {**saved["common"], "processes": "1"}},
            TypeError,
            (
                "state_dict['common']['processes']: expected an int (a count, >= 0), but got '1' "
                "of type str."
            ),
        ),
        (
            lambda saved: {
                "process_0": {"sources": [None, None], "next_batch": 0},
                "common": saved["common"],
            },
            ValueError,
            (
                "state_dict['process_0']: expected the keys ['next_batch', 'source'], but got "
                "['next_batch', 'sources']. It is the state of a loader with one source per "
                "host; this loader has 1."
            ),
        ),
        (
            lambda saved: _entry(saved, next_batch="2"),
            TypeError,
            _NEXT + "an int (the index of the next batch of the epoch, >= 0), but got '2' of "
            "type str.",
        ),
        (
            lambda saved: _entry(saved, next_batch=1.5),
            TypeError,
            _NEXT + "an int (the index of the next batch of the epoch, >= 0), but got 1.5 of "
            "type float.",
        ),
        (
            lambda saved: _entry(saved, next_batch=True),
            TypeError,
            _NEXT + "an int (the index of the next batch of the epoch, >= 0), but got True of "
            "type bool.",
        ),
        (
            lambda saved: _entry(saved, next_batch=-1),
            ValueError,
            _NEXT + "the index of the next batch of the epoch, >= 0, but got -1.",
        ),
        (
            lambda saved: _entry(saved, source={"_num_yielded": 1}),
            TypeError,
            (
                "state_dict['process_0']['source']: expected a source's state as "
                "GlobalBatchLoader.state_dict() saved it (bytes, or None), but got dict "
                "{'_num_yielded': 1}."
            ),
        ),
        (
            lambda saved: _entry(saved, source=pickle.dumps({"pos": 3})),
            ValueError,
            (
                "state_dict['process_0']['source']: not a source's state saved by "
                "GlobalBatchLoader.state_dict()."
            ),
        ),
    ],
)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_load_state_dict_refuses_bad_values_before_changing_anything(
    mesh8, state, error, message, prefetch
):
    loader = _stateful_loader(prefetch)
    it = iter(loader)
    next(it)
    saved = loader.state_dict()
    with pytest.raises(error, match=_exactly(message)):
        loader.load_state_dict(state(saved))
    # nothing changed: the epoch goes on, and the position is the one before the call
    assert loader.state_dict() == saved
    assert [b["x"].cpu()[0, 0].item() for b in it] == [8.0, 16.0, 24.0]


def test_load_state_dict_ends_the_running_epoch_loudly(mesh8):
    loader = _stateful_loader()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    next(it)
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match=re.escape("ended before batch 2 by load_state_dict()")):
        next(it)
    assert [b["x"].cpu()[0, 0].item() for b in loader] == [8.0, 16.0, 24.0]


def test_load_state_dict_per_host_sources(mesh8):
    sources = [StatefulDataLoader(Rows(), batch_size=4) for _ in range(2)]
    with virtual_hosts(2):
        loader = global_batch_loader_per_host(sources, prefetch=0)
        state = loader.state_dict()
        with pytest.raises(
            TypeError,
            match=_exactly(
                "state_dict['process_0']['sources']: expected a list with one state per source "
                "(2), but got NoneType."
            ),
        ):
            loader.load_state_dict({**state, "process_0": {"sources": None, "next_batch": 0}})
        with pytest.raises(
            TypeError, match=re.escape("state_dict['process_0']['sources'][1]: expected a source")
        ):
            loader.load_state_dict({**state, "process_0": {"sources": [None, {}], "next_batch": 0}})


def test_plain_dataloader_is_still_refused_as_before(mesh8):
    loader = ts.GlobalBatchLoader(DataLoader(Rows(), batch_size=8))
    with pytest.raises(TypeError, match="has no state_dict"):
        loader.load_state_dict({"source": {}, "next_batch": 0})
