"""virtual_hosts and the per-host functions (torchshard.testing._virtual). The topology override
they install is tested in tests/core/test_topology.py."""

import re
import threading

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._mesh.context import current_topology
from torchshard.testing import (
    global_to_host_array_per_host,
    host_to_global_array_per_host,
    make_virtual_topology,
    virtual_hosts,
)
from torchshard.testing._virtual import is_virtual

pytestmark = pytest.mark.xla  # every test here runs on torch_xla


def test_outside_the_emulation_one_process_owns_every_device():
    assert ts.process_index() == 0 and ts.process_count() == 1
    topo = current_topology()
    assert topo.device_process == (0,) * 8 and not topo.virtual


@pytest.mark.parametrize("hosts", [1, 2, 4, 8])
def test_hosts_own_contiguous_equal_groups(hosts):
    with virtual_hosts(hosts, process_index=hosts - 1) as topo:
        assert ts.process_count() == hosts
        assert ts.process_index() == hosts - 1
        per = 8 // hosts
        assert topo.device_process == tuple(d // per for d in range(8))
        assert topo.devices_of(hosts - 1) == tuple(range(8 - per, 8))
        assert topo.virtual and is_virtual()
    assert ts.process_count() == 1


def test_nesting_restores_the_outer_emulation():
    with virtual_hosts(2, process_index=1):
        with virtual_hosts(4, process_index=3):
            assert (ts.process_index(), ts.process_count()) == (3, 4)
        assert (ts.process_index(), ts.process_count()) == (1, 2)
    assert (ts.process_index(), ts.process_count()) == (0, 1)


def test_the_emulation_is_per_thread():
    """Before: process-wide, so a thread that never entered it saw 4 hosts (and its plain
    host_to_global_array was refused), and two threads with 2 and 4 hosts clashed."""
    seen = {}
    inside, release = threading.Barrier(3, timeout=30), threading.Event()

    def emulate(hosts):
        with virtual_hosts(hosts, process_index=hosts - 1), ts.Mesh(np.arange(8), ("data",)):
            inside.wait()
            blocks = [np.full((4, 3), h, np.float32) for h in range(hosts)]
            g = host_to_global_array_per_host(blocks, partition=ts.P("data"))
            seen[hosts] = (ts.process_count(), ts.process_index(), g.shape[0])
            release.wait(30)

    def bystander():
        inside.wait()
        with ts.Mesh(np.arange(8), ("data",)):
            g = ts.host_to_global_array(np.zeros((8, 3), np.float32), partition=ts.P("data"))
            seen["bystander"] = (ts.process_count(), ts.process_index(), g.shape[0])

    threads = [threading.Thread(target=emulate, args=(n,), name=f"hosts-{n}") for n in (2, 4)]
    for t in threads:
        t.start()
    try:
        bystander()
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert seen == {2: (2, 1, 8), 4: (4, 3, 16), "bystander": (1, 0, 8)}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (8, 3),
            (
                "virtual_hosts: num_hosts must be a positive divisor of the 8 devices, but got "
                "3; each "
                "host owns an equal, contiguous group of device ids."
            ),
        ),
        (
            (8, 0),
            (
                "virtual_hosts: num_hosts must be a positive divisor of the 8 devices, but got "
                "0; each "
                "host owns an equal, contiguous group of device ids."
            ),
        ),
        ((8, 2, 2), "process_index must be in [0, 2), but got 2."),
    ],
)
def test_bad_emulations(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_virtual_topology(*args)
    with pytest.raises(ValueError, match=re.escape(message)):
        with virtual_hosts(args[1], process_index=args[2] if len(args) > 2 else 0):
            pass
    assert not is_virtual()


def test_per_host_functions_need_the_emulation(mesh8):
    for call in (
        lambda: host_to_global_array_per_host([np.zeros(8)]),
        lambda: global_to_host_array_per_host([]),
    ):
        with pytest.raises(
            ts.ShardingError,
            match=re.escape("must be called inside torchshard.testing.virtual_hosts()."),
        ):
            call()


def test_per_host_arrays_must_be_a_list(mesh8):
    with (
        virtual_hosts(2),
        pytest.raises(
            TypeError,
            match=re.escape(
                "per_host_arrays: expected a list with one tree per host, but got dict."
            ),
        ),
    ):
        host_to_global_array_per_host({"x": np.zeros(8)})


def test_real_path_inside_a_multi_host_emulation_is_refused(mesh8):
    with (
        virtual_hosts(2),
        pytest.raises(
            ts.ShardingError,
            match=re.escape(
                "host_to_global_array inside virtual_hosts(2) has only this host's data; use "
                "torchshard.testing.host_to_global_array_per_host with one tree per host."
            ),
        ),
    ):
        ts.host_to_global_array(np.zeros(8))


def test_one_virtual_host_is_the_real_path(mesh8):
    with virtual_hosts(1):
        g = ts.host_to_global_array(np.arange(8))
        assert torch.equal(ts.global_to_host_array(g), torch.arange(8))
        assert len(global_to_host_array_per_host(g)) == 1


def test_global_to_host_array_reads_the_emulated_process(mesh8):
    x = np.arange(16).reshape(8, 2)
    with virtual_hosts(4, process_index=2):
        g = host_to_global_array_per_host([x[0:2], x[2:4], x[4:6], x[6:8]])
        np.testing.assert_array_equal(ts.global_to_host_array(g).numpy(), x[4:6])
        blocks = global_to_host_array_per_host({"g": g})
    assert [b["g"].tolist() for b in blocks] == [x[2 * h : 2 * h + 2].tolist() for h in range(4)]
