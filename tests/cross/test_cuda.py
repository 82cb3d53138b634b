"""The DTensor backend on CUDA (NCCL): assemble, read-back, dispatch and the loader, checking
each shard's device and values. One process, and as many as there are GPUs (up to 4) when
there are several; each rank drives one GPU (``cpu:gloo,cuda:nccl``). Skipped without a GPU;
the same paths run on the CPU with a stubbed device in ``backend/dtensor/test_device.py``."""

from __future__ import annotations

import _cuda_cases  # noqa: F401 -- the workers import it; fail here first if it breaks
import pytest
import torch
from _multiproc import BACKEND_ENV, WorkerPool

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)


def _worlds() -> list[int]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [1] + ([min(count, 4)] if count >= 2 else [])


@pytest.fixture(scope="module", params=_worlds(), ids=lambda n: f"{n}gpu")
def gpus(request):
    pool = WorkerPool(request.param, env={BACKEND_ENV: "cpu:gloo,cuda:nccl"})
    yield pool
    pool.close()


def test_assemble_and_read_back_on_cuda(gpus):
    for r in gpus.run("_cuda_cases:assemble_readback"):
        dev = r["expected_device"]
        assert r["mesh_device_type"] == "cuda"
        assert r["devices"] == {"x": dev, "y": dev, "r": dev}
        assert r["user_device"] == dev
        a, b = r["rows"]
        for k in ("x", "y"):
            block = r["global"][k][a:b]
            assert torch.equal(r["locals"][k], block)
            assert torch.equal(r["back"][k], block)
            assert torch.equal(r["full"][k], r["global"][k])
        assert torch.equal(r["locals"]["r"], torch.arange(6.0))
        assert r["back_devices"] == {"x": "cpu", "y": "cpu", "r": "cpu"}
        assert torch.equal(r["user_back"], r["global"]["x"][a:b])


@pytest.mark.parametrize("key", ["index", "onehot"])
def test_dispatch_primitives_on_cuda(gpus, key):
    for r in gpus.run("_cuda_cases:dispatch", key=key):
        assert r["device"] == r["expected_device"]
        assert r["placements"] == ["S(0)"]
        assert torch.equal(r["full"], r["expected"])
        assert torch.equal(r["local"], r["expected_local"])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_on_cuda(gpus, prefetch):
    for r in gpus.run("_cuda_cases:loader", prefetch=prefetch):
        dev, rank, world = r["expected_device"], r["rank"], r["world"]
        assert r["devices"] == [{"x": dev, "i": dev}] * 5
        assert r["sums"] == [float(64 * 256 * (1000 * rank + b)) for b in range(5)]
        for b, back in enumerate(r["backs"]):
            assert torch.equal(back["x"], torch.full((64, 256), float(1000 * rank + b)))
            assert torch.equal(back["i"], torch.arange(8) + b)
        assert world >= 1
