"""CPU emulation of an SPMD device mesh, set up before torch_xla creates its client.

torch_xla reads ``PJRT_DEVICE`` and ``CPU_NUM_DEVICES`` once, when its runtime starts, and SPMD
mode must be enabled before the first XLA tensor exists. Entry points (the CLI, the pytest
plugin, the examples) call ``setup_cpu_emulation`` first.
"""

from __future__ import annotations

import glob
import os
import sys


def tpu_present() -> bool:
    """Whether this machine has TPU devices (or was told to use them)."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def setup_cpu_emulation(num_devices: int = 8, *, force: bool = False) -> bool:
    """Emulates ``num_devices`` devices on the CPU unless a TPU is present (or ``force``).

    Returns True when the emulation is in effect. Raises ``RuntimeError`` when torch_xla's
    runtime already started with another device count (the count is fixed per process).
    """
    if not force and tpu_present():
        return False
    if "torch_xla" in sys.modules:
        current = os.environ.get("CPU_NUM_DEVICES")
        if os.environ.get("PJRT_DEVICE") == "CPU" and current == str(num_devices):
            _enable_spmd()
            return True
        if _runtime_started():
            raise RuntimeError(
                f"torch_xla was already initialised (PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}"
                f", CPU_NUM_DEVICES={current}); the emulated device count ({num_devices}) must "
                "be set before torch_xla starts. Set it first thing in the process."
            )
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(num_devices)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # XLA's CPU client runs the devices' programs and the host->device copies on one pool of
    # max(cores, devices) threads (PJRT_NPROC overrides the core count). A collective step holds
    # one pool thread per device until every device joins, so with no spare thread a copy or a
    # queued program can starve the last device: the rendezvous aborts the process after 10 s.
    # Seen on 2 cores x 8 devices with batches transferred while steps run (docs/design.md).
    os.environ.setdefault("PJRT_NPROC", str(2 * num_devices))
    _enable_spmd()
    return True


def _runtime_started() -> bool:
    try:
        import torch_xla

        return bool(torch_xla._XLAC._xla_runtime_is_initialized())
    except (ImportError, AttributeError):
        return "torch_xla" in sys.modules


def _enable_spmd() -> None:
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()
