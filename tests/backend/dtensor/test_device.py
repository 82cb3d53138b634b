"""The DTensor backend's device choice (torchshard._backend.dtensor.device), without an
accelerator.

In this process: which device type a mesh torchshard builds gets for each process-group
backend name, the index read from the device module, a helper thread's device set-up, and the
rank-grid reordering of a topology-aware layout. On gloo processes: a ``GlobalBatchLoader`` on
a mesh whose device is a stubbed accelerator (the loader's thread sets the device before any
copy; the consumer waits on each batch's own event), and the device of each mesh. The staging
ring is tested in test_staging.py, meshes whose ranks do not ascend in test_mesh.py; the same
paths on CUDA are in tests/cross/test_cuda.py.
"""

from __future__ import annotations

import threading

import _device_cases as cases
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchshard._backend.dtensor import device as devices
from torchshard._core.errors import ShardingError

# -- the device type of a mesh torchshard builds ---------------------------------------------


@pytest.mark.parametrize(
    ("backend", "accelerator", "expected"),
    [
        ("gloo", None, "cpu"),
        ("gloo", "cuda", "cpu"),  # gloo takes host tensors, even on a GPU machine
        ("mpi", "cuda", "cpu"),
        ("nccl", "cuda", "cuda"),
        ("NCCL", "cuda", "cuda"),
        ("nccl", None, "cpu"),
        ("xccl", "xpu", "xpu"),
        ("hccl", "npu", "npu"),
        ("tpu", "tpu", "tpu"),  # TorchTPU: backend "tpu", device "tpu"
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),
        ("cpu:gloo,tpu:tpu", "tpu", "tpu"),
        ("cpu:gloo", "cuda", "cpu"),
        ("cpu:gloo,cuda:nccl", "xpu", "cpu"),
        ("my_backend", "cuda", "cuda"),  # a registered third-party accelerator backend
    ],
)
def test_device_type_for_each_backend_name(backend, accelerator, expected):
    assert devices.device_type_for(backend, accelerator) == expected


def test_accelerator_type_reads_torch_accelerator(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert devices.accelerator_type() is None
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    assert devices.accelerator_type() == "cuda"


def test_current_device_and_bind_thread_use_the_device_module(monkeypatch):
    module = cases.FakeDeviceModule(default=0)
    monkeypatch.setattr(torch, "tpu", module, raising=False)
    module.set_device(3)
    assert devices.current_device("tpu") == devices.MeshDevice("tpu", 3)
    assert str(devices.current_device("tpu")) == "tpu:3"
    seen = []

    def helper():
        seen.append(module.current_device())  # a new thread starts on the default device
        devices.bind_thread(devices.MeshDevice("tpu", 3))
        seen.append(module.current_device())

    t = threading.Thread(target=helper, name="helper")
    t.start()
    t.join()
    assert seen == [0, 3]
    assert module.calls == [("MainThread", 3), ("helper", 3)]


def test_cpu_needs_no_device_module(monkeypatch):
    assert devices.current_device("cpu") == devices.MeshDevice("cpu", None)
    assert devices.MeshDevice("cpu", None).is_cpu
    devices.bind_thread(devices.MeshDevice("cpu", None))  # nothing to set


def test_a_missing_device_module_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch, "nodev", raising=False)
    with pytest.raises(RuntimeError, match=r"torch has no module torch\.nodev"):
        devices.current_device("nodev")


# -- TorchTPU's topology-aware layout --------------------------------------------------------


def test_topology_aware_mesh_is_used_only_on_tpu_with_torchtpu(monkeypatch):
    monkeypatch.delattr(torch, "tpu", raising=False)
    assert devices.topology_aware("tpu") is None

    def topology_aware_mesh(shape, *, mesh_dim_names):
        return None

    fake = type("M", (), {})()
    fake.distributed = type("D", (), {})()
    fake.distributed.topology_aware_mesh = topology_aware_mesh
    monkeypatch.setattr(torch, "tpu", fake, raising=False)
    assert devices.topology_aware("tpu") is topology_aware_mesh
    assert devices.topology_aware("cuda") is None
    assert devices.topology_aware("cpu") is None


def _lines(grid: np.ndarray, k: int) -> set[frozenset[int]]:
    lines = np.moveaxis(grid, k, -1).reshape(-1, grid.shape[k])
    return {frozenset(line.tolist()) for line in lines}


@given(st.data())
def test_ascending_grid_keeps_the_groups_or_refuses(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n = int(np.prod(shape))
    if data.draw(st.booleans()):  # a relabelling of positions: always reorderable
        grid = np.arange(n).reshape(shape)
        for k in range(len(shape)):
            grid = np.take(grid, data.draw(st.permutations(range(shape[k]))), axis=k)
    else:
        grid = np.asarray(data.draw(st.permutations(range(n)))).reshape(shape)
    names = tuple("abc"[: len(shape)])
    try:
        out = devices.ascending_grid(grid, names, "layout")
    except ShardingError as e:
        assert "no reordering of the mesh positions makes them ascend" in str(e)
        # the oracle: some axis has two lines that order their ranks differently
        assert any(
            len({tuple(np.argsort(line)) for line in np.moveaxis(grid, k, -1).reshape(-1, s)}) > 1
            for k, s in enumerate(shape)
        )
        return
    assert sorted(out.reshape(-1).tolist()) == list(range(n))
    for k in range(len(shape)):
        assert (np.diff(out, axis=k) > 0).all()
        assert _lines(out, k) == _lines(grid, k)  # the same process groups


def test_ascending_grid_error_names_the_layout_and_axis():
    with pytest.raises(ShardingError) as e:
        devices.ascending_grid(np.array([[0, 3], [1, 2]]), ("data", "model"), "topology_aware_mesh")
    assert str(e.value).startswith(
        "topology_aware_mesh laid the ranks out as [[0, 3], [1, 2]]: along mesh axis 'data' its "
        "lines order their ranks differently ([[0, 1], [3, 2]]), so no reordering"
    )


# -- on gloo processes -----------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_thread_sets_the_ranks_device_before_any_copy(pools, prefetch):
    for rank, r in enumerate(pools(2).run("_device_cases:loader_device_setup", prefetch=prefetch)):
        index = 10 + rank
        assert r["values"] == [[[100.0 * rank + b] * 3] * 2 for b in range(4)]
        assert r["copies"] and all(c["current"] == index for c in r["copies"]), r["copies"]
        threads = {c["thread"] for c in r["copies"]}
        if prefetch:
            (thread,) = threads
            assert thread.startswith("torchshard-loader")
            assert (thread, index) in r["set_device"]
            (log,) = r["logs"]  # one ring: the loader thread's
            consumed = [e for e in log if e[0] == "consume"]
            # one hand-off per batch, on the consumer's thread, each for its own batch's event
            assert [(e[1], e[2], e[3]) for e in consumed] == [
                (b + 1, r["main"], 1) for b in range(4)
            ]
        else:
            assert threads == {r["main"]}
            assert r["set_device"] == []  # the program's thread has it already


def test_the_device_is_the_meshs(pools):
    for rank, r in enumerate(pools(2).run("_device_cases:mesh_devices")):
        assert r["backend"] == "gloo"
        assert r["built"] == ("cpu", "cpu")
        assert r["hand"] == "cpu"
        assert r["gloo_with_gpu"] == "cpu"
        assert r["user"] == (f"fakeacc:{5 + rank}", f"fakeacc:{5 + rank}")
