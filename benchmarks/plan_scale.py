"""Plans at pod scale: what the first call's plan and ``describe_layout`` cost, 8 to 16,384
devices, on virtual meshes (pure index maths: no device, no runtime; docs/design.md, "Plans
that cost what the host owns").

Each case is a ``(devices / 4, 4)`` mesh over ``data`` x ``model`` with ``PER_HOST`` = 4 devices
per host (contiguous ids, as TPU hosts and ``virtual_hosts`` split them), and a batch of two
leaves, ``x`` [8, 16] f32 and ``y`` [8] i64, under the loader's default ``P(("data",
"model"))``. Methods (each the best of ``ROUNDS`` cold calls: every plan cache of the core and
of placement cleared before each):

- ``one host: first plan``: ``validate.validated_plan`` for one real host (process ``hosts //
  2``) of the pod, which places its 4 devices (a stub backend reports them as its local
  devices): what the first ``host_to_global_array`` of a process plans.
- ``one host: retained``: the bytes that plan keeps in the caches (``tracemalloc``: allocated
  after it, less before), per process.
- ``virtual hosts: first plan``: the same plan with one process playing every host
  (``make_virtual_topology``: every host's tree, every device planned).
- ``describe_layout`` and ``describe_layout + text``: ``describe_layout(mesh, spec, (2 *
  devices, 8), num_hosts=hosts)``, then also ``str()`` of it.

``python benchmarks/plan_scale.py --trees OLD NEW`` measures the same cases in fresh
interpreters against two source trees (each checkout's ``torchshard``), alternating, in one run:
the before/after of a change (the figures of docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
import tracemalloc
import types
from collections.abc import Callable, Sequence
from typing import Any

NAME = "plan_scale"
DESCRIPTION = (
    "the first call's plan (one host; virtual hosts) and describe_layout, 8 to 16,384 devices"
)
DEVICES = (8, 64, 512, 2048, 8192, 16384)
QUICK_DEVICES = (8, 64)
PER_HOST = 4
ROUNDS = 5
METHODS = {
    "one host: first plan": "ms",
    "one host: retained": "KiB",
    "virtual hosts: first plan": "ms",
    "describe_layout": "ms",
    "describe_layout + text": "ms",
}


def _clear_caches() -> None:
    """Every cache a plan fills: the core's (index maths, feeds, plans) and placement's."""
    from torchshard._core import blocks, sharding
    from torchshard._place import cache, validate

    for module in (sharding, blocks, validate):
        for value in list(vars(module).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear):
                clear()
    owners = getattr(sharding, "_OWNERS", None)  # the device -> process maps, as arrays
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
    fn()  # warm: first uses of the interpreter's and numpy's own paths are no plan's cost
    out = []
    for _ in range(rounds):
        _clear_caches()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def measure_devices(devices: int, rounds: int = ROUNDS) -> dict[str, float]:
    """The figures of ``METHODS`` for a mesh of ``devices`` (a multiple of ``PER_HOST``)."""
    import numpy as np

    from torchshard._core.layout import describe_layout
    from torchshard._core.mesh import Mesh
    from torchshard._core.spec import PartitionSpec
    from torchshard._core.topology import Topology
    from torchshard._place.call import HostCall
    from torchshard._place.validate import validated_plan
    from torchshard.testing import make_virtual_topology

    hosts = devices // PER_HOST
    mesh = Mesh(np.arange(devices).reshape(hosts, PER_HOST), ("data", "model"))
    spec = PartitionSpec(("data", "model"))
    tree = {"x": np.zeros((8, 16), np.float32), "y": np.zeros((8,), np.int64)}
    one = Topology(hosts // 2, hosts, tuple(d // PER_HOST for d in range(devices)))
    mine = one.devices_of(one.process_index)
    every = make_virtual_topology(devices, hosts)

    def one_host() -> Any:
        return validated_plan(mesh, _backend(mine), one, HostCall((tree,), spec, False))

    trees = [dict(tree) for _ in range(hosts)]

    def virtual() -> Any:
        call = HostCall(trees, spec, True)
        return validated_plan(mesh, _backend(tuple(range(devices))), every, call)

    def layout() -> Any:
        return describe_layout(mesh, spec, (2 * devices, 8), num_hosts=hosts)

    out = {
        "one host: first plan": _best(one_host, rounds) * 1e3,
        "virtual hosts: first plan": _best(virtual, max(1, rounds // 2)) * 1e3,
        "describe_layout": _best(layout, rounds) * 1e3,
        "describe_layout + text": _best(lambda: str(layout()), rounds) * 1e3,
    }
    _clear_caches()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = one_host()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    out["one host: retained"] = (after - before) / 1024
    return {m: out[m] for m in METHODS}


def run(report: Any) -> None:
    """Records every method's figure per device count (``--quick``: 8 and 64 devices)."""
    counts = QUICK_DEVICES if report.quick else DEVICES
    for devices in counts:
        report.progress(f"{NAME} {devices} devices")
        figures = measure_devices(devices, 1 if report.quick else ROUNDS)
        for method, value in figures.items():
            report.figure(NAME, f"{devices} devices", method, value, METHODS[method])
    report.notes.append(
        f"{NAME}: ({PER_HOST}-device hosts) mesh (devices/{PER_HOST}, {PER_HOST}), "
        "P(('data','model')), leaves [8,16] f32 + [8] i64; best of cold calls (caches cleared)"
    )


def _child(tree: str, devices: int) -> dict[str, float]:
    """``measure_devices(devices)`` in a fresh interpreter on ``tree``'s ``torchshard``."""
    code = (
        "import importlib.util, json, sys\n"
        f"sys.path.insert(0, {tree!r})\n"
        f"spec = importlib.util.spec_from_file_location('plan_scale', {__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import torchshard\n"
        "assert torchshard.__file__.startswith(sys.path[0]), torchshard.__file__\n"
        f"print(json.dumps(m.measure_devices({devices})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_trees(trees: Sequence[str], counts: Sequence[int] = DEVICES) -> str:
    """A table of every method per device count for each source tree, measured alternately."""
    rows = [("devices", "method", *trees)]
    for devices in counts:
        figures = [_child(tree, devices) for tree in trees]
        for method, unit in METHODS.items():
            cells = [f"{f[method]:.3g} {unit}" for f in figures]
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
