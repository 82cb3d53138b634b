"""CPU emulation of torch_xla's SPMD devices, set up before torch_xla creates its client.

torch_xla reads ``PJRT_DEVICE`` and ``CPU_NUM_DEVICES`` once, when its runtime starts (the first
XLA device or tensor), and SPMD mode must be enabled before the first XLA tensor exists. Entry
points (the CLI, the pytest plugin, the examples) call ``setup_cpu_emulation`` first. With
``xla.py``, the only module that touches torch_xla; it is separate because it must work before
the backend is used, and it only sets the environment and reads the runtime's state.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import sys

from torchshard._core.errors import EmulationError, MissingDependencyError
from torchshard._core.version import pip_install

INSTALL_XLA = pip_install("xla")  # "`pip install 'torchshard-input[xla]'` (from a checkout: ...)"


@functools.cache
def xla_installed() -> bool:
    """Whether torch_xla is installed (found, not imported; decided once per process)."""
    if sys.modules.get("torch_xla") is not None:
        return True
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["torch_xla"] is None
        return False


def require_xla(feature: str) -> None:
    """Raises ``MissingDependencyError`` naming the extra to install when ``feature`` (an
    XLA-only call) cannot run because torch_xla is not installed."""
    if not xla_installed():
        raise MissingDependencyError(
            f"{feature} needs torch_xla, which is not installed; install the extra with "
            f"{INSTALL_XLA}: torch-xla 2.9, which pins torch 2.9{_replaced()}. Without "
            "torch_xla, torchshard runs on torch.distributed DTensor, the default then: call "
            "torch.distributed.init_process_group(...) and build the mesh with "
            "create_device_mesh (or Mesh.from_device_mesh)."
        )


def _replaced() -> str:
    """`` (this is torch 2.14.1, which it would replace)`` when torch is not 2.9."""
    import torch

    version = torch.__version__.split("+")[0]
    return (
        "" if version.startswith("2.9.") else f" (this is torch {version}, which it would replace)"
    )


def import_error(feature: str, e: ImportError) -> MissingDependencyError:
    """The error for a torch_xla that is installed but cannot be imported (``e``): usually a
    torch_xla built for another torch release."""
    import torch

    return MissingDependencyError(
        f"{feature} needs torch_xla, which is installed but cannot be imported ({e}). "
        f"torch-xla 2.9 runs only on torch 2.9 (this is torch {torch.__version__}): "
        f"{INSTALL_XLA} installs the matching pair. Without torch_xla, torchshard runs on "
        'torch.distributed DTensor (meshes with backend="dtensor").'
    )


def tpu_present() -> bool:
    """Whether this machine has TPU devices (or was told to use them)."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def setup_cpu_emulation(num_devices: int = 8, *, force: bool = False) -> bool:
    """Emulates ``num_devices`` devices on the CPU unless a TPU is present (or ``force``).

    Sets ``PJRT_DEVICE=CPU`` and ``CPU_NUM_DEVICES`` and enables SPMD. Idempotent: calling it
    again with the count the runtime already has is fine.

    Returns:
        True when the emulation is in effect (False: a TPU is present and ``force`` is False).

    Raises:
        ValueError: ``num_devices`` is not a positive int.
        MissingDependencyError: torch_xla is not installed (the extra ``xla``).
        EmulationError: torch_xla's runtime already started with another device type or count
            (the count is fixed per process).
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(
            f"setup_cpu_emulation: num_devices must be a positive int, but got {num_devices!r}."
        )
    require_xla("setup_cpu_emulation (emulated XLA devices)")
    if not force and tpu_present():
        return False
    if "torch_xla" in sys.modules and runtime_started():
        kind, count = runtime_devices()
        if (kind, count) != ("CPU", num_devices):
            raise EmulationError(
                f"torch_xla's runtime already started with {count} {kind} device(s), but "
                f"{num_devices} emulated CPU devices were requested. The device count is fixed "
                "when the runtime starts (the first XLA device or tensor of the process), so it "
                "must be set before anything uses torch_xla: call "
                f"torchshard.setup_cpu_emulation({num_devices}) first thing in the process "
                "(the torchshard pytest plugin does it before conftest files are imported)."
            )
        _enable_spmd()
        return True
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


def runtime_devices() -> tuple[str, int]:
    """The device type (``"CPU"``, ``"TPU"``) and count of torch_xla's runtime (starts it)."""
    import torch_xla

    # torch_xla 2.9: every device of the run, named "<TYPE>:<ordinal>".
    names = torch_xla._XLAC._xla_get_all_runtime_devices()
    kinds = {n.split(":", 1)[0] for n in names}
    return (kinds.pop() if len(kinds) == 1 else "/".join(sorted(kinds))), len(names)


def runtime_started() -> bool:
    """Whether torch_xla's runtime (its PJRT client) exists in this process."""
    try:
        import torch_xla

        # torch_xla 2.9: True once the PJRT client exists.
        return bool(torch_xla._XLAC._xla_runtime_is_initialized())
    except (ImportError, AttributeError):
        return "torch_xla" in sys.modules


def _enable_spmd() -> None:
    try:
        import torch_xla.runtime as xr
    except ImportError as e:
        raise import_error("setup_cpu_emulation (emulated XLA devices)", e) from e

    if not xr.is_spmd():
        xr.use_spmd()
