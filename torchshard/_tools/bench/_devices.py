"""The torch_xla benches' meshes and sizes, from the run's device count (``--devices``).

Every XLA bench measures on the devices the run has (``--devices N`` CPU-emulated, or a TPU's
chips), not on a fixed 8: a mesh of another count than the runtime's is refused by torchshard
(a mesh covers every device exactly once). The row counts of the batches are rounded up to a
multiple of the device count, so dim 0 splits evenly (``host_to_global_array`` refuses uneven
splits); with 8 devices every size and case name is the one the bench documents. Batches of a
byte size (``batch_shape``) and their labels (``size_label``: ``4 KiB``) are the ``overhead``
bench's and the lab's ``sweep``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

KIB = 1024


def device_count() -> int:
    """The run's device count, as torch_xla's runtime reports it."""
    import torch_xla.runtime as xr

    return int(xr.global_runtime_device_count())


def grid_shape(devices: int) -> tuple[int, int]:
    """The two-axis mesh ``(data, model)``: ``(N / 2, 2)`` for an even count N, else ``(N, 1)``
    (the demo's mesh, ``_demo_common.mesh_shape``)."""
    from torchshard._tools._demo_common import mesh_shape

    return mesh_shape(devices)


def data_mesh() -> Any:
    """``(N,)`` over ``data``: every device of the run."""
    import torchshard as ts

    return ts.Mesh(np.arange(device_count()), ("data",))


def grid_mesh() -> Any:
    """``grid_shape(N)`` over ``("data", "model")``: every device of the run."""
    import torchshard as ts

    n = device_count()
    return ts.Mesh(np.arange(n).reshape(grid_shape(n)), ("data", "model"))


def label(mesh: Any) -> str:
    """A mesh's shape as the case names write it: ``(8,)``, ``(4,2)``."""
    shape = tuple(mesh.devices.shape)
    return "(" + ",".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def round_up(rows: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is at least ``rows`` (and at least one)."""
    return max(1, -(-rows // multiple)) * multiple


def size_label(nbytes: int) -> str:
    """``1024`` as ``1 KiB``, ``64 * 2**20`` as ``64 MiB``."""
    if nbytes >= KIB * KIB:
        return f"{nbytes // (KIB * KIB)} MiB"
    return f"{nbytes // KIB} KiB"


def batch_shape(nbytes: int, devices: int = 8) -> tuple[int, int]:
    """A float32 ``[rows, cols]`` of ``nbytes``, rows a multiple of ``devices`` (one block
    per device) and at least one column: more than ``nbytes`` only when ``devices`` rows of
    one float each already are."""
    rows = devices * max(1, nbytes // (devices * KIB))
    return rows, max(1, nbytes // 4 // rows)
