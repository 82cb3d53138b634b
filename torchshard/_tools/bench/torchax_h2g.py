"""Host -> global on the torchax backend (PyTorch on JAX): torchshard against JAX's own
``jax.make_array_from_process_local_data``, in one run (``bench --backend torchax``).

Cases: the ``h2g`` batches (one [1024, 2048] float32 batch, and a dict of 8 of them) on JAX's
devices (``--devices N`` CPU devices, ``XLA_FLAGS=--xla_force_host_platform_device_count``, or a
TPU's chips), on the ``(N,)`` and ``(N / 2, 2)`` meshes, dim 0 split over every axis. Methods:

- ``torchshard``: ``host_to_global_array`` on a ``backend="torchax"`` mesh: torchax tensors.
- ``make_array_from_process_local_data``: JAX's own call per leaf, with the ``NamedSharding``
  built once beforehand (what axlearn's ``host_to_global_array`` calls; the baseline, goal
  ``torchshard`` >= 0.95x of it). Its results are ``jax.Array``s, not yet torchax tensors.
- ``device_put(whole)``: ``jax.device_put`` of the whole batch to the sharding, the way
  torchax's own examples feed a step (every host holding the global batch).

Each method keeps its whole output until the batch is complete and ends with
``jax.block_until_ready`` of it, so each is timed to completion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchshard._tools.bench._report import Report, measure, paired_ratio

NAME = "torchax"
DESCRIPTION = (
    "torchax backend: host -> global, torchshard vs JAX's make_array_from_process_local_data"
)
ROWS, COLS = 1024, 2048
QUICK_ROWS, QUICK_COLS = 64, 32
TARGET = 0.95  # torchshard against JAX's own call


def meshes() -> list[tuple[str, Any]]:
    """``(N,)`` over ``data`` and ``(N / 2, 2)`` over ``(data, model)`` (``(N, 1)`` for odd
    N), every JAX device (a missing jax or torchax: ``MissingDependencyError``, the extra)."""
    import torchshard as ts

    n = ts.create_device_mesh((-1,), ("data",), backend="torchax").size
    grid = (n // 2, 2) if n % 2 == 0 else (n, 1)
    out = []
    for shape, names in (((n,), ("data",)), (grid, ("data", "model"))):
        mesh = ts.create_device_mesh(shape, names, backend="torchax")
        label = "(" + ",".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"
        out.append((label, mesh))
    return out


def methods(mesh: Any, batch: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """The three host -> global methods for ``batch`` on ``mesh`` (dim 0 over every axis)."""
    import jax

    import torchshard as ts

    spec = ts.P(mesh.axis_names)
    sharding = jax.sharding.NamedSharding(
        mesh.jax_mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names))
    )
    arrays = {k: t.numpy() for k, t in batch.items()}  # views: the host batch as JAX takes it

    def torchshard() -> Any:  # runs inside `with mesh:` (see run)
        out = ts.host_to_global_array(batch, partition=spec)
        jax.block_until_ready([t.jax() for t in out.values()])
        return out

    def local_data() -> Any:
        out = {k: jax.make_array_from_process_local_data(sharding, a) for k, a in arrays.items()}
        return jax.block_until_ready(out)

    def device_put() -> Any:
        return jax.block_until_ready({k: jax.device_put(a, sharding) for k, a in arrays.items()})

    return {
        "torchshard": torchshard,
        "make_array_from_process_local_data": local_data,
        "device_put(whole)": device_put,
    }


def run(report: Report) -> None:
    """Measures every case and records throughputs (GB/s) and the ratios."""
    cases = meshes()  # first: the extra's check
    import jax

    n = len(jax.devices())
    rows, cols = (QUICK_ROWS, QUICK_COLS) if report.quick else (ROWS, COLS)
    rows = max(1, -(-rows // n)) * n
    for mesh_name, mesh in cases:
        for leaves in (1, 8):
            case = f"{leaves}x[{rows},{cols}] f32 {mesh_name}"
            report.progress(f"torchax {case}")
            gen = torch.Generator().manual_seed(leaves)
            batch = {f"x{i}": torch.randn(rows, cols, generator=gen) for i in range(leaves)}
            nbytes = sum(t.numel() * t.element_size() for t in batch.values())
            with mesh:
                timings = measure(methods(mesh, batch))
            report.throughput(NAME, case, timings, nbytes)
            ratio = paired_ratio(timings, "torchshard", "make_array_from_process_local_data")
            report.ratio(
                NAME, case, "torchshard", "make_array_from_process_local_data", ratio, TARGET
            )
            ratio = paired_ratio(timings, "torchshard", "device_put(whole)")
            report.ratio(NAME, case, "torchshard", "device_put(whole)", ratio)
    platform = jax.devices()[0].platform
    report.notes.append(
        f"torchax: jax {jax.__version__} on {n} {platform} device(s), one process; "
        "make_array_from_process_local_data is JAX's own host -> global (jax.Arrays), "
        "torchshard's results are torchax tensors over the same arrays"
    )
