"""Global -> host: ``global_to_host_array`` (local shards) against ``.cpu()`` (all-gather).

``.cpu()`` on a sharded tensor compiles and runs a gather on every call; torchshard reads the
local shards (no compilation) and concatenates them. Same cases as ``h2g``.
"""

from __future__ import annotations

from typing import Any

import torch

from torchshard._tools.bench._report import Report, measure, paired_ratio
from torchshard._tools.bench.h2g import meshes, sizes

NAME = "g2h"
DESCRIPTION = "global -> host: global_to_host_array vs .cpu()"


def run(report: Report) -> None:
    """Measures read-back throughput (GB/s) and the ratio torchshard / ``.cpu()``."""
    import torchshard as ts

    rows, cols = sizes(report)
    for mesh_name, mesh in meshes():
        for leaves in (1, 8):
            case = f"{leaves}x[{rows},{cols}] f32 {mesh_name}"
            report.progress(f"g2h {case}")
            batch = {f"x{i}": torch.randn(rows, cols) for i in range(leaves)}
            nbytes = sum(t.numel() * t.element_size() for t in batch.values())
            with mesh:
                glob = ts.host_to_global_array(batch, partition=ts.P(mesh.axis_names))

            def torchshard(glob: Any = glob) -> None:  # inside `with mesh:` (below)
                ts.global_to_host_array(glob)

            def cpu(glob: Any = glob) -> None:
                for t in glob.values():
                    t.cpu()

            with mesh:  # entered once, as around a training loop
                timings = measure({"torchshard": torchshard, ".cpu()": cpu}, rounds=7)
            report.throughput(NAME, case, timings, nbytes)
            report.ratio(
                NAME, case, "torchshard", ".cpu()", paired_ratio(timings, "torchshard", ".cpu()")
            )
