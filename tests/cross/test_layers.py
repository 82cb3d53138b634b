"""The package's layers: imports only run downward, there is no circle, the core is pure, and
only the backends touch the runtimes.

Layers, lowest first (``docs/design.md``, "The map"):

0. ``torchshard._core``: pure values and maths (standard library, numpy, optree).
1. ``torchshard._backend``: the protocols, the registry and the runtimes (torch_xla,
   torch.distributed).
2. ``torchshard._mesh``: the mesh bound to its backend, its context, building meshes.
3. ``torchshard._place``: host -> global -> host (call, host data, validation, plan cache,
   views, placement, replicas, read-back).
4. ``torchshard._step`` (in-step constraints and dispatch) and ``torchshard._visualize``.
5. ``torchshard.data``; 6. ``torchshard.testing``, and the plugin's gate
``_torchshard_pytestplugin`` (a top-level module, outside the package: it imports no torch until
a project asks for the plugin; read here too, so that the gate and the plugin have no circle);
7. ``torchshard`` and ``torchshard.errors``
(the public re-exports), ``torchshard.integrations`` (the stacks' adapters);
8. ``torchshard._tools`` (command line, demo, benchmarks);
9. ``torchshard.__main__``.

Above them all, outside the package: the maintainers' lab, ``benchmarks/`` at the repository
root (not in the wheel). It may import anything of torchshard; the package (and its tests, so
that ``pytest tests`` stands alone) never imports it. The wheel's bench modules
(``_tools/bench/``: what ``python -m torchshard bench`` runs) import torchshard's public modules
only, besides the bench framework (``_report``, ``_display``, ``_machine``, ``_devices``).

Every ``import`` statement counts, function-local ones included (they are how circles hid
before). Imports under ``if TYPE_CHECKING:`` run no code: they may not run up a floor either,
but they do not close a circle. The backend registry's lazy import of a backend by its module
name (``_backend.KNOWN``) is not an import statement: it is the plugin mechanism, within layer 1.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "torchshard"
GATE = PACKAGE.parent / "_torchshard_pytestplugin.py"
LAYERS = {
    "_core": 0,
    "_backend": 1,
    "_mesh": 2,
    "_place": 3,
    "_step": 4,
    "_visualize": 4,
    "data": 5,
    "testing": 6,
    "errors": 7,
    "integrations": 7,
    "_tools": 8,
}
PUBLIC = 7
MAIN = 9


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in [*sorted(PACKAGE.rglob("*.py")), GATE]}


def layer(module: str) -> int:
    parts = module.split(".")
    if module == "torchshard":
        return PUBLIC
    if module == "torchshard.__main__":
        return MAIN
    if module == GATE.stem:
        return LAYERS["testing"]
    return LAYERS[parts[1]]  # a module outside every layer fails here


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported module, line, only under TYPE_CHECKING)`` of every import statement."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: relative import"
            base = node.module or ""
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for name in names:
            out.append((name, node.lineno, node.lineno in typing_only))
    return out


def internal_edges() -> list[tuple[str, str, int, bool]]:
    edges = []
    for module in MODULES:
        for target, line, typing_only in imports(module):
            if target in (GATE.stem, "torchshard") or target.startswith("torchshard."):
                while target not in MODULES:  # `import torchshard._core.x as y` and friends
                    target = target.rsplit(".", 1)[0]
                edges.append((module, target, line, typing_only))
    return edges


def test_every_module_has_a_layer():
    assert {layer(m) for m in MODULES} == set(range(10))


def test_no_import_runs_up_a_floor():
    upward = [
        f"{m}:{line} imports {t} (layer {layer(m)} -> {layer(t)})"
        for m, t, line, _ in internal_edges()
        if layer(t) > layer(m)
    ]
    assert upward == []


def test_the_import_graph_has_no_circle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, t, _, typing_only in internal_edges():
        if not typing_only and t != m:
            graph[m].add(t)
    # The gate is read with the package: it imports the plugin (when asked), the old path's
    # shim imports the gate, and the plugin imports neither.
    assert "torchshard.testing._spmd" in graph[GATE.stem], graph[GATE.stem]
    assert GATE.stem in graph["torchshard.testing._plugin"]
    # A package's __init__ runs before any of its submodules; an import of a submodule is an
    # edge to the package too only when the package itself imports back (checked as written).
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert circles == []


def _third_party(module: str) -> set[str]:
    return {
        t.split(".")[0]
        for t, _, _ in imports(module)
        if not (t in (GATE.stem, "torchshard") or t.startswith("torchshard."))
    }


def test_the_data_feeders_import_nothing_of_the_loaders_wing():
    """``torchshard.data``'s feeders work alone, before or inside a ``DataLoader``
    (``host_sampler``, ``stream_shard``, ``sharded_collate``, ``Packer``,
    ``context_parallel_rows``, ``sharded_stream``, ``fixed_global_batches``): the loader's wing
    (``data/_loader/``) imports them, never the other way."""
    feeders = sorted(
        m for m in MODULES if m.startswith("torchshard.data._") and ".data._loader" not in m
    )
    assert feeders == [
        "torchshard.data._collate",
        "torchshard.data._cp_rows",
        "torchshard.data._fixed_batch",
        "torchshard.data._packer",
        "torchshard.data._sampler",
        "torchshard.data._sharded_stream",
        "torchshard.data._stream_shard",
    ]
    wrong = [
        f"{m}:{line} imports {t}"
        for m, t, line, _ in internal_edges()
        if m in feeders and t.startswith("torchshard.data._loader")
    ]
    assert wrong == []


def test_the_core_imports_only_the_standard_library_numpy_and_optree():
    allowed = set(sys.stdlib_module_names) | {"numpy", "optree"}
    found = {
        m: sorted(_third_party(m) - allowed)
        for m in MODULES
        if layer(m) == 0 and _third_party(m) - allowed
    }
    assert found == {}


@pytest.mark.parametrize(
    ("runtime", "owners"),
    [
        ("torch_xla", {"torchshard._backend.xla.runtime", "torchshard._backend.xla.env"}),
        (
            "torch.distributed",
            {
                "torchshard._backend.registry",
                "torchshard._backend.dtensor.backend",
                "torchshard._backend.dtensor.checks",
                "torchshard._backend.dtensor.collective",
                "torchshard._backend.dtensor.deferred",
                "torchshard._backend.dtensor.mesh",
                "torchshard._backend.dtensor.views",
                "torchshard._backend.dtensor._torch_private",
            },
        ),
    ],
)
def test_only_the_backends_import_the_runtimes(runtime, owners):
    """Below the tools, only the named backend modules import ``runtime`` (the tools may use its
    public API: the demo's optimizer step, the benchmarks' baselines)."""
    users = {
        m
        for m in MODULES
        if layer(m) < PUBLIC
        and any(t == runtime or t.startswith(runtime + ".") for t, _, _ in imports(m))
    }
    assert users == owners


def _private_torch_names(path: pathlib.Path) -> list[str]:
    """Every private torch name ``path`` imports or reaches (a dotted path under ``torch``
    with a part that starts with ``_``): ``torch._C``, ``torch.distributed.tensor._utils``,
    ``from torch.distributed.tensor.placement_types import _StridedShard``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            dotted = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = [ast.unparse(node)]
        else:
            continue
        for name in dotted:
            parts = name.split(".")
            private = [p for p in parts[1:] if p.startswith("_") and not p.endswith("__")]
            if parts[0] == "torch" and private:
                found.append(name)
    return found


def test_private_torch_names_are_imported_in_one_module():
    """torch's private names change between releases: each is imported once (with the versions
    it was checked on) and nowhere else: torch.distributed's in
    ``_backend/dtensor/_torch_private.py`` (the DTensor backend alone imports torch.distributed),
    torch's own in ``_place/_torch_private.py``."""
    users = {m: n for m, p in MODULES.items() if (n := _private_torch_names(p))}
    assert set(users) == {
        "torchshard._backend.dtensor._torch_private",  # torch.distributed's
        "torchshard._place._torch_private",  # torch's own (FakeTensor, torch.func's level)
    }, users


def _reaches_xlac(path: pathlib.Path) -> bool:
    return any(
        isinstance(node, ast.Attribute) and node.attr == "_XLAC"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_torch_xla_private_api_is_reached_only_by_its_backend():
    """... and by one bench, as its baseline: ``h2g``'s ``direct`` calls torch_xla's raw
    ``_global_tensor_from_cpu_shards`` by hand, taken from torch_xla itself (the wheel's benches
    reach no private torchshard module, ``test_the_wheel_s_benches_import_only_public_modules``)."""
    users = sorted(m for m, p in MODULES.items() if _reaches_xlac(p))
    assert users == [
        "torchshard._backend.xla.backend",
        "torchshard._backend.xla.env",
        "torchshard._backend.xla.rows",
        "torchshard._backend.xla.runtime",
        "torchshard._tools.bench.h2g",
    ]


def test_the_core_works_without_torch_and_the_runtimes():
    """Every core module imports, and the index maths and planning work, with torch, torch_xla
    and torch.distributed unavailable (``sys.modules[name] = None`` makes any import of them
    fail). ``torchshard/__init__.py`` re-exports the torch-based API, so the subprocess registers
    the package without running it (its ``__path__`` only)."""
    code = textwrap.dedent(
        """
        import importlib, importlib.util, pkgutil, sys
        for name in ("torch", "torch_xla", "torch.distributed"):
            sys.modules[name] = None
        spec = importlib.util.spec_from_file_location(
            "torchshard", PACKAGE + "/__init__.py", submodule_search_locations=[PACKAGE]
        )
        sys.modules["torchshard"] = importlib.util.module_from_spec(spec)  # not executed
        import torchshard._core as core
        names = [m.name for m in pkgutil.iter_modules(core.__path__)]
        for name in names:
            importlib.import_module("torchshard._core." + name)
        import numpy as np
        from torchshard._core.errors import IndivisibleError
        from torchshard._core.layout import describe_layout
        from torchshard._core.context import current_mesh, thread_mesh
        from torchshard._core.mesh import Mesh
        from torchshard._core.partition import complete_partition_spec_tree
        from torchshard._core.blocks import plan_from_local
        from torchshard._core.sharding import NamedSharding
        from torchshard._core.spec import DataPartitionType, P
        from torchshard._core.topology import Topology

        mesh = Mesh(np.array([3, 1, 0, 2, 7, 5, 6, 4]).reshape(4, 2), ("data", "model"))
        s = NamedSharding(mesh, P("data", "model"))
        m = s.devices_indices_map((8, 4))
        assert m[3] == (slice(0, 2), slice(0, 2)), m[3]
        assert m[4] == (slice(6, 8), slice(2, 4)), m[4]
        hosts = (0,) * 4 + (1,) * 4
        assert s.process_local_shape((8, 4), 1, device_process=hosts) == (4, 4)
        assert s.global_shape_from_local((4, 4), device_process=hosts) == (8, 4)
        assert s.process_index_and_count(0, process_index=1, device_process=hosts) == (1, 2)
        try:
            s.shard_shape((6, 4))
        except IndivisibleError:
            pass
        else:
            raise AssertionError("expected IndivisibleError")
        plan = plan_from_local(mesh, P("data"), (4, 4), hosts, tuple(range(8)))
        assert plan.global_shape == (8, 4)
        assert Topology(1, 2, hosts).devices_of(1) == (4, 5, 6, 7)
        layout = describe_layout(mesh, P("data"), (8, 4), num_hosts=2)
        assert "host 1: devices 4-7, local block shape (4, 4)" in str(layout)
        assert complete_partition_spec_tree({"a": 1, "b": [2]}, {"a": None, "b": P("x")}) == {
            "a": None, "b": [P("x")]
        }
        assert not hasattr(Mesh, "__enter__")  # the value has no context
        with thread_mesh(mesh):  # the core's context alone: no backend is told
            assert current_mesh() is mesh
        assert current_mesh() is None
        assert DataPartitionType.FULL.value == "full"
        for name in ("torch", "torch_xla", "torch.distributed"):
            assert sys.modules[name] is None, name
        loaded = [m for m, v in sys.modules.items() if v is not None]
        assert not [m for m in loaded if m.startswith(("torch.", "torch_xla."))]
        assert not [m for m in sys.modules if m.startswith("torchshard.") and "_core" not in m]
        print("pure", len(names))
        """
    )
    code = f"PACKAGE = {str(PACKAGE)!r}\n" + code
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    core = sorted(m for m in MODULES if layer(m) == 0 and m != "torchshard._core")
    assert out.stdout.split() == ["pure", str(len(core))]


ROOT = PACKAGE.parent
LAB = ROOT / "benchmarks"
BENCH = "torchshard._tools.bench"
PUBLIC_MODULES = {"torchshard", "torchshard.data", "torchshard.errors", "torchshard.testing"}
FRAMEWORK = {f"{BENCH}.{name}" for name in ("_report", "_display", "_machine", "_devices")}


def _torchshard_imports(module: str) -> list[tuple[str, int]]:
    out = []
    for target, line, _ in imports(module):
        if target == "torchshard" or target.startswith("torchshard."):
            while target not in MODULES:  # `import torchshard.x.y as z` and friends
                target = target.rsplit(".", 1)[0]
            out.append((target, line))
    return out


def test_the_wheel_s_benches_import_only_public_modules():
    """``python -m torchshard bench`` measures what users can call: its bench modules import
    ``torchshard``, ``torchshard.data``, ``torchshard.errors``, ``torchshard.testing``, the
    bench framework and each other, nothing private (torch_xla's and torch's own calls are the
    baselines). Design comparisons built from private code are the lab's (``benchmarks/``)."""
    benches = {
        m for m in MODULES if m.startswith(BENCH + ".") and not m.rpartition(".")[2].startswith("_")
    }
    assert benches == {
        f"{BENCH}.{n}"
        for n in (
            "h2g",
            "overhead",
            "dtensor",
            "h2d",
            "loader",
            "packing",
            "cp_balance",
            "torchax_h2g",
        )
    }
    allowed = PUBLIC_MODULES | FRAMEWORK | benches | {BENCH}
    private = [
        f"{m}:{line} imports {t}"
        for m in sorted(benches)
        for t, line in _torchshard_imports(m)
        if t not in allowed
    ]
    assert private == []


def _lab_imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return [n for n in names if n == "benchmarks" or n.startswith("benchmarks.")]


def test_the_package_and_its_tests_never_import_the_lab():
    """The lab (``benchmarks/``, a checkout's, not in the wheel) imports the package; the
    package never imports the lab, nor do its tests (``pytest tests`` stands alone)."""
    assert (LAB / "__init__.py").is_file()
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in (PACKAGE, ROOT / "tests")
        for path in sorted(folder.rglob("*.py"))
        for name in _lab_imports(path)
    ]
    assert found == []


def test_the_lab_imports_the_package_and_itself():
    """Every lab module imports torchshard (it measures it) and, among first-party code, only
    torchshard and the lab: never the suite's helpers (``tests/``), which only the lab's tests
    use."""
    modules = [p for p in sorted(LAB.glob("*.py")) if p.name != "__main__.py"]
    assert {p.stem for p in modules} >= {"__init__", "cli", "soak", "sweep", "_plot"}
    for path in modules:
        tops = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                tops.add((node.module or "").split(".")[0])
        assert "torchshard" in tops, path.name
        assert not tops & {"helpers", "bench_helpers", "conftest", "tests"}, path.name
