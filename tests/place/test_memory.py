"""``torchshard._place.memory``: a call whose device copies do not fit in host memory (torch_xla's
CPU devices) is refused before anything moves, naming the call, the largest leaf and the fix.
Before, a 1 GiB replicated leaf on 8 emulated devices under a 6 GiB address-space limit aborted
the process inside XLA ("thread creation failed")."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._place import cache, memory

MIB = 1 << 20


def test_plan_bytes_counts_every_device_copy(mesh8, monkeypatch):
    seen = []
    monkeypatch.setattr(memory, "check_fits", lambda *a: seen.append(a))
    monkeypatch.setattr("torchshard._place.validate.check_fits", lambda *a: seen.append(a))
    cache.clear()
    with mesh8:
        ts.host_to_global_array(
            {"r": torch.zeros(8, 3), "s": torch.zeros(8, 5)},
            partition={"r": ts.P(), "s": ts.P("data")},
        )
    ((argname, plans, itemsizes, path),) = seen
    assert argname == "host_arrays" and list(itemsizes) == [4, 4]
    assert memory.plan_bytes(plans[0], 4) == 8 * (8 * 3 * 4)  # replicated: 8 whole copies
    assert memory.plan_bytes(plans[1], 4) == 8 * 5 * 4  # sharded: one row per device
    assert path(0) == "host_arrays['r']"


def test_plan_bytes_counts_each_hosts_own_block():
    """Hosts whose parts differ (1, 2, 2 and 1 of 4 row blocks; the whole of dim 1 each):
    a device of a host that holds one block receives that host's whole block."""
    from torchshard._core.blocks import merge_plans, plan_from_local

    mesh = ts.Mesh(np.array([0, 1, 2, 4, 3, 5, 6, 7]).reshape(4, 2), ("data", "model"))
    owners = tuple(d // 2 for d in range(8))
    rows = (2, 4, 4, 2)
    plans = [
        plan_from_local(mesh, ts.P("data"), (rows[h], 3), owners, (2 * h, 2 * h + 1), (8, 3))
        for h in range(4)
    ]
    plan = merge_plans(plans, tuple(range(8)))
    assert memory.plan_bytes(plan, 4) == 8 * (2 * 3 * 4)  # every device: 2 rows of 3


def test_a_call_that_does_not_fit_is_refused_before_anything_moves(mesh8, monkeypatch):
    monkeypatch.setattr(memory, "headroom", lambda: 100 * MIB)
    cache.clear()
    big = torch.zeros(4 * MIB, dtype=torch.float32)  # 16 MiB; 8 copies: 128 MiB
    with mesh8:
        with pytest.raises(MemoryError) as info:
            ts.host_to_global_array({"small": torch.zeros(8), "big": big}, partition=ts.P())
        assert str(info.value) == (
            "host_arrays: the devices of this process keep their buffers in host memory "
            "(torch_xla's CPU devices), and this call's copies need 128.0 MiB, but only 100.0 MiB "
            "can still be allocated (the address-space limit, ulimit -v, or the machine's free "
            "memory); the largest leaf, host_arrays['big'], takes 128.0 MiB in 8 device copies. "
            "Shard large leaves over the mesh (e.g. P('data')) instead of replicating them, "
            "place smaller batches, or emulate fewer devices (torchshard.setup_cpu_emulation(n))."
        )
        # The fix it names: sharded, each device holds 1/8 of it (16 MiB in all).
        out = ts.host_to_global_array({"big": big}, partition=ts.P("data"))
        assert out["big"].shape == big.shape
    monkeypatch.setattr(memory, "headroom", lambda: 1 << 40)
    cache.clear()
    with mesh8:  # and with the memory there, the replicated call runs
        out = ts.host_to_global_array({"big": big}, partition=ts.P())
        assert torch.equal(ts.replicate_to_local_data(out)["big"], big)


def test_headroom_reads_the_address_space_limit():
    free = memory.headroom()
    if free is None:
        pytest.skip("no /proc here")
    assert free > 0


_UNDER_A_LIMIT = """
import resource, torch
import torchshard as ts
from torchshard._place import memory
ts.setup_cpu_emulation(8)
mesh = ts.Mesh(__import__("numpy").arange(8), ("data",))
with mesh:
    ts.host_to_global_array(torch.zeros(8))  # the runtime and its threads start
    size = memory._proc_kib("/proc/self/status", "VmSize")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), hard))  # 1 GiB more, no further
    big = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB: 2 GiB on 8 devices
    try:
        ts.host_to_global_array({"x": big}, partition=ts.P())
        print("placed")
    except MemoryError as e:
        print("refused:", e)
    sharded = ts.host_to_global_array({"x": big}, partition=ts.P("data"))
    print("sharded", tuple(sharded["x"].shape))
"""


@pytest.mark.xla
def test_under_a_real_address_space_limit_the_process_survives(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS and /proc are Linux's")
    script = tmp_path / "limit.py"
    script.write_text(_UNDER_A_LIMIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    lines = done.stdout.splitlines()
    assert re.fullmatch(
        r"refused: host_arrays: .* this call's copies need 2\.00 GiB, but only [\d.]+ MiB can .*"
        r"the largest leaf, host_arrays\['x'\], takes 2\.00 GiB in 8 device copies\..*",
        lines[0],
    ), lines
    assert lines[1] == f"sharded ({64 << 20},)"
