"""The torch_xla benches' sizes on any device count (``--devices N``): every row count a
multiple of N, so dim 0 splits evenly; on 8 devices the sizes the benches document. (The lab's
sizes, ``dispatch`` and ``ends``, are checked in ``benchmarks/tests/``.)"""

import numpy as np
import pytest

import torchshard as ts
from torchshard._tools.bench import _devices

SIZES = tuple(_devices.KIB * 4**k for k in range(9))  # the sweep's: 1 KiB, 4 KiB, ..., 64 MiB


def test_round_up_and_the_mesh_labels():
    assert [_devices.round_up(r, 3) for r in (0, 1, 3, 64, 1024)] == [3, 3, 3, 66, 1026]
    assert _devices.round_up(1024, 8) == 1024 and _devices.round_up(64, 512) == 512
    assert [_devices.grid_shape(n) for n in (1, 2, 3, 8, 512)] == [
        (1, 1),
        (1, 2),
        (3, 1),
        (4, 2),
        (256, 2),
    ]
    assert _devices.label(ts.Mesh(np.arange(8), ("data",))) == "(8,)"
    assert _devices.label(ts.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))) == "(4,2)"


@pytest.mark.parametrize("devices", [1, 3, 8, 512])
def test_every_size_splits_evenly(devices):
    for nbytes in (*SIZES, 512):
        rows, cols = _devices.batch_shape(nbytes, devices)
        assert rows % devices == 0 and cols >= 1


def test_on_8_devices_the_documented_sizes():
    assert [_devices.batch_shape(n, 8) for n in (1024, 4096, 2**20)] == [
        (8, 32),
        (8, 128),
        (1024, 256),
    ]


def test_size_labels():
    assert [_devices.size_label(n) for n in SIZES] == [
        "1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB",
    ]  # fmt: skip
    assert _devices.size_label(3 * 2**20) == "3 MiB" and _devices.batch_shape(1024) == (8, 32)
