"""torch_xla itself (torchshard._backend.xla.runtime): its import in SPMD mode, this process's
devices, the run's topology (computed once), and the private call that builds a global tensor
from CPU shards, checked against torch_xla's own report of the shards."""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("torch_xla", reason="XLA tests; needs torch_xla (the extra xla)")
import torch_xla
import torch_xla.distributed.spmd as xs_module
import torch_xla.runtime as xr_module
from helpers import xla_shards

from torchshard._backend.xla import runtime
from torchshard._core.topology import Topology

pytestmark = pytest.mark.xla


def test_xla_is_imported_in_spmd_mode():
    assert runtime.xla() is torch_xla
    assert runtime.xla() is runtime.xla()  # cached
    assert xr_module.is_spmd()
    assert runtime.xs() is xs_module and runtime.xr() is xr_module


@pytest.mark.parametrize(("name", "ordinal"), [("CPU:0", 0), ("TPU:5", 5), ("CPU:12", 12)])
def test_device_id_reads_the_ordinal(name, ordinal):
    assert runtime.device_id(name) == ordinal


@pytest.mark.parametrize("name", ["CPU", "CPU:x", ":3", "CPU:3:1", "xla:1 "])
def test_device_id_refuses_other_names(name):
    with pytest.raises(RuntimeError, match=re.escape(f"unexpected torch_xla device name {name!r}")):
        runtime.device_id(name)


def test_this_process_owns_the_eight_emulated_devices():
    assert runtime.local_devices() == tuple(range(8))
    names = torch_xla._XLAC._xla_get_runtime_devices()
    assert [runtime.device_id(n) for n in names] == list(range(8))


def test_the_topology_is_computed_once():
    topology = runtime.topology()
    assert topology == Topology(0, 1, (0,) * 8)
    assert topology.device_count == 8 and not topology.virtual
    assert runtime.topology() is topology


def test_global_tensor_from_cpu_shards_places_each_shard_on_its_device():
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    op = xs_module.Mesh(np.arange(8), (8, 1)).get_op_sharding((0, 1))
    shards = list(x.tensor_split(8, 0))  # device d's rows [d:d+1]
    g = runtime.global_tensor_from_cpu_shards(shards, op, [8, 4])
    assert g.device.type == "xla" and tuple(g.shape) == (8, 4)
    placed = xla_shards(g)
    assert sorted(placed) == list(range(8))
    for d, (ranges, data) in placed.items():
        assert ranges == ((d, d + 1), (0, 4))
        assert torch.equal(data, x[d : d + 1])
    assert torch.equal(g.cpu(), x)


def test_the_raw_binding_is_torch_xlas():
    assert runtime.cpu_shards_binding() is torch_xla._XLAC._global_tensor_from_cpu_shards
