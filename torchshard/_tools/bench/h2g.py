"""Host -> global throughput: torchshard against torch_xla's own paths, in one run.

Cases: one [1024, 2048] float32 batch, and a dict of 8 of them, on the (8,) and (4, 2)
meshes, dim 0 split over every axis (the FULL input spec); with ``--devices N`` the meshes are
``(N,)`` and ``(N / 2, 2)`` (``(N, 1)`` for odd N) and the rows a multiple of N
(``_devices``). Methods:

- ``torchshard``: ``host_to_global_array``.
- ``direct``: torch_xla's ``_XLAC._global_tensor_from_cpu_shards`` called by hand with
  per-device views (the fastest path torch_xla has; the ceiling for torchshard); the binding
  is taken from torch_xla itself (``cpu_shards_binding``), as a user's hand-written call would.
- ``to+mark_sharding``: ``x.to(xla)`` then ``xs.mark_sharding``.

Every method keeps its whole output alive until the batch is complete (as a training step
would) and ends with ``xm.wait_device_ops()``, so each is timed to completion. The mesh is
entered once around the measurement, as a training loop enters it once around its steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report, measure, paired_ratio

NAME = "h2g"
DESCRIPTION = "host -> global: torchshard vs _global_tensor_from_cpu_shards vs .to()+mark_sharding"
ROWS, COLS = 1024, 2048
QUICK_ROWS, QUICK_COLS = 64, 32  # --quick: tiny sizes for tests of the command line


def cpu_shards_binding() -> Callable[..., Any]:
    """torch_xla's raw binding ``_XLAC._global_tensor_from_cpu_shards(shards, op_sharding,
    global_shape)`` (lists only; checked on torch_xla 2.9.0), the baseline called by hand."""
    import torch_xla

    return torch_xla._XLAC._global_tensor_from_cpu_shards


def meshes() -> list[tuple[str, Any]]:
    """The benchmark meshes, over every device of the run: (N,) over "data" and (N / 2, 2)
    over ("data", "model"); (8,) and (4, 2) on 8 devices."""
    return [(_devices.label(m), m) for m in (_devices.data_mesh(), _devices.grid_mesh())]


def methods(mesh: Any, batch: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """The three host -> global methods for ``batch`` on ``mesh`` (dim 0 over every axis)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    import torchshard as ts

    spec = ts.P(mesh.axis_names)
    shapes = {k: tuple(t.shape) for k, t in batch.items()}
    index = {
        k: ts.NamedSharding(mesh, spec).devices_indices_map(shape) for k, shape in shapes.items()
    }
    op = mesh.xla_mesh.get_op_sharding((mesh.axis_names, None))
    raw = cpu_shards_binding()
    device = torch_xla.device()

    def torchshard() -> Any:  # runs inside `with mesh:` (see run)
        out = ts.host_to_global_array(batch, partition=spec)
        xm.wait_device_ops()
        return out

    def direct() -> Any:
        out = {}
        for k, t in batch.items():
            shards = [t[index[k][d]] for d in range(mesh.size)]
            out[k] = raw(shards, op, list(shapes[k]))
        xm.wait_device_ops()
        return out

    def to_mark() -> Any:
        out = {}
        for k, t in batch.items():
            out[k] = t.to(device)
            xs.mark_sharding(out[k], mesh.xla_mesh, (mesh.axis_names, None))
        xm.wait_device_ops()
        return out

    return {"torchshard": torchshard, "direct": direct, "to+mark_sharding": to_mark}


def sizes(report: Report) -> tuple[int, int]:
    """The batch shape: [ROWS, COLS], or a tiny one under ``--quick``; the rows rounded up to
    a multiple of the device count, so dim 0 splits evenly."""
    rows, cols = (QUICK_ROWS, QUICK_COLS) if report.quick else (ROWS, COLS)
    return _devices.round_up(rows, _devices.device_count()), cols


def run(report: Report) -> None:
    """Measures every case and records throughputs (GB/s) and ratios (paired, per round)."""
    rows, cols = sizes(report)
    for mesh_name, mesh in meshes():
        for leaves in (1, 8):
            case = f"{leaves}x[{rows},{cols}] f32 {mesh_name}"
            report.progress(f"h2g {case}")
            batch = {f"x{i}": torch.randn(rows, cols) for i in range(leaves)}
            nbytes = sum(t.numel() * t.element_size() for t in batch.values())
            with mesh:
                timings = measure(methods(mesh, batch))
            report.throughput(NAME, case, timings, nbytes)
            for other, target in (("direct", 0.95), ("to+mark_sharding", 1.5)):
                ratio = paired_ratio(timings, "torchshard", other)
                report.ratio(NAME, case, "torchshard", other, ratio, target)
