"""Per-call cost of ``host_to_global_array`` on small per-host batches, against the raw call.

With small batches the transfer itself is short, so what torchshard adds per call (finding the
mesh, backend and topology, flattening the tree, looking the call's plans up, cutting the views)
shows. Cases: 4 KiB, 64 KiB and 256 KiB per host, in 1 leaf or in 8 leaves of an eighth each
(a dict), float32, mesh ``(8,)`` over ``data`` (``(N,)`` with ``--devices N``; at least a row
per device), dim 0 split over the devices; the plans are
cached (the warm-up calls plan them), as in a training loop. Methods are ``h2g``'s
``torchshard`` and ``direct`` (torch_xla's raw ``_global_tensor_from_cpu_shards`` binding called
by hand on per-device views), each to completion (``wait_device_ops``), in interleaved rounds;
figures are microseconds per call (best round). Target: torchshard >= 0.9x the raw call's speed
in every case. A third method, the raw binding on views made with one ``tensor_split`` per
leaf, is the floor: what any wrapper adds shows against it (no target).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchshard._tools.bench import _devices
from torchshard._tools.bench._devices import KIB, batch_shape, size_label
from torchshard._tools.bench._report import Report, measure, paired_ratio
from torchshard._tools.bench.h2g import cpu_shards_binding, methods

NAME = "overhead"
DESCRIPTION = "per-call cost on small batches (4-256 KiB/host): torchshard vs the raw binding"
SIZES = (4 * KIB, 64 * KIB, 256 * KIB)
QUICK_SIZES = (4 * KIB,)
TARGET = 0.9
SPLIT = "direct, tensor_split views"


def run(report: Report) -> None:
    """Measures microseconds per call of both methods; records the ratios against the target."""
    mesh = _devices.data_mesh()
    for nbytes in QUICK_SIZES if report.quick else SIZES:
        for leaves in (1, 8):
            case = f"{size_label(nbytes)}/host, " + (
                "1 leaf" if leaves == 1 else f"{leaves} leaves"
            )
            report.progress(f"overhead {case}")
            per_leaf = batch_shape(nbytes // leaves, mesh.size)
            batch = {f"x{i}": torch.randn(per_leaf) for i in range(leaves)}
            with mesh:  # entered once, as around a training loop
                both = methods(mesh, batch)
                compared = {m: both[m] for m in ("torchshard", "direct")}
                compared[SPLIT] = split_views(mesh, batch)
                timings = measure(compared, rounds=21, min_seconds=0.02)
            for method, t in timings.items():
                report.figure(
                    NAME,
                    case,
                    method,
                    1e6 * t.best,
                    "us/call",
                    spread=t.spread,
                    median=1e6 * t.median,
                )
            ratio = paired_ratio(timings, "torchshard", "direct")
            report.ratio(NAME, case, "torchshard", "direct", ratio, TARGET)
            report.ratio(
                NAME, case, "torchshard", SPLIT, paired_ratio(timings, "torchshard", SPLIT)
            )


def split_views(mesh: Any, batch: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """The raw binding on views made the cheapest way by hand: one ``tensor_split`` per leaf
    (right for dim 0 split over the devices in id order, as here); the floor under any
    wrapper's per-call cost."""
    import torch_xla.core.xla_model as xm

    raw = cpu_shards_binding()
    op = mesh.xla_mesh.get_op_sharding((mesh.axis_names, None))
    shapes = {k: list(t.shape) for k, t in batch.items()}

    def call() -> Any:
        out = {k: raw(t.tensor_split(mesh.size, 0), op, shapes[k]) for k, t in batch.items()}
        xm.wait_device_ops()
        return out

    return call
