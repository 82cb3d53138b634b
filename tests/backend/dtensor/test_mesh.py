"""The DTensor backend's meshes (torchshard._backend.dtensor.mesh): meshes whose ranks do not
ascend, on gloo processes; in this process, the checks that need no process group."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import torchshard as ts
from torchshard._backend.dtensor import mesh as dmesh
from torchshard._core.mesh import Mesh
from torchshard._core.topology import Topology


def test_meshes_whose_ranks_do_not_ascend(pools):
    results = pools(4).run("_device_cases:permuted_mesh")
    for rank, r in enumerate(results):
        # raw DTensor on mesh [2, 0, 3, 1]: the blocks come back in rank order, not in mesh
        # order [0, 1, 2, 3] -- the misplacement torchshard refuses to build on
        assert r["raw_full"] == [1.0, 3.0, 0.0, 2.0], rank
        assert r["create"] == (
            "ShardingError: Mesh({'data': 4}, devices=[2, 0, 3, 1]): along mesh axis 'data' the "
            "ranks [2, 0, 3, 1] do not ascend. torch 2.9's DeviceMesh runs an axis's "
            "collectives in ascending rank order while DTensor places shards by mesh position, "
            "so full_tensor and redistribute would misplace blocks. Order the ranks ascending "
            "along every axis (a transposed grid such as [[0, 2], [1, 3]] is fine)."
        )
        assert r["from_device_mesh"] == r["create"]
        assert "along mesh axis 'a' the ranks [3, 2] do not ascend" in r["from_device_mesh_2d"]
        # a topology-aware layout whose lines order their ranks alike is reordered
        assert r["aware_devices"] == [[0, 1], [2, 3]]
        assert r["aware_back"]
        expected = torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * k for k in range(4)])
        assert r["aware_full"] == expected.tolist()
        assert r["aware_refused"].startswith(
            "ShardingError: torch.tpu.distributed.topology_aware_mesh laid the ranks out as "
            "[[0, 3], [1, 2]]: along mesh axis 'data'"
        )
        assert r["direct"] == [[0, 2], [1, 3]]


def test_without_a_process_group_a_dtensor_mesh_is_a_clear_error(monkeypatch):
    """The other way is the xla backend only where torch_xla is installed."""
    from torchshard._backend.xla import env

    head = (
        "a mesh of the dtensor backend needs torch.distributed, but its default process "
        "group is not initialised. Call torch.distributed.init_process_group('gloo') (or "
        "'nccl') on every process first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT)"
    )
    for installed, tail in [
        (True, ', or use a mesh of the xla backend (backend="xla").'),
        (False, "; one process per device, e.g. torchrun --nproc-per-node 2 train.py."),
    ]:
        monkeypatch.setattr(env, "xla_installed", lambda installed=installed: installed)
        with pytest.raises(ts.errors.NoProcessGroupError, match=re.escape(head + tail) + "$"):
            dmesh.topology()


def test_device_r_belongs_to_rank_r():
    assert dmesh._topology(2, 4) == Topology(2, 4, (0, 1, 2, 3))
    assert dmesh._topology(2, 4) is dmesh._topology(2, 4)  # kept per (rank, world)


@pytest.mark.parametrize(
    "grid",
    [
        np.arange(4),
        np.arange(4).reshape(2, 2),
        np.array([[0, 2], [1, 3]]),
        np.arange(8).reshape(2, 2, 2),
    ],
)
def test_ascending_ranks_pass(grid):
    names = ("a", "b", "c")[: grid.ndim]
    dmesh.check_rank_order(Mesh(grid, names, backend="dtensor"))


@pytest.mark.parametrize(
    ("grid", "names", "axis", "row"),
    [
        (np.array([1, 0, 2, 3]), ("data",), "data", [1, 0, 2, 3]),
        (np.array([[0, 1], [3, 2]]), ("a", "b"), "b", [3, 2]),
        (np.array([[2, 3], [0, 1]]), ("a", "b"), "a", [2, 0]),
    ],
)
def test_ranks_that_do_not_ascend_along_an_axis_are_refused(grid, names, axis, row):
    mesh = Mesh(grid, names, backend="dtensor")
    with pytest.raises(
        ts.ShardingError,
        match="^"
        + re.escape(
            f"{mesh!r}: along mesh axis {axis!r} the ranks {row} do not ascend. torch 2.9's "
            "DeviceMesh runs an axis's collectives in ascending rank order while DTensor "
            "places shards by mesh position, so full_tensor and redistribute would misplace "
            "blocks. Order the ranks ascending along every axis (a transposed grid such as "
            "[[0, 2], [1, 3]] is fine)."
        )
        + "$",
    ):
        dmesh.check_rank_order(mesh)


def test_a_mesh_must_cover_the_world():
    dmesh._check_covers_world(Mesh(np.arange(4), ("a",), backend="dtensor"), 4)
    with pytest.raises(ts.ShardingError, match=re.escape("covers devices [0, 1]")):
        dmesh._check_covers_world(Mesh(np.arange(2), ("a",), backend="dtensor"), 4)


def test_building_the_device_mesh_of_a_mesh_warns_nothing():
    """A Mesh's devices are a read-only array; the DeviceMesh torchshard builds from them took
    them through torch.as_tensor, whose "The given NumPy array is not writable" UserWarning
    came from torchshard's module (seen under torchtitan's data-loading mesh). In a fresh
    process (torch warns once per process), with every warning an error."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, numpy as np, torch.distributed as dist\n"
        "warnings.simplefilter('error')\n"
        "import torchshard as ts\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "mesh = ts.Mesh(np.arange(1).reshape(1, 1), ('dp', 'tp'), backend='dtensor')\n"
        "with mesh:\n"
        "    x = ts.host_to_global_array({'x': np.zeros((2, 3), np.float32)})['x']\n"
        "print(type(x).__name__, tuple(x.shape))\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "DTensor (2, 3)"
