"""Plans at pod scale: what the first call's plan and ``describe_layout`` cost, 2 to 16,384
devices, on virtual meshes (pure index maths: no device, no runtime; docs/design.md, "A plan
costs what its host owns").

Each case is a ``(hosts, devices / hosts)`` mesh over ``data`` x ``model`` with ``PER_HOST`` = 4
devices per host (2 devices: one host of 2; contiguous ids, as TPU hosts and ``virtual_hosts``
split them), and a batch of two leaves, ``x`` [8, 16] f32 and ``y`` [8] i64, under the loader's
default ``P(("data", "model"))``. Times are the CPU time of the measuring thread, best of
``ROUNDS`` cold calls (every plan cache of the core and of placement cleared before each): on a
machine shared with other work the wall clock measures the neighbours. Methods:

- ``one host: first plan``: ``validate.validated_plan`` for one real host (process ``hosts //
  2``) of the pod, which places its 4 devices (a stub backend reports them as its local
  devices): what the first ``host_to_global_array`` of a process plans.
- ``one host: kept``: the bytes that first plan keeps (``tracemalloc``: allocated after it, less
  before: the caches), and ``one host: peak``: the most it held during the call (the O(devices)
  integer arrays it reads the mesh with, freed by its end).
- ``one host: kept per call``: what each further call keeps that plans a new leaf shape (8
  calls, rows 16, 24, ...: each adds its plans to the caches), per call.
- ``virtual hosts: first plan``: the same plan with one process playing every host
  (``make_virtual_topology``: every host's tree, every device planned), and ``virtual hosts:
  per host``, that time over the hosts.
- ``describe_layout``, ``describe_layout + str``: ``describe_layout(mesh, spec, (2 * devices,
  8), num_hosts=hosts)``, then also ``str()`` of it; ``layout command``: ``python -m torchshard
  layout`` of that layout, in this process, its output to a string (with ``rich`` when
  installed, as by default; the interpreter's start not counted).

Before/after in one run: ``PLAN_SCALE_BEFORE=/path/to/old/checkout python -m benchmarks
plan_scale`` measures every device count in fresh interpreters on the old checkout's
``torchshard`` and on this one, alternately, and records both (``... (before)``) with their
ratios; ``python benchmarks/plan_scale.py --trees OLD NEW`` prints the same as one table.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import os
import pathlib
import subprocess
import sys
import time
import tracemalloc
import types
from collections.abc import Callable, Sequence
from typing import Any

NAME = "plan_scale"
DESCRIPTION = (
    "the first call's plan (one host; virtual hosts), what it keeps, and describe_layout with "
    "its text, 2 to 16,384 devices"
)
DEVICES = (2, 8, 64, 512, 2048, 8192, 16384)
QUICK_DEVICES = (8, 64)
PER_HOST = 4
ROUNDS = 5
BUDGET_S = 3.0  # a method stops repeating once its rounds took this long (the old text: seconds)
NEW_SHAPES = 8  # later calls, each with a new leaf shape: what a call keeps
BEFORE_ENV = "PLAN_SCALE_BEFORE"
METHODS = {
    "one host: first plan": "ms",
    "one host: kept": "KiB",
    "one host: peak": "KiB",
    "one host: kept per call": "KiB",
    "virtual hosts: first plan": "ms",
    "virtual hosts: per host": "ms",
    "describe_layout": "ms",
    "describe_layout + str": "ms",
    "layout command": "ms",
}
COMPARED = ("one host: first plan", "one host: kept", "describe_layout + str", "layout command")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _clear_caches() -> None:
    """Every cache a plan fills: the core's (index maths, feeds, plans) and placement's."""
    from torchshard._core import blocks, sharding
    from torchshard._place import cache, validate

    for module in (sharding, blocks, validate):
        for value in list(vars(module).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear):
                clear()
    owners = getattr(sharding, "_OWNERS", None)  # an older tree's device -> process arrays
    if owners is not None:
        owners.clear()
    cache.clear()


def _backend(local: tuple[int, ...]) -> Any:
    """A backend whose local devices are ``local``: the plan needs nothing else of it."""
    place = types.SimpleNamespace(
        local_devices=lambda mesh: local,
        is_global=lambda x: False,
        devices_in_host_memory=lambda: False,
    )
    return types.SimpleNamespace(place=place, limits=None)


def _best(fn: Callable[[], Any], rounds: int) -> float:
    """The least CPU time of this thread over ``rounds`` cold calls of ``fn`` (fewer once they
    took ``BUDGET_S``), in seconds."""
    fn()  # warm: first uses of the interpreter's, numpy's and rich's own paths are no plan's
    out: list[float] = []
    while len(out) < rounds and sum(out) < BUDGET_S:
        _clear_caches()
        gc.collect()
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return min(out)


def _kept(first: Callable[[], Any], later: Sequence[Callable[[], Any]]) -> tuple[float, ...]:
    """Bytes (``tracemalloc``) kept by ``first`` after a cold start, its peak above the start,
    and kept per call of ``later``: what the caches hold once each call's result is dropped."""
    _clear_caches()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        first()
        peak = tracemalloc.get_traced_memory()[1]
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0]
        for fn in later:
            fn()
        gc.collect()
        more = tracemalloc.get_traced_memory()[0] - kept
    finally:
        tracemalloc.stop()
    return kept - base, peak - base, more / max(1, len(later))


def measure_devices(devices: int, rounds: int = ROUNDS) -> dict[str, float]:
    """The figures of ``METHODS`` for a mesh of ``devices`` (1 host of 2, or hosts of
    ``PER_HOST``)."""
    import numpy as np

    from torchshard._core.layout import describe_layout
    from torchshard._core.mesh import Mesh
    from torchshard._core.spec import PartitionSpec
    from torchshard._core.topology import Topology
    from torchshard._place.call import HostCall
    from torchshard._place.validate import validated_plan
    from torchshard._tools import cli
    from torchshard.testing import make_virtual_topology

    hosts = max(1, devices // PER_HOST)
    per = devices // hosts
    mesh = Mesh(np.arange(devices).reshape(hosts, per), ("data", "model"))
    spec = PartitionSpec(("data", "model"))
    one = Topology(hosts // 2, hosts, tuple(d // per for d in range(devices)))
    mine = _backend(one.devices_of(one.process_index))

    def batch(rows: int = 8) -> dict[str, Any]:
        return {"x": np.zeros((rows, 16), np.float32), "y": np.zeros((rows,), np.int64)}

    def one_host(rows: int = 8) -> Any:
        return validated_plan(mesh, mine, one, HostCall((batch(rows),), spec, False))

    every = make_virtual_topology(devices, hosts)
    trees = [batch() for _ in range(hosts)]
    all_devices = _backend(tuple(range(devices)))

    def virtual() -> Any:
        return validated_plan(mesh, all_devices, every, HostCall(trees, spec, True))

    def layout() -> Any:
        return describe_layout(mesh, spec, (2 * devices, 8), num_hosts=hosts)

    command = ["layout", "--mesh", f"{hosts},{per}", "--axes", "data,model"]
    command += ["--spec", "('data','model')", "--shape", f"{2 * devices},8", "--hosts", str(hosts)]

    def printed() -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(command)
        if status != 0 or not out.getvalue():
            raise RuntimeError(f"python -m torchshard {' '.join(command)}: status {status}")

    plan = _best(one_host, rounds)
    virtual_s = _best(virtual, max(1, rounds // 2))
    later = [functools.partial(one_host, 8 * (2 + i)) for i in range(NEW_SHAPES)]  # new shapes
    kept, peak, per_call = _kept(one_host, later)
    out = {
        "one host: first plan": plan * 1e3,
        "one host: kept": kept / 1024,
        "one host: peak": peak / 1024,
        "one host: kept per call": per_call / 1024,
        "virtual hosts: first plan": virtual_s * 1e3,
        "virtual hosts: per host": virtual_s * 1e3 / hosts,
        "describe_layout": _best(layout, rounds) * 1e3,
        "describe_layout + str": _best(lambda: str(layout()), rounds) * 1e3,
        "layout command": _best(printed, rounds) * 1e3,
    }
    return {m: out[m] for m in METHODS}


def _record(report: Any, devices: int, figures: dict[str, float], suffix: str = "") -> None:
    for method, value in figures.items():
        report.figure(NAME, f"{devices} devices", method + suffix, value, METHODS[method])


def run(report: Any) -> None:
    """Records every method's figure per device count (``--quick``: 8 and 64 devices); with
    ``PLAN_SCALE_BEFORE`` set to an old checkout, that checkout's figures too (``... (before)``,
    each count measured in fresh interpreters, alternately) and the ratios before / after."""
    counts = QUICK_DEVICES if report.quick else DEVICES
    before = os.environ.get(BEFORE_ENV)
    for devices in counts:
        report.progress(f"{NAME} {devices} devices")
        if not before:
            _record(report, devices, measure_devices(devices, 1 if report.quick else ROUNDS))
            continue
        old = _child(before, devices, report.quick)
        new = _child(str(ROOT), devices, report.quick)
        _record(report, devices, old, " (before)")
        _record(report, devices, new)
        for method in COMPARED:
            if new.get(method, 0) > 0 and method in old:
                report.ratio(
                    NAME,
                    f"{devices} devices",
                    f"{method} (before)",
                    method,
                    old[method] / new[method],
                )
    report.notes.append(
        f"{NAME}: ({PER_HOST}-device hosts) mesh (hosts, devices/hosts), P(('data','model')), "
        "leaves [8,16] f32 + [8] i64; thread CPU time, best of cold calls (caches cleared)"
        + (f"; before: {before}" if before else "")
    )


def _child(tree: str, devices: int, quick: bool = False) -> dict[str, float]:
    """``measure_devices(devices)`` in a fresh interpreter on ``tree``'s ``torchshard``."""
    rounds = 1 if quick else ROUNDS
    code = (
        "import importlib.util, json, sys\n"
        f"sys.path.insert(0, {tree!r})\n"
        f"spec = importlib.util.spec_from_file_location('plan_scale', {__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import torchshard\n"
        "assert torchshard.__file__.startswith(sys.path[0]), torchshard.__file__\n"
        f"print(json.dumps(m.measure_devices({devices}, {rounds})))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", BEFORE_ENV)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tree, env=env
    )
    if done.returncode:
        raise RuntimeError(f"plan_scale on {tree} ({devices} devices) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_trees(trees: Sequence[str], counts: Sequence[int] = DEVICES) -> str:
    """A table of every method per device count for each source tree, measured alternately."""
    rows = [("devices", "method", *trees)]
    for devices in counts:
        figures = [_child(tree, devices) for tree in trees]
        for method, unit in METHODS.items():
            cells = [f"{f[method]:.3g} {unit}" if method in f else "-" for f in figures]
            rows.append((str(devices), method, *cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


if __name__ == "__main__":  # python benchmarks/plan_scale.py --trees OLD NEW [--devices 8,64]
    args = sys.argv[1:]
    if not args or args[0] != "--trees":
        raise SystemExit("usage: python benchmarks/plan_scale.py --trees OLD NEW [--devices N,..]")
    rest = args[1:]
    counts: Sequence[int] = DEVICES
    if "--devices" in rest:
        i = rest.index("--devices")
        counts = [int(n) for n in rest[i + 1].split(",")]
        rest = rest[:i] + rest[i + 2 :]
    print(compare_trees(rest, counts))
