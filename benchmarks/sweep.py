"""Host -> global throughput against batch size, 1 KiB to 64 MiB per host, in one run.

Mesh (8,) (``(N,)`` with ``--devices N``), dim 0 split over ``data``; a float32 batch of
``size`` bytes (at least a row per device: more, when N rows of the size would be empty).
Methods: the three of
``h2g`` (``torchshard``, ``direct`` = ``_global_tensor_from_cpu_shards`` by hand,
``to+mark_sharding``) and ``memcpy``: one plain copy of the same bytes into a preallocated host
buffer, the local ceiling (the transfer to the devices has at least that much to move).
``python -m benchmarks sweep --plot PATH`` draws these figures (``_plot``).

The copy is ``np.copyto`` on the tensors' numpy views (a single-threaded memcpy), not
``Tensor.copy_``: above 32768 elements ``copy_`` splits the copy over torch's OpenMP threads,
and on a 2-core machine shared with other processes those threads wait for each other. Measured
there with one other busy process: ``copy_`` of 256 KiB ran at 1.1 GB/s with 2 threads and at
44 GB/s with 1, which made the "ceiling" fall below the methods it bounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchshard._tools.bench import _devices
from torchshard._tools.bench._devices import KIB, batch_shape, size_label
from torchshard._tools.bench._report import Report, measure, paired_ratio
from torchshard._tools.bench.h2g import methods

NAME = "sweep"
DESCRIPTION = "host -> global GB/s vs batch size (1 KiB - 64 MiB): torchshard, torch_xla, memcpy"
SIZES = tuple(KIB * 4**k for k in range(9))  # 1 KiB, 4 KiB, ..., 64 MiB
QUICK_SIZES = (KIB, 16 * KIB)
METHODS = ("torchshard", "direct", "to+mark_sharding", "memcpy")


def label_bytes(label: str) -> int:
    """The inverse of ``size_label``."""
    n, unit = label.split()
    return int(n) * {"KiB": KIB, "MiB": KIB * KIB}[unit]


def run(report: Report) -> None:
    """Measures every method at every size; records GB/s and the ratios to torchshard."""

    mesh = _devices.data_mesh()
    sizes = QUICK_SIZES if report.quick else SIZES
    for nbytes in sizes:
        case = size_label(nbytes)
        report.progress(f"sweep {case} per host")
        x = torch.randn(batch_shape(nbytes, mesh.size))
        src, dst = x.numpy(), np.empty_like(x.numpy())

        def memcpy(src: Any = src, dst: Any = dst) -> Any:
            return np.copyto(dst, src)

        with mesh:  # entered once, as around a training loop
            timings = measure(
                methods(mesh, {"x": x}) | {"memcpy": memcpy}, rounds=9, min_seconds=0.02
            )
        report.throughput(NAME, case, timings, x.numel() * x.element_size())
        for other in ("direct", "to+mark_sharding", "memcpy"):
            report.ratio(
                NAME, case, "torchshard", other, paired_ratio(timings, "torchshard", other)
            )
