"""InputDispatcher (torchshard._step.input_dispatcher): axlearn's tables and validation (ported),
the latent bugs fixed, host-side padding, in-step dispatch on meshes with virtual hosts.
SpmdInputDispatcher is tested in test_spmd_input_dispatcher.py."""

from __future__ import annotations

import collections
import random
import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
from bit_patterns import FLOATS, bits, differing, odd_values
from sharding_oracle import assert_sharded_as

import torchshard as ts
from torchshard.testing import host_to_global_array_per_host, virtual_hosts

P = ts.P
KEY = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY
TensorSpec = ts.TensorSpec


def _concat_feeds(feeds):
    """One host's block when it runs several physical feeds: their batches, concatenated."""
    return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


def _assemble(physical_batches, num_hosts, partition):
    """The global batch from every feed's physical batch, in the given order, as the real
    assembly would build it (one feed per host, or several consecutive feeds per host)."""
    if num_hosts == 1 and len(physical_batches) == 1:
        return ts.host_to_global_array(physical_batches[0], partition=partition)
    per_host = len(physical_batches) // num_hosts
    blocks = [
        _concat_feeds(physical_batches[h * per_host : (h + 1) * per_host]) for h in range(num_hosts)
    ]
    with virtual_hosts(num_hosts):
        return host_to_global_array_per_host(blocks, partition=partition)


@pytest.mark.parametrize("mesh_shape", [(8,), (4, 2)])
@pytest.mark.parametrize(
    ("global_logical", "global_physical", "num_feeds", "logical_feed_indices"),
    [
        # Usually only the logical batch and the feed count are given.
        (8, None, 2, None),
        (2, None, 16, None),
        # An explicit physical batch.
        (8, 16, 2, None),
        # Explicit logical feeds.
        (8, 16, 2, (0,)),
        (8, 16, 4, (1, 3)),
        (2, 16, 16, (7, 11)),
        # feed_logical_batch_size < feed_physical_batch_size.
        (2, 8, 2, (0,)),
        # Only the logical batch: one feed (process_count()), physical = device count.
        (8, None, None, None),
    ],
)
def test_input_dispatcher(
    mesh_shape, global_logical, global_physical, num_feeds, logical_feed_indices
):
    """axlearn's table. Each physical feed is a process; with 1, 2 or 4 feeds each runs on its
    own virtual host. The 8 emulated devices cannot make 16 hosts, so for 16 feeds each of 8
    virtual hosts runs two feeds and passes their batches concatenated (as a host whose loader
    runs two feeds would); the host-side maths is still checked per feed, and the in-step
    dispatch sees the same global batch (16 one-row blocks, in shuffled feed order)."""
    feeds = num_feeds or ts.process_count()
    batches, dispatcher = [], None
    for index in range(feeds):
        dispatcher = ts.InputDispatcher(
            global_logical,
            global_physical_batch_size=global_physical,
            num_physical_feeds=num_feeds,
            physical_feed_index=index,
            logical_feed_indices=logical_feed_indices,
        )
        assert dispatcher.num_physical_feeds == feeds
        if logical_feed_indices is not None:
            assert dispatcher.num_logical_feeds == len(logical_feed_indices)
        fl, fp = dispatcher.feed_logical_batch_size, dispatcher.feed_physical_batch_size
        read = dispatcher.feed_read_config()
        if index in dispatcher.logical_feed_indices:
            assert dispatcher.logical_feed_index is not None
            assert read == {
                "shard_index": dispatcher.logical_feed_index,
                "num_shards": dispatcher.num_logical_feeds,
            }
        else:
            assert dispatcher.logical_feed_index is None
            assert read["num_shards"] == dispatcher.num_logical_feeds
        start = read["shard_index"] * fl
        logical = {"example_index": start + np.arange(fl)}
        physical = dispatcher.logical_to_physical_batch(logical)
        assert physical["example_index"].shape == (fp,)
        shapes = dispatcher.logical_to_physical_shapes(
            {"example_index": TensorSpec((fl,), np.dtype(np.int64))}
        )
        assert shapes == {k: TensorSpec(v.shape, v.dtype) for k, v in physical.items()}
        if KEY in physical:
            targets = physical[KEY]
            if dispatcher.logical_feed_index is not None:
                assert np.count_nonzero(targets >= 0) == fl
                first = dispatcher.logical_feed_index * fl
                assert targets.tolist() == list(range(first, first + fl)) + [-1] * (fp - fl)
                assert physical["example_index"][:fl].tolist() == list(range(start, start + fl))
            else:
                assert targets.tolist() == [-1] * fp
                assert physical["example_index"].tolist() == [0] * fp  # zeroed
        else:
            assert dispatcher.is_identity
        batches.append(physical)

    random.Random(0).shuffle(batches)
    mesh = ts.Mesh(np.arange(8).reshape(mesh_shape), ("data", "model")[: len(mesh_shape)])
    with mesh:
        global_physical_batch = _assemble(batches, min(feeds, 8), dispatcher.partition_spec)
        assert global_physical_batch["example_index"].shape == (
            dispatcher.global_physical_batch_size,
        )
        out = dispatcher.physical_to_logical_batch(global_physical_batch, check=True)
        assert list(out) == ["example_index"]
        assert out["example_index"].shape == (global_logical,)
        values = ts.replicate_to_local_data(out)["example_index"].tolist()
        assert sorted(values) == list(range(global_logical))
        if not dispatcher.is_identity and global_logical % mesh.size == 0:
            # In the step the logical batch is constrained like the input. (For a logical
            # batch that does not divide over the devices, XLA may lay out the step's output
            # differently, e.g. 2 rows replicated.)
            assert_sharded_as(out["example_index"], mesh, P(mesh.axis_names))


def test_logical_order_does_not_depend_on_feed_order(mesh8):
    """The key travels with its rows: whatever order the feeds' blocks land in, the logical
    batch comes out in logical order."""
    make = lambda i: ts.InputDispatcher(  # noqa: E731
        6, num_physical_feeds=4, physical_feed_index=i, logical_feed_indices=(2, 0, 3)
    )
    feeds = []
    for i in range(4):
        d = make(i)
        shard = d.feed_read_config()["shard_index"]
        feeds.append(d.logical_to_physical_batch({"v": 10 * shard + np.arange(2)}))
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        g = _assemble([feeds[i] for i in order], 4, d.partition_spec)
        out = ts.replicate_to_local_data(d.physical_to_logical_batch(g))
        assert out["v"].tolist() == [0, 1, 10, 11, 20, 21]


def test_defaults_follow_virtual_hosts():
    with virtual_hosts(4, process_index=2):
        d = ts.InputDispatcher(8)
    assert (d.num_physical_feeds, d.physical_feed_index) == (4, 2)
    assert d.logical_feed_indices == (0, 1, 2, 3)
    assert (d.feed_logical_batch_size, d.global_physical_batch_size) == (2, 8)
    assert d.is_identity


@pytest.mark.parametrize(
    ("logical", "feeds", "axlearn_physical", "physical"),
    [(10, 2, 10, 16), (12, 4, 12, 16), (3, 1, 8, 8), (6, 2, 8, 8), (2, 4, 8, 8)],
)
def test_default_physical_batch_divides_the_devices(
    mesh8, logical, feeds, axlearn_physical, physical
):
    """axlearn's default, max(feed_logical * feeds, devices), is 10 rows for 2 feeds of 5 on 8
    devices, which cannot be assembled; the default is now the next multiple."""
    d = ts.InputDispatcher(logical, num_physical_feeds=feeds, physical_feed_index=0)
    fl = d.feed_logical_batch_size
    assert max(fl * feeds, 8) == axlearn_physical
    assert d.global_physical_batch_size == physical
    batches = []
    for i in range(feeds):
        d = ts.InputDispatcher(logical, num_physical_feeds=feeds, physical_feed_index=i)
        batches.append(d.logical_to_physical_batch({"x": np.full((fl, 2), i, np.float32)}))
    out = ts.replicate_to_local_data(
        d.physical_to_logical_batch(_assemble(batches, feeds, d.partition_spec))
    )
    expected = np.repeat(np.arange(d.num_logical_feeds, dtype=np.float32), fl)
    assert out["x"][:, 0].tolist() == expected.tolist()
    if axlearn_physical % 8:
        with pytest.raises(
            ts.errors.IndivisibleError,
            match=f"dim 0 has size {axlearn_physical}, not divisible by 8",
        ):
            ts.host_to_global_array({"x": np.zeros(axlearn_physical)})


# -- host side ---------------------------------------------------------------------------
def _dispatcher(**kw):
    args = {"num_physical_feeds": 2, "physical_feed_index": 0, "global_physical_batch_size": 8}
    args.update(kw)
    return ts.InputDispatcher(args.pop("logical", 4), **args)


def test_padding_keeps_leaf_kinds_and_containers():
    Pair = collections.namedtuple("Pair", "a b")
    batch = {
        "np": np.arange(2, dtype=np.float16),
        "t": [torch.ones(2, 3, dtype=torch.bfloat16)],
        "nt": Pair(np.array([True, True]), torch.tensor([7, 8], dtype=torch.int8)),
        "none": None,
    }
    out = _dispatcher().logical_to_physical_batch(batch)
    assert list(out) == ["np", "t", "nt", "none", KEY]
    assert out["none"] is None and type(out["nt"]) is Pair
    assert out["np"].dtype == np.float16 and out["np"].tolist() == [0, 1, 0, 0]
    assert out["t"][0].dtype == torch.bfloat16 and out["t"][0].shape == (4, 3)
    assert out["t"][0][2:].abs().sum() == 0
    assert out["nt"].a.tolist() == [True, True, False, False]
    assert out["nt"].b.tolist() == [7, 8, 0, 0]
    assert isinstance(out[KEY], torch.Tensor) and out[KEY].tolist() == [0, 1, -1, -1]
    assert KEY not in batch and batch["np"].shape == (2,)  # the input is untouched


def test_numpy_leaves_give_a_numpy_key():
    out = _dispatcher(physical_feed_index=1).logical_to_physical_batch({"x": np.arange(2)})
    assert isinstance(out[KEY], np.ndarray) and out[KEY].dtype == np.int64
    assert out[KEY].tolist() == [2, 3, -1, -1]


def test_padding_feed_is_zeroed():
    d = _dispatcher(logical_feed_indices=(1,))
    out = d.logical_to_physical_batch({"x": np.arange(4) + 1})
    assert out["x"].tolist() == [0, 0, 0, 0] and out[KEY].tolist() == [-1] * 4


def test_identity_passes_leaves_through():
    d = ts.InputDispatcher(8, num_physical_feeds=2, physical_feed_index=1)
    batch = {"x": np.arange(4), "y": [torch.arange(4)]}
    out = d.logical_to_physical_batch(batch)
    assert out is not batch and out["y"] is not batch["y"]
    assert out["x"] is batch["x"] and KEY not in out
    assert d.logical_to_physical_shapes({"x": TensorSpec((4, 2), torch.float32)}) == {
        "x": TensorSpec((4, 2), torch.float32)
    }


def test_aot_shapes_include_the_key():
    d = _dispatcher()
    shapes = d.logical_to_physical_shapes(
        {"x": TensorSpec((2, 5), torch.float32), "y": np.zeros((2,), np.int32)}
    )
    assert shapes == {
        "x": TensorSpec((4, 5), torch.float32),
        "y": TensorSpec((4,), np.dtype(np.int32)),
        KEY: TensorSpec((4,), torch.int64),
    }
    real = d.logical_to_physical_batch({"x": torch.zeros(2, 5), "y": np.zeros((2,), np.int32)})
    assert shapes == {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in real.items()}


def test_feed_read_config_spreads_padding_feeds():
    reads = [
        ts.InputDispatcher(
            8,
            global_physical_batch_size=16,
            num_physical_feeds=4,
            physical_feed_index=i,
            logical_feed_indices=(1, 3),
        ).feed_read_config()
        for i in range(4)
    ]
    assert [r["shard_index"] for r in reads] == [0, 0, 1, 1]
    assert {r["num_shards"] for r in reads} == {2}


# -- in step -----------------------------------------------------------------------------
def test_physical_to_logical_does_not_mutate(mesh8):
    d = _dispatcher(logical=2)
    feeds = [
        ts.InputDispatcher(
            2, num_physical_feeds=2, physical_feed_index=i, global_physical_batch_size=8
        ).logical_to_physical_batch({"x": np.arange(1) + i})
        for i in range(2)
    ]
    g = _assemble(feeds, 2, d.partition_spec)
    before = dict(g)
    out = d.physical_to_logical_batch(g)
    assert g == before and KEY in g
    assert ts.replicate_to_local_data(out)["x"].tolist() == [0, 1]


def test_onehot_keys_are_accepted(mesh8):
    """Batches made the axlearn way (a one-hot [P, L] key) dispatch the same."""
    d = _dispatcher(logical=4, num_physical_feeds=1, global_physical_batch_size=8)
    onehot = np.zeros((8, 4), bool)
    onehot[[6, 1, 4, 3], [0, 1, 2, 3]] = True
    g = ts.host_to_global_array({"x": np.arange(8) * 10, KEY: onehot})
    out = ts.replicate_to_local_data(d.physical_to_logical_batch(g, check=True))
    assert out["x"].tolist() == [60, 10, 40, 30]


def test_plain_tensors_without_a_mesh():
    d = _dispatcher(logical=4, num_physical_feeds=1, global_physical_batch_size=8)
    batch = d.logical_to_physical_batch({"x": torch.arange(4) + 5})
    out = d.physical_to_logical_batch(batch)
    assert out["x"].tolist() == [5, 6, 7, 8]


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"logical": 9, "num_physical_feeds": 2, "global_physical_batch_size": 16},
            (
                "global_logical_batch_size=9 must be divisible by num_logical_feeds=2 "
                "(len(logical_feed_indices))."
            ),
        ),
        (
            {"logical": 8, "num_physical_feeds": 3, "global_physical_batch_size": 16},
            "global_logical_batch_size=8 must be divisible by num_logical_feeds=3",
        ),
        (
            {"logical": 8, "num_physical_feeds": 2, "global_physical_batch_size": 9},
            "global_physical_batch_size=9 must be divisible by num_physical_feeds=2.",
        ),
        (
            {"logical": 8, "num_physical_feeds": 2, "global_physical_batch_size": 4},
            (
                "feed_physical_batch_size=2 must be >= feed_logical_batch_size=4; raise "
                "global_physical_batch_size or leave it to the default."
            ),
        ),
        (
            {"logical": 8, "num_physical_feeds": 2, "physical_feed_index": 2},
            "physical_feed_index=2 must be in range [0, 2).",
        ),
        (
            {"logical": 8, "num_physical_feeds": 2, "logical_feed_indices": (0, 2)},
            (
                "Invalid physical feed index in logical_feed_indices=[0, 2]: must be in range "
                "[0, 2)."
            ),
        ),
        (
            {"logical": 8, "num_physical_feeds": 2, "logical_feed_indices": (1, 1)},
            "logical_feed_indices=[1, 1] must be unique.",
        ),
        ({"logical": 0}, "global_logical_batch_size must be a positive int, but got 0."),
        (
            {"logical": 8, "num_physical_feeds": 0},
            "num_physical_feeds must be a positive int, but got 0.",
        ),
        ({"logical": 8, "logical_feed_indices": ()}, "logical_feed_indices must name at least"),
    ],
)
def test_validation(kwargs, message):
    kwargs = dict(kwargs)
    kwargs.setdefault("physical_feed_index", 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        ts.InputDispatcher(kwargs.pop("logical"), **kwargs)


def test_leaf_batch_size_must_be_the_feed_logical_batch():
    d = _dispatcher()
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            "logical_feed_batch['b'][0]: dim 0 of every leaf is the feed's logical batch size; "
            "expected 2, got dim 0 of size 3 (shape (3, 4))."
        ),
    ):
        d.logical_to_physical_batch({"a": np.zeros(2), "b": [np.zeros((3, 4))]})
    with pytest.raises(ts.ShardingError, match=re.escape("expected 2, got a scalar (shape ())")):
        d.logical_to_physical_batch({"a": np.float32(1)})
    with pytest.raises(
        ts.ShardingError,
        match=re.escape("logical_feed_shapes['a']: dim 0 of every leaf is the feed's logical"),
    ):
        d.logical_to_physical_shapes({"a": TensorSpec((4,), torch.int32)})


def test_unpaddable_dtype():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "logical_feed_batch['s']: this feed's rows are padded with zeros, which needs a "
            "numeric or bool dtype; got <U1. Encode strings and objects as numbers."
        ),
    ):
        _dispatcher().logical_to_physical_batch({"s": np.array(["a", "b"])})


def test_key_already_present_and_root_not_a_dict():
    d = _dispatcher()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"logical_feed_batch[{KEY!r}]: the dispatch key is already present; "
            "logical_to_physical_batch adds it (call it once per batch)."
        ),
    ):
        d.logical_to_physical_batch({"x": np.zeros(2), KEY: np.zeros(2, np.int64)})
    with pytest.raises(
        TypeError,
        match=re.escape(
            "logical_feed_batch: the dispatch key is added at the root of the batch, which must "
            "therefore be a dict; got list."
        ),
    ):
        d.logical_to_physical_batch([np.zeros(2)])


def test_leaves_must_be_host_arrays(mesh8):
    d = _dispatcher()
    with pytest.raises(
        TypeError,
        match=re.escape(
            "logical_feed_batch['x']: expected a numpy array or a CPU torch.Tensor, but got str."
        ),
    ):
        d.logical_to_physical_batch({"x": "ab"})
    g = ts.host_to_global_array(np.zeros(8))
    with pytest.raises(
        TypeError, match=re.escape("logical_to_physical_batch runs on the host; expected a")
    ):
        ts.InputDispatcher(
            8, num_physical_feeds=1, physical_feed_index=0, global_physical_batch_size=16
        ).logical_to_physical_batch({"x": g})


def test_in_step_bad_keys(mesh8):
    d = _dispatcher(logical=4, num_physical_feeds=1, global_physical_batch_size=8)
    x = ts.host_to_global_array(np.arange(8))
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"global_physical_batch: expected the dispatch key {KEY!r} (added by "
            "logical_to_physical_batch), but no dict holds it; the leaves would keep their 8 "
            "physical rows instead of 4."
        ),
    ):
        d.physical_to_logical_batch({"x": x})
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"global_physical_batch[{KEY!r}]: expected row targets of shape (8,) (from "
            "logical_to_physical_batch) or a one-hot matrix of shape (8, 4); got (8, 2)."
        ),
    ):
        d.physical_to_logical_batch({"x": x, KEY: ts.host_to_global_array(np.zeros((8, 2), bool))})
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"global_physical_batch[{KEY!r}]: the leaves beside the key must have the global "
            "physical batch size 8 in dim 0, but they have 16."
        ),
    ):
        d.physical_to_logical_batch(
            {"x": ts.host_to_global_array(np.zeros(16)), KEY: torch.zeros(8, dtype=torch.int64)}
        )


def test_check_catches_a_corrupted_key(mesh8):
    d = _dispatcher(logical=4, num_physical_feeds=1, global_physical_batch_size=8)
    targets = np.array([0, 1, 1, -1, 3, -1, 9, -1])
    g = ts.host_to_global_array({"x": np.arange(8), KEY: targets})
    with pytest.raises(
        ts.ShardingError,
        match=re.escape(
            f"global_physical_batch[{KEY!r}]: row targets must name every logical index in "
            "[0, 4) exactly once (-1 for padding); 1 targets are out of range and logical "
            "indices [1, 2] appear [2, 0] times."
        ),
    ):
        d.physical_to_logical_batch(g, check=True)


def test_permuted_logical_feeds_are_not_the_identity(mesh8):
    """8 rows from 2 feeds with logical_feed_indices (1, 0): no padding is needed, but physical
    feed 1 holds logical rows 0-3; axlearn skips the key here and the batch comes out in
    physical order (4-7 first). torchshard keeps the key."""
    feeds = []
    for i in range(2):
        d = ts.InputDispatcher(
            8, num_physical_feeds=2, physical_feed_index=i, logical_feed_indices=(1, 0)
        )
        assert not d.is_identity and d.global_physical_batch_size == 8
        shard = d.feed_read_config()["shard_index"]
        feeds.append(d.logical_to_physical_batch({"v": np.arange(4) + 4 * shard}))
    out = d.physical_to_logical_batch(_assemble(feeds, 2, d.partition_spec))
    assert ts.replicate_to_local_data(out)["v"].tolist() == list(range(8))


# -- dispatch moves bits, compiles once -----------------------------------------------------


def _odd_batch(logical):
    """One leaf per float dtype, [logical, 3], of values a float sum would change."""
    return {str(dt): odd_values(dt, 3 * logical).reshape(logical, 3) for dt in FLOATS}


def _physical(d, batch, key):
    """The global physical batch of a one-feed dispatcher; ``key="one-hot"``: axlearn's one-hot
    [P, L] matrix in place of the row targets."""
    phys = d.logical_to_physical_batch(batch)
    if key == "one-hot":
        targets = phys[KEY].numpy()
        onehot = np.zeros((targets.shape[0], d.global_logical_batch_size), bool)
        onehot[np.flatnonzero(targets >= 0), targets[targets >= 0]] = True
        phys[KEY] = onehot
    return ts.host_to_global_array(phys, partition=d.partition_spec)


@pytest.mark.parametrize("key", ["row targets", "one-hot"])
@pytest.mark.parametrize("logical", [8, 4, 1])
def test_dispatch_moves_bits_on_torch_xla(mesh8, logical, key):
    """-0.0, NaN payloads (quiet and signalling, either sign) and subnormals of every float
    dtype arrive as they left, for 8, 4 and 1 logical rows of 16 physical rows on 8 devices.
    The rows move as integers of their width (one XLA BitcastConvert each way, traced into
    the step); 4 and 1 rows, which 8 devices cannot split evenly, are asked for replicated
    (torch_xla 2.9 replicated them anyway, through a reshard that added floats: -0.0 became
    0.0, signalling NaNs were quieted, subnormals flushed). Before: every call fell back to the
    CPU for Tensor.view(dtype), and the output's reshard still changed those bits."""
    import torch_xla

    batch = _odd_batch(logical)
    d = ts.InputDispatcher(
        logical, num_physical_feeds=1, physical_feed_index=0, global_physical_batch_size=16
    )
    out = d.physical_to_logical_batch(_physical(d, batch, key))
    spec = "{devices=[8,1]0,1,2,3,4,5,6,7}" if logical == 8 else "{replicated}"
    back = ts.global_to_host_array(out)
    wrong = {
        name: differing(back[name], want)
        for name, want in batch.items()
        if back[name].dtype != want.dtype or not torch.equal(bits(back[name]), bits(want))
    }
    assert not wrong
    assert {torch_xla._XLAC._get_xla_sharding_spec(v) for v in out.values()} == {spec}


def _compiles():
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


@pytest.mark.parametrize("key", ["row targets", "one-hot"])
@pytest.mark.parametrize("logical", [8, 4])
def test_dispatch_compiles_once_on_torch_xla(mesh8, logical, key):
    """torch_xla's CompileTime count is flat after the first call: the same mesh, shapes and
    dtypes give the same graph (the bitcasts are traced into it). Before, Tensor.view(dtype)
    fell back to the CPU: every call compiled once more (counts 4, 5, 6, ... after calls 1,
    2, 3) and traced for 160-290 ms."""
    import torch_xla

    d = ts.InputDispatcher(
        logical, num_physical_feeds=1, physical_feed_index=0, global_physical_batch_size=16
    )
    batch = {k: v for k, v in _odd_batch(logical).items() if "64" not in k}  # no float64 warning
    g = _physical(d, batch, key)
    counts = []
    for _ in range(4):
        out = d.physical_to_logical_batch(g)
        torch_xla.sync()
        counts.append(_compiles())
    assert counts[1:] == [counts[0]] * 3, counts
    back = ts.global_to_host_array(out)
    assert all(torch.equal(bits(back[k]), bits(v)) for k, v in batch.items())


def test_dispatch_input_batch_compiles_once_on_torch_xla(mesh8):
    """The deprecated axlearn entry point (one-hot key) too: one compile, then none."""
    import warnings

    import torch_xla

    d = ts.InputDispatcher(8, num_physical_feeds=1, physical_feed_index=0,
                           global_physical_batch_size=16)  # fmt: skip
    g = _physical(d, {"h": odd_values(torch.float16, 24).reshape(8, 3)}, "one-hot")
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for _ in range(3):
            out = ts.dispatch_input_batch(g)
            torch_xla.sync()
            counts.append(_compiles())
    assert counts[1:] == [counts[0]] * 2, counts
    want = odd_values(torch.float16, 24).reshape(8, 3)
    assert torch.equal(bits(ts.global_to_host_array(out)["h"]), bits(want))


def test_uneven_logical_rows_are_asked_for_replicated(mesh42):
    """The choice, stated: where the mesh does not divide the logical rows, torch_xla's
    dispatch returns them replicated, P(), by request (the docstring, docs/differences.md); 8
    rows on the (4, 2) mesh split over both axes, as the partition says."""
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec
    for logical, want in [(8, "{devices=[8,1]0,1,2,3,4,5,6,7}"), (6, "{replicated}")]:
        d = ts.InputDispatcher(logical, num_physical_feeds=1, physical_feed_index=0,
                               global_physical_batch_size=16)  # fmt: skip
        x = torch.arange(logical * 2).reshape(logical, 2)
        g = ts.host_to_global_array(
            d.logical_to_physical_batch({"x": x}), partition=d.partition_spec
        )
        out = d.physical_to_logical_batch(g)["x"]
        assert spec(out) == want  # asked for, before any sync
        torch_xla.sync()
        assert spec(out) == want  # and what the step got
        assert torch.equal(ts.global_to_host_array(out), x)


def test_a_leaf_that_needs_grad_keeps_the_float_route(mesh8):
    """Integers have no gradient: a leaf that requires grad is gathered as floats (values
    equal, -0.0 and NaN bits may change: the docstring says so) and stays differentiable."""
    d = ts.InputDispatcher(8, num_physical_feeds=1, physical_feed_index=0,
                           global_physical_batch_size=16)  # fmt: skip
    x = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    g = ts.host_to_global_array(d.logical_to_physical_batch({"x": x}), partition=d.partition_spec)
    w = g["x"].detach().requires_grad_(True)
    out = d.physical_to_logical_batch({"x": w, KEY: g[KEY]})["x"]
    (out * out).sum().backward()
    assert torch.equal(ts.global_to_host_array(out.detach()), x)
    grad = ts.global_to_host_array(w.grad)
    assert torch.equal(grad[:8], 2 * x) and not grad[8:].any()


def test_a_tensor_kept_from_inside_vmap_is_refused():
    """Before: padded as if it were data (its shape lacks vmap's batch dimension), failing
    later inside the engine with ``Cannot access storage of BatchedTensorImpl``."""
    kept = []
    torch.func.vmap(lambda x: kept.append(x) or x.sum())(torch.ones(2, 4, 3))
    d = ts.InputDispatcher(4, global_physical_batch_size=8, num_physical_feeds=1)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "logical_feed_batch['x']: expected a host tensor, but got a tensor batched by "
            "torch.func.vmap"
        ),
    ):
        d.logical_to_physical_batch({"x": kept[0]})
