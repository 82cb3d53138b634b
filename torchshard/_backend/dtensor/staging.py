"""Host <-> accelerator copies of the DTensor backend: a ring of pinned staging buffers, a copy
stream per device, one event per batch; and read-back through pinned memory.

Host -> device (``stage``/``seal``): each block is copied into the current slot of a small ring
of pinned host buffers, then to the device with a ``non_blocking`` copy on a dedicated copy
stream (one per device and thread), so the transfer overlaps the step's work on the compute
stream. ``seal`` ends a batch: it records one event on the copy stream and moves to the next
slot; the consumer makes *its* stream wait on that event (``Ready``), so it waits for its own
batch only, never for copies of later batches or for the host. Before a slot is refilled the
host waits for the copy that last read it (the batch ``slots`` batches back).

The ring is bounded and reused: ``slots`` buffers, each sized to the bytes of the largest batch
seen (all the blocks this process places in it: the plan's local shapes). The first batch, or
one that outgrows its slot, stages the blocks that do not fit in buffers of their own, kept
until that slot's copy has ended; each slot is then allocated once at that size (when it is
next filled) and reused from then on.

Device -> host (``read_back``): every tensor is copied into pinned memory with a
``non_blocking`` copy on the current stream (after the step's work that made it), then one event
is synchronised: one synchronisation per call, whatever the number of leaves.

None of this runs for a CPU mesh (no pinning: CPU-only torch cannot pin). The device operations
are one small class (``Driver``), which the tests replace to check the ring on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchshard._backend.dtensor.device import MeshDevice

ALIGN = 64  # bytes: every block starts at a multiple of this (any dtype's alignment)
SLOTS = 2  # batches in flight in the staging ring: one being filled, one being copied


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Driver:
    """The device operations of staging, on one device: pinned memory, the copy stream,
    events. One per (thread, device)."""

    def __init__(self, device: MeshDevice) -> None:
        self.device = device.as_torch()
        self.stream = torch.Stream(device=self.device)  # the dedicated copy stream

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of ``nbytes`` bytes (uint8)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_device(self, pinned: torch.Tensor) -> torch.Tensor:
        """A ``non_blocking`` copy of ``pinned`` to the device, on the copy stream (its memory
        is allocated on that stream; ``Ready`` hands it to the consumer's)."""
        with self.stream:
            return pinned.to(self.device, non_blocking=True)

    def record(self) -> Any:
        """An event recorded on the copy stream after everything queued on it so far."""
        event = torch.Event(device=self.device)
        event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        """Blocks the host until ``event`` has happened."""
        event.synchronize()

    def consume(self, event: Any, tensors: Sequence[torch.Tensor]) -> None:
        """Makes the calling thread's current stream wait for ``event`` and tells the caching
        allocator that ``tensors`` (allocated on the copy stream) are used there."""
        stream = torch.accelerator.current_stream(self.device)
        stream.wait_event(event)
        for t in tensors:
            t.record_stream(stream)


class _Slot:
    __slots__ = ("buffer", "event", "extra", "want")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event: Any = None  # the copy that last read this slot
        self.extra: list[torch.Tensor] = []  # blocks that did not fit (kept until `event`)
        self.want = 0  # the bytes its last batch needed


class Ready:
    """A batch's hand-off: calling it on the consumer's thread makes that thread's stream wait
    for the batch's copies (and only them)."""

    __slots__ = ("_driver", "_event", "_tensors")

    def __init__(self, driver: Driver, event: Any, tensors: list[torch.Tensor]) -> None:
        self._driver, self._event, self._tensors = driver, event, tensors

    def __call__(self) -> None:
        self._driver.consume(self._event, self._tensors)


class StagingRing:
    """A bounded ring of pinned staging buffers on one device, reused batch after batch.

    ``stage(block)`` copies a CPU block to the device through the current slot and returns
    the device tensor (the copy may still be running); ``seal()`` ends the batch and returns its
    ``Ready`` (``None`` when nothing was staged).
    """

    def __init__(self, driver: Driver, slots: int = SLOTS) -> None:
        if slots < 1:
            raise ValueError(f"a staging ring needs at least one slot, but got {slots}.")
        self.driver = driver
        self.slots = [_Slot() for _ in range(slots)]
        self.k = 0  # the slot being filled
        self.open = False  # a batch is being staged in slot k
        self.used = 0  # bytes of slot k's buffer taken by this batch
        self.need = 0  # bytes this batch would take in one buffer
        self.staged: list[torch.Tensor] = []
        self.allocations = 0  # pinned buffers allocated (the ring's reuse shows here)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned memory the ring holds now."""
        return sum(
            (0 if s.buffer is None else s.buffer.numel()) + sum(e.numel() for e in s.extra)
            for s in self.slots
        )

    def _pinned(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return self.driver.pinned(nbytes)

    def _begin(self) -> _Slot:
        slot = self.slots[self.k]
        if slot.event is not None:  # the copy that last read this slot must have ended
            self.driver.wait(slot.event)
            slot.event = None
        slot.extra = []
        want = max(s.want for s in self.slots)  # the largest batch seen, in any slot
        if want and (slot.buffer is None or slot.buffer.numel() < want):
            slot.buffer = None  # free the old one first
            slot.buffer = self._pinned(want)
        self.open, self.used, self.need = True, 0, 0
        return slot

    def stage(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` (a CPU tensor, any layout) on the device, copied through the ring."""
        slot = self.slots[self.k] if self.open else self._begin()
        n = block.numel() * block.element_size()
        start = _aligned(self.used)
        self.need = _aligned(self.need) + n
        if slot.buffer is not None and start + n <= slot.buffer.numel():
            raw = slot.buffer[start : start + n]
            self.used = start + n
        else:  # the batch outgrew the slot (or the slot is new): a buffer for this block
            raw = self._pinned(n)
            slot.extra.append(raw)
        host = raw.view(block.dtype).view(block.shape) if n else block.contiguous()
        if n:
            host.copy_(block)
        out = self.driver.to_device(host)
        self.staged.append(out)
        return out

    def seal(self) -> Ready | None:
        """Ends the batch: one event on the copy stream for all of its copies."""
        if not self.open:
            return None
        slot = self.slots[self.k]
        slot.event = self.driver.record()
        slot.want = max(slot.want, self.need)
        staged, self.staged = self.staged, []
        self.open = False
        self.k = (self.k + 1) % len(self.slots)
        return Ready(self.driver, slot.event, staged)


class _Rings(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[MeshDevice, StagingRing] = {}


_RINGS = _Rings()
DRIVER: Callable[[MeshDevice], Driver] = Driver  # what makes a ring's driver (tests replace it)


def ring(device: MeshDevice) -> StagingRing:
    """The calling thread's staging ring for ``device`` (a thread stages its own batches)."""
    r = _RINGS.by_device.get(device)
    if r is None:
        r = _RINGS.by_device[device] = StagingRing(DRIVER(device))
    return r


def forget_rings() -> None:
    """Drops the calling thread's rings (their pinned buffers are freed)."""
    _RINGS.by_device.clear()


def seal_all() -> list[Ready]:
    """Ends the calling thread's batch on every device it staged to."""
    out = []
    for r in _RINGS.by_device.values():
        ready = r.seal()
        if ready is not None:
            out.append(ready)
    return out


def read_back(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors``: the accelerator's go through pinned memory with
    ``non_blocking`` copies on the current stream, then one event is synchronised (one
    synchronisation for the call); CPU tensors are cloned."""
    out: list[torch.Tensor] = []
    pending: dict[torch.device, None] = {}
    for t in tensors:
        t = t.detach()
        if t.device.type == "cpu":
            out.append(t.clone(memory_format=torch.contiguous_format))
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
        pending[t.device] = None
    for device in pending:
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        event.synchronize()
    return out
