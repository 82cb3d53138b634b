"""In-step dispatch: ``index_select`` against axlearn's one-hot einsum, in one run.

Cases: a global physical batch ``[P, 1024]`` float32 with ``P`` = 256 and 1024 rows, split over
the (8,) mesh, of which ``L = P / 2`` rows are logical (8 feeds, each padded to twice its
logical rows, as ``InputDispatcher`` makes them). With ``--devices N`` the mesh is ``(N,)`` and
``P`` is rounded up to a multiple of ``2N`` and of ``2 * FEEDS`` (``physical_sizes``), so that
both ``P`` and ``L`` split evenly over the devices and the feeds. Methods, each one compiled
step (timed from tracing through ``torch_xla.sync()`` to ``wait_device_ops()``, steady state):

- ``einsum``: axlearn's ``einsum("p...,pl->l...", x, onehot)`` with the one-hot ``[P, L]`` key.
- ``index_select``: ``InputDispatcher.physical_to_logical_batch`` with its row-target key
  ``[P]`` int64 (the name is the route's first one; since issue 32 each device adds the rows it
  holds into a zero ``[L, W]`` buffer at their targets, as integers, and one reduce-scatter
  leaves each device its rows).
- ``index_select(onehot)``: the same with the one-hot key (an ``argmax`` over it first, then a
  gather of the rows as integers: a masked gather and an all-reduce), which is what
  ``dispatch_input_batch`` does with axlearn's key.

Every output is constrained to ``P("data")``. Also reported: the bytes of the dispatch tensor
each method moves to the devices per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchshard._tools.bench import _devices
from torchshard._tools.bench._report import Report, compare

NAME = "dispatch"
DESCRIPTION = "in-step dispatch: index_select vs the one-hot einsum"
WIDTH = 1024
FEEDS = 8


def keys(physical: int, logical: int) -> tuple[np.ndarray, np.ndarray]:
    """The row-target key ``[P]`` (from ``InputDispatcher``, 8 feeds) and the equivalent
    one-hot ``[P, L]`` matrix."""
    import torchshard as ts

    targets = []
    for feed in range(FEEDS):
        d = ts.InputDispatcher(
            logical,
            global_physical_batch_size=physical,
            num_physical_feeds=FEEDS,
            physical_feed_index=feed,
        )
        batch = d.logical_to_physical_batch({"x": np.zeros(d.feed_logical_batch_size)})
        targets.append(batch[ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY])
    rows = np.concatenate(targets)
    onehot = np.zeros((physical, logical), bool)
    onehot[np.flatnonzero(rows >= 0), rows[rows >= 0]] = True
    return rows, onehot


def methods(mesh: Any, physical: int) -> tuple[dict[str, Callable[[], Any]], dict[str, int]]:
    """The step of each method, and the bytes of its dispatch tensor."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torchshard as ts

    key_name = ts.PHYSICAL_TO_LOGICAL_DISPATCH_KEY
    logical = physical // 2
    rows, onehot = keys(physical, logical)
    data = np.random.default_rng(0).standard_normal((physical, WIDTH), dtype=np.float32)
    dispatcher = ts.InputDispatcher(
        logical,
        global_physical_batch_size=physical,
        num_physical_feeds=FEEDS,
        physical_feed_index=0,
    )
    spec = ts.P("data")
    with mesh:
        g = ts.host_to_global_array({"x": data, "rows": rows, "onehot": onehot}, partition=spec)
    expected = torch.from_numpy(data[np.argsort(np.where(rows >= 0, rows, physical))[:logical]])

    def run(fn: Callable[[], Any]) -> Callable[[], Any]:
        def step() -> Any:
            with mesh:
                out = fn()
            torch_xla.sync()
            xm.wait_device_ops()
            return out

        return step

    def einsum() -> Any:
        onehot_f = g["onehot"].to(g["x"].dtype)
        out = torch.einsum("p...,pl->l...", g["x"], onehot_f)
        return ts.with_sharding_constraint(out, spec)

    def index_select() -> Any:
        return dispatcher.physical_to_logical_batch({"x": g["x"], key_name: g["rows"]})["x"]

    def index_select_onehot() -> Any:
        return dispatcher.physical_to_logical_batch({"x": g["x"], key_name: g["onehot"]})["x"]

    steps = {
        "einsum": run(einsum),
        "index_select": run(index_select),
        "index_select(onehot)": run(index_select_onehot),
    }
    for name, step in steps.items():  # compile, and check every method gives the same rows
        out = step()
        with mesh:
            got = ts.replicate_to_local_data(out)
        if not torch.allclose(got, expected):
            raise RuntimeError(f"bench dispatch: {name} gives the wrong rows at P={physical}")
    nbytes = {
        "einsum": onehot.nbytes,
        "index_select": rows.nbytes,
        "index_select(onehot)": onehot.nbytes,
    }
    return steps, nbytes


def physical_sizes(devices: int) -> dict[int, bool]:
    """The cases' physical rows ``P`` on ``devices`` devices, each with whether its ratio is
    judged (the larger one's): 256 and 1024, rounded up to a multiple of ``2 * devices`` and of
    ``2 * FEEDS`` (``L = P / 2`` rows split evenly over the devices and the feeds); on many
    devices both round to the same ``P``, measured once."""
    multiple = math.lcm(2 * devices, 2 * FEEDS)
    out: dict[int, bool] = {}
    for p in (256, 1024):
        out[_devices.round_up(p, multiple)] = p == 1024
    return out


def run(report: Report) -> None:
    """Measures ms per step and the dispatch bytes of each method, and the time ratios."""
    mesh = _devices.data_mesh()
    for physical, judged in physical_sizes(mesh.size).items():
        case = f"P={physical} L={physical // 2} W={WIDTH} f32 {_devices.label(mesh)}"
        report.progress(f"dispatch {case}")
        steps, nbytes = methods(mesh, physical)
        secs = compare(steps, rounds=9)
        for method, s in secs.items():
            report.figure(NAME, case, method, s * 1e3, "ms/step")
        for method, b in nbytes.items():
            report.figure(NAME, case, method, b, "dispatch bytes")
        target = 2.0 if judged else None
        report.ratio(
            NAME, case, "index_select", "einsum", secs["einsum"] / secs["index_select"], target
        )
        report.ratio(
            NAME,
            case,
            "index_select(onehot)",
            "einsum",
            secs["einsum"] / secs["index_select(onehot)"],
        )
        report.notes.append(
            f"{case}: the one-hot key moves {nbytes['einsum']} bytes per step, the row targets "
            f"{nbytes['index_select']} ({nbytes['einsum'] / nbytes['index_select']:.0f}x fewer)."
        )
