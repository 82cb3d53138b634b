"""The DTensor backend's host <-> accelerator staging (torchshard._backend.dtensor.staging), on
a CPU driver (``_device_cases.FakeDriver``): staged blocks keep their values and layouts, the
ring of pinned buffers is bounded and reused, a slot is refilled only after the copy that read
it, one event per batch, and read-back copies. The same paths on CUDA are in
tests/cross/test_cuda.py."""

from __future__ import annotations

import _device_cases as cases
import torch

from torchshard._backend.dtensor import staging


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
