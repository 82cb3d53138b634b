"""What both demos share (torchshard._tools._demo_common): the synthetic, learnable data set,
the DataLoader worker check, a host's DataLoader, the model and the result."""

import multiprocessing
import re
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import SequentialSampler

from torchshard._tools import _demo_common as common


def test_the_data_set_is_seeded_and_learnable():
    a, b = common.SyntheticClassification(64, seed=3), common.SyntheticClassification(64, seed=3)
    assert len(a) == 64
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.x, common.SyntheticClassification(64, seed=4).x)
    example = a[5]
    assert set(example) == {"x", "y"}
    assert example["x"].shape == (common.FEATURES,) and example["x"].dtype == np.float32
    assert example["y"].dtype == np.int64 and 0 <= example["y"] < common.CLASSES
    # A linear teacher labels it: a least-squares linear fit recovers most labels.
    big = common.SyntheticClassification(2048, seed=0)
    onehot = np.eye(common.CLASSES)[big.y]
    w, *_ = np.linalg.lstsq(big.x, onehot, rcond=None)
    assert ((big.x @ w).argmax(axis=1) == big.y).mean() > 0.5


def test_a_worker_must_not_carry_torch_xla(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_xla", raising=False)
    common.check_worker(0)  # nothing raised
    monkeypatch.setitem(sys.modules, "torch_xla", object())
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "DataLoader worker 3 has torch_xla imported; start workers with the 'forkserver' or "
            "'spawn' method and keep the dataset free of XLA."
        ),
    ):
        common.check_worker(3)


def test_a_host_loader_without_workers_drops_the_last_short_batch():
    ds = common.SyntheticClassification(20)
    loader = common.host_loader(ds, 8, SequentialSampler(ds), 0)
    batches = list(loader)
    assert len(batches) == 2 and loader.num_workers == 0
    assert batches[0]["x"].shape == (8, common.FEATURES)
    assert torch.equal(batches[1]["y"], torch.from_numpy(ds.y[8:16]))
    assert loader.worker_init_fn is common.check_worker


def test_a_host_loader_with_workers_uses_forkserver(monkeypatch):
    preloaded = []  # the forkserver preloads the module (no XLA): recorded, not set here
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", preloaded.append)
    ds = common.SyntheticClassification(16)
    loader = common.host_loader(ds, 8, SequentialSampler(ds), 2)
    assert preloaded == [["torchshard._tools._demo_common"]]
    assert loader.num_workers == 2 and loader.persistent_workers and loader.drop_last
    assert loader.multiprocessing_context.get_start_method() == "forkserver"


def test_the_model_maps_features_to_classes():
    torch.manual_seed(0)
    model = common.mlp()
    out = model(torch.zeros(5, common.FEATURES))
    assert out.shape == (5, common.CLASSES)
    assert sum(p.numel() for p in model.parameters()) == 32 * 128 + 128 + 128 * 128 + 128 + 1290


def test_the_loss_fell_means_five_percent_lower():
    def result(first, last):
        return common.Result(first, last, 1.0, 1.0, 0.0, 0.0)

    assert result(1.0, 0.94).loss_fell
    assert not result(1.0, 0.95).loss_fell and not result(1.0, 1.2).loss_fell
    assert common._mean([1.0, 2.0, 6.0]) == 3.0
