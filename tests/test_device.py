"""The DTensor backend's device choice and host <-> device staging, without an accelerator.

In this process: which device type a mesh torchshard builds gets for each process-group
backend name, the index read from the device module, a helper thread's device set-up, the
rank-grid reordering of a topology-aware layout, and the staging ring (bound, reuse, one event
per batch) on a CPU driver (``_device_cases.FakeDriver``). On gloo processes: a
``GlobalBatchLoader`` on a mesh whose device is a stubbed accelerator (the loader's thread sets
the device before any copy; the consumer waits on each batch's own event), and meshes whose
ranks do not ascend. The same paths on CUDA are ``test_cuda.py``.
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
from torchshard._backend.dtensor import staging
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


# -- the staging ring, on a CPU driver -------------------------------------------------------


def _batch(b: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return [
        torch.randn(4, 3, generator=g),
        torch.randint(0, 9, (5,), generator=g, dtype=torch.int64),
        torch.rand(3, 2, generator=g) > 0.5,
    ]


def test_staged_blocks_keep_their_values_and_layouts():
    ring = staging.StagingRing(cases.FakeDriver())
    base = torch.arange(24.0).reshape(4, 6)
    blocks = [
        base[:, 1:4],  # a non-contiguous view
        base.to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.zeros(0, 3),
        torch.tensor(7, dtype=torch.int16),
        torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
    ]
    out = [ring.stage(b) for b in blocks]
    ring.seal()
    for b, o in zip(blocks, out, strict=True):
        assert o.dtype == b.dtype and o.shape == b.shape
        assert torch.equal(o, b)


def test_ring_is_bounded_and_reused():
    driver = cases.FakeDriver()
    ring = staging.StagingRing(driver, slots=2)
    per_batch = 0
    for t in _batch(0):  # each block starts at an aligned offset
        per_batch = staging._aligned(per_batch) + t.numel() * t.element_size()
    sources = []
    for b in range(10):
        blocks = _batch(b)
        out = [ring.stage(t) for t in blocks]
        ready = ring.seal()
        assert ready is not None
        assert all(torch.equal(o, t) for o, t in zip(out, blocks, strict=True))
        sources.append([c["src"] for c in driver.copies[-3:]])
    # The first batch stages each block in its own buffer (3); each slot is then allocated
    # once at the batch's size when it is next filled, and reused: 3 + 2 allocations in all.
    assert ring.allocations == 5
    assert [e for e in driver.log if e[0] == "pinned"][-2:] == [
        ("pinned", per_batch, sources[1][0]),
        ("pinned", per_batch, sources[2][0]),
    ]
    assert ring.pinned_bytes == 2 * per_batch
    for b in range(1, 8):
        assert sources[b] == sources[b + 2]  # the same slot, the same pinned bytes
        assert sources[b][0] != sources[b + 1][0]  # the two slots alternate


def test_a_slot_is_refilled_only_after_the_copy_that_read_it():
    driver = cases.FakeDriver()
    ring = staging.StagingRing(driver, slots=2)
    for b in range(5):
        for t in _batch(b):
            ring.stage(t)
        ring.seal()
    # batch b records event b + 1; batch b >= 2 waits for event b - 1 (batch b - 2's copies)
    # before its first copy, and never waits for the batch just before it
    ops = [e for e in driver.log if e[0] in ("wait", "record", "copy")]
    expected = []
    for b in range(5):
        if b >= 2:
            expected.append(("wait", b - 1))
        expected += ["copy"] * 3 + [("record", b + 1)]
    assert [e if e[0] != "copy" else "copy" for e in ops] == expected


def test_a_batch_that_outgrows_its_slot_gets_a_bigger_one_once():
    driver = cases.FakeDriver()
    ring = staging.StagingRing(driver, slots=1)
    for _ in range(3):
        ring.stage(torch.zeros(16))
        ring.seal()
    assert ring.allocations == 2  # the first batch's own buffer, then the slot
    for _ in range(3):
        ring.stage(torch.zeros(16))
        ring.stage(torch.ones(100))  # does not fit: its own buffer this time
        ring.seal()
    assert ring.allocations == 4  # + the extra block, + the slot at the new size, once
    assert ring.pinned_bytes == staging._aligned(64) + 400


def test_ready_hands_off_its_own_batch_only():
    driver = cases.FakeDriver()
    ring = staging.StagingRing(driver)
    ring.stage(torch.ones(2))
    first = ring.seal()
    ring.stage(torch.ones(3))
    ring.stage(torch.ones(4))
    second = ring.seal()
    assert ring.seal() is None  # nothing staged since
    second()
    first()
    consumed = [e for e in driver.log if e[0] == "consume"]
    assert consumed == [("consume", 2, "MainThread", 2), ("consume", 1, "MainThread", 1)]


def test_read_back_of_cpu_tensors_copies_them():
    x = torch.arange(6).reshape(2, 3)[:, 1:]
    (out,) = staging.read_back([x])
    assert torch.equal(out, x) and out.is_contiguous() and out.data_ptr() != x.data_ptr()


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


# -- the h2d bench without an accelerator ----------------------------------------------------


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
def test_bench_h2d_without_an_accelerator_says_so_in_one_line():
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "torchshard", "bench", "h2d", "--quick", "--plain"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert (
        "note: h2d: no accelerator (torch.accelerator.is_available() is False); nothing measured."
        in lines
    )
    assert all(line.startswith("note: ") for line in lines), lines  # notes only: no figures


def test_the_device_is_the_meshs(pools):
    for rank, r in enumerate(pools(2).run("_device_cases:mesh_devices")):
        assert r["backend"] == "gloo"
        assert r["built"] == ("cpu", "cpu")
        assert r["hand"] == "cpu"
        assert r["gloo_with_gpu"] == "cpu"
        assert r["user"] == (f"fakeacc:{5 + rank}", f"fakeacc:{5 + rank}")
