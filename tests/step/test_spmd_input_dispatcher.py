"""SpmdInputDispatcher (torchshard._step.spmd_input_dispatcher): axlearn's tests (ported), feeds
that follow the mesh, validation, host-side shapes and batches, in-step dispatch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")

import torchshard as ts
from torchshard.testing import host_to_global_array_per_host, virtual_hosts

P = ts.P
KEY = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY
TensorSpec = ts.TensorSpec


@pytest.mark.parametrize("num_hosts", [1, 2, 4, 8])
@pytest.mark.parametrize("divisor", [1, 2, 4])
def test_spmd_every_other_process(num_hosts, divisor):
    """axlearn's test on mesh (1, devices) with P(("x",)): "x" has size 1, so every host holds
    the whole (replicated) batch and reads the same single feed."""
    if num_hosts % divisor:
        pytest.skip(f"{num_hosts} hosts are not divisible by {divisor}")
    mesh = ts.Mesh(np.arange(8).reshape(1, 8), ("x", "y"))
    global_logical = (num_hosts // divisor, 2)
    with mesh:
        per_host, feeds = [], None
        for h in range(num_hosts):
            with virtual_hosts(num_hosts, process_index=h):
                d = ts.SpmdInputDispatcher(global_logical[0], partition_spec=P(("x",)))
            read = d.feed_read_config()
            feeds, index = read["num_shards"], read["shard_index"]
            assert d.feed_logical_batch_size * d.num_logical_feeds == global_logical[0]
            assert (d.num_logical_feeds, d.logical_feed_index) == (feeds, index)
            local_shape = (d.feed_logical_batch_size, *global_logical[1:])
            arrays = [
                np.random.default_rng(i).uniform(size=local_shape).astype(np.float32)
                for i in range(feeds)
            ]
            # axlearn's test passes arrays[index][None] (dim 0 of size 1, not the feed's batch
            # size); SpmdInputDispatcher refuses batches of another size, so each host passes
            # its feed's rows, tagged with the feed index.
            batch = {"x": arrays[index], "idx": np.full(d.feed_logical_batch_size, index)}
            per_host.append(d.logical_to_physical_batch(batch))
        assert (feeds, index) == (1, 0)
        with virtual_hosts(num_hosts):
            g = host_to_global_array_per_host(per_host, partition=d.partition_spec)
        out = ts.replicate_to_local_data(d.physical_to_logical_batch(g))
        assert np.unique(out["idx"].numpy()).tolist() == list(range(feeds))
        np.testing.assert_array_equal(np.concatenate(arrays), out["x"].numpy())


@pytest.mark.parametrize("num_hosts", [2, 4])
def test_spmd_feeds_follow_the_mesh(num_hosts):
    """On mesh (4, 2) with P("data"), hosts own consecutive "data" rows; each reads its own
    feed, and the assembled batch is the feeds in order."""
    mesh = ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))
    with mesh:
        blocks = []
        for h in range(num_hosts):
            with virtual_hosts(num_hosts, process_index=h):
                d = ts.SpmdInputDispatcher(8, partition_spec=P("data"))
            assert d.feed_read_config() == {"num_shards": num_hosts, "shard_index": h}
            fl = d.feed_logical_batch_size
            blocks.append({"v": np.arange(h * fl, (h + 1) * fl)})
        assert d.logical_to_physical_shapes({"v": TensorSpec((fl,), torch.int64)}) == {
            "v": TensorSpec((fl,), torch.int64)
        }
        with virtual_hosts(num_hosts):
            g = host_to_global_array_per_host(blocks, partition=d.partition_spec)
        assert ts.replicate_to_local_data(d.physical_to_logical_batch(g))["v"].tolist() == list(
            range(8)
        )


@pytest.mark.parametrize(
    ("names", "spec"),
    [(("dp", "tp"), P("dp", "tp")), (("dp", "cp"), P("dp", None, "cp")), (("dp", "tp"), P(None))],
)
def test_specs_that_split_other_dims_feed_dim_0_and_slice_the_rest(names, spec):
    """The issue's complaint: SpmdInputDispatcher refused P("dp", "tp"). Its feed is dim 0's
    (feed_read_config's), each host supplies its slice of the other dims (feed_slices), and the
    assembled batch is the global value."""
    mesh = ts.Mesh(np.arange(8).reshape(2, 4), names)
    shape = (8, 4, 8)
    g = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    with mesh:
        blocks = []
        for h in range(4):
            with virtual_hosts(4, process_index=h):
                d = ts.SpmdInputDispatcher(8, partition_spec=spec)
                assert d.feed_read_config() == ts.feed_read_config(spec)
                cut = ts.feed_slices(spec, shape)
            rows = d.feed_logical_batch_size
            index = d.feed_read_config()["shard_index"]
            assert (cut[0].start, cut[0].stop) == (index * rows, (index + 1) * rows)
            blocks.append({"x": d.logical_to_physical_batch({"x": g[cut]})["x"]})
        with virtual_hosts(4):
            out = host_to_global_array_per_host(blocks, partition=d.partition_spec)
        out = ts.replicate_to_local_data(d.physical_to_logical_batch(out))
    np.testing.assert_array_equal(out["x"].numpy(), g)


def test_spmd_validate():
    mesh = ts.Mesh(np.arange(8).reshape(1, 8), ("x", "y"))
    with mesh:
        with pytest.raises(
            ValueError,
            match=re.escape(
                "partition_spec=P(('x', 'y'),) attempts to divide the batch over "
                "num_partitions=8, which is incompatible with global_logical_batch_size=4."
            ),
        ):
            ts.SpmdInputDispatcher(4, partition_spec=P(("x", "y")))
        with pytest.raises(ValueError, match=re.escape("partition_spec=P() cannot be empty.")):
            ts.SpmdInputDispatcher(4, partition_spec=P())
        with pytest.raises(
            ts.ShardingError,
            match=re.escape("entry 1 is UNCONSTRAINED, which only maybe_shard accepts"),
        ):
            ts.SpmdInputDispatcher(4, partition_spec=P("x", P.UNCONSTRAINED))
        with pytest.raises(TypeError, match="partition_spec must be a PartitionSpec"):
            ts.SpmdInputDispatcher(4, partition_spec=("x",))
        with pytest.raises(
            ts.ShardingError,
            match=re.escape("logical_feed_shapes['a']: expected a batch of rank >= 1"),
        ):
            ts.SpmdInputDispatcher(4, partition_spec=P("x")).logical_to_physical_shapes(
                {"a": TensorSpec((), torch.int32)}
            )
    with pytest.raises(ts.errors.NoMeshError, match="SpmdInputDispatcher must be called inside"):
        ts.SpmdInputDispatcher(4, partition_spec=P("x"))


def test_properties_and_repr(mesh42):
    with virtual_hosts(4, process_index=3):
        d = ts.SpmdInputDispatcher(16, partition_spec=P(("data", "model")))
    assert repr(d) == (
        "SpmdInputDispatcher(global_logical_batch_size=16, partition_spec=P(('data', 'model'),))"
    )
    assert d.global_logical_batch_size == 16 and d.partition_spec == P(("data", "model"))
    assert (d.num_logical_feeds, d.logical_feed_index) == (4, 3)
    assert d.feed_logical_batch_size == 4
    assert d.feed_read_config() == {"num_shards": 4, "shard_index": 3}


def test_a_spec_over_one_axis_of_two_gives_one_feed_per_row_group(mesh42):
    """P("model") on mesh (4, 2) with 2 hosts: every host's devices hold both "model" columns,
    so both hosts hold the whole batch: one feed, read by both."""
    for h in range(2):
        with virtual_hosts(2, process_index=h):
            d = ts.SpmdInputDispatcher(8, partition_spec=P("model"))
        assert d.feed_read_config() == {"num_shards": 1, "shard_index": 0}
        assert d.feed_logical_batch_size == 8


def test_batch_conversions_are_the_identity_on_leaves(mesh42):
    d = ts.SpmdInputDispatcher(8, partition_spec=P("data"))
    x, y = np.zeros((8, 2)), torch.ones(8)
    batch = {"x": x, "y": [y]}
    out = d.logical_to_physical_batch(batch)
    assert out == batch and out is not batch and out["y"] is not batch["y"]  # new containers
    assert out["x"] is x and out["y"][0] is y  # the same leaves
    g = ts.host_to_global_array(batch, partition=d.partition_spec)
    back = d.physical_to_logical_batch(g)
    assert back["x"] is g["x"] and back["y"][0] is g["y"][0]
    assert ts.replicate_to_local_data(back)["y"][0].tolist() == [1.0] * 8


def test_leaves_without_a_shape_are_a_type_error(mesh42):
    d = ts.SpmdInputDispatcher(8, partition_spec=P("data"))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "logical_feed_batch['n'][0]: expected an array or tensor (a batch along dim 0), but "
            "got int."
        ),
    ):
        d.logical_to_physical_batch({"n": [3]})


@pytest.mark.parametrize("size", [0, -8, 2.0, True])
def test_the_batch_size_must_be_a_positive_int(mesh42, size):
    with pytest.raises(
        ValueError,
        match=re.escape(f"global_logical_batch_size must be a positive int, but got {size!r}."),
    ):
        ts.SpmdInputDispatcher(size, partition_spec=P("data"))


def test_logical_to_physical_shapes_keeps_shapes_and_dtypes(mesh42):
    d = ts.SpmdInputDispatcher(8, partition_spec=P("data"))
    shapes = {"a": np.zeros((8, 3), np.int16), "b": ts.TensorSpec((8,), torch.bfloat16)}
    assert d.logical_to_physical_shapes(shapes) == {
        "a": TensorSpec((8, 3), np.dtype(np.int16)),
        "b": TensorSpec((8,), torch.bfloat16),
    }
