"""The test suite mirrors the package: the tests of module ``torchshard/<wing>/<name>.py`` are in
``tests/<wing>/test_<name>.py``, each folder and name without its leading underscore
(``torchshard/_core/sharding.py`` -> ``tests/core/test_sharding.py``,
``torchshard/data/_loader/loader.py`` -> ``tests/data/loader/test_loader.py``,
``torchshard/errors.py`` -> ``tests/test_errors.py``).

The plugin's gate, ``_torchshard_pytestplugin.py`` (a top-level module: outside the package, so
that it imports no torch), belongs to the testing wing whose plugin it registers: its tests are
``tests/testing/test_torchshard_pytestplugin.py``.

Every module (but ``__init__.py`` and ``__main__.py``) has a test file of its name, and every
test file in a mirror folder names an existing module: ``test_<name>.py``, or
``test_<name>_<what>.py`` for a second file of one module's tests
(``place/test_host_to_global_properties.py``). The cross-cutting suites (parity, conformance,
failure modes, golden error texts, docs blocks, docstrings, layers, public API, examples) are
in ``tests/cross/``; the helpers the tests share (``helpers.py``, ``_multiproc.py``, the gloo
case modules, ...) are in ``tests/`` itself, and a mirror folder holds test files and at most a
``conftest.py``.

The maintainers' lab at the repository root follows the same rule one level down: the tests of
``benchmarks/<name>.py`` are in ``benchmarks/tests/test_<name>.py`` (``benchmarks/_plot.py`` ->
``benchmarks/tests/test_plot.py``), beside a ``conftest.py`` and nothing else.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchshard"
TESTS = ROOT / "tests"
GATE = ROOT / "_torchshard_pytestplugin.py"
GATE_WING = ("testing",)  # the gate's tests live with the plugin's
LAB = ROOT / "benchmarks"
LAB_TESTS = LAB / "tests"
CROSS = "cross"
NOT_MODULES = {"__init__.py", "__main__.py"}


def _mirror(parts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p.lstrip("_") for p in parts)


def modules() -> dict[tuple[str, ...], dict[str, pathlib.Path]]:
    """``{mirror folder: {name without leading underscores: module path}}``."""
    out: dict[tuple[str, ...], dict[str, pathlib.Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in NOT_MODULES or "__pycache__" in path.parts:
            continue
        folder = _mirror(path.parent.relative_to(PACKAGE).parts)
        names = out.setdefault(folder, {})
        name = path.stem.lstrip("_")
        assert name not in names, f"{path} and {names[name]} mirror to one test file name"
        names[name] = path
    out[GATE_WING][GATE.stem.lstrip("_")] = GATE
    return out


def expected_test_file(module: pathlib.Path) -> pathlib.Path:
    folder = GATE_WING if module == GATE else _mirror(module.parent.relative_to(PACKAGE).parts)
    return TESTS.joinpath(*folder, f"test_{module.stem.lstrip('_')}.py")


def _module_named(stem: str, names: dict[str, pathlib.Path]) -> str | None:
    """The module ``test_<stem>.py`` is for: ``<stem>`` itself, or the longest module name
    followed by ``_`` (``host_to_global_properties`` -> ``host_to_global``)."""
    if stem in names:
        return stem
    prefixes = [n for n in names if stem.startswith(n + "_")]
    return max(prefixes, key=len) if prefixes else None


def test_every_module_has_a_test_file_of_its_name():
    missing = [
        f"{m.relative_to(ROOT)} -> {expected_test_file(m).relative_to(ROOT)}"
        for names in modules().values()
        for m in names.values()
        if not expected_test_file(m).is_file()
    ]
    assert not missing, "modules without a test file of their name:\n" + "\n".join(missing)


def test_every_test_file_in_a_mirror_folder_names_a_module():
    known = modules()
    stray = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        if "__pycache__" in rel.parts or rel.parts[0] == CROSS:
            continue
        folder = rel.parent.parts
        if not folder and not path.name.startswith("test_"):
            continue  # a shared helper, in tests/ itself
        if path.name == "conftest.py":
            continue
        if not path.name.startswith("test_"):
            stray.append(f"tests/{rel}: a helper in a mirror folder (helpers live in tests/)")
            continue
        names = known.get(folder)
        if names is None:
            stray.append(f"tests/{rel}: tests/{'/'.join(folder)} mirrors no package folder")
        elif _module_named(path.stem.removeprefix("test_"), names) is None:
            where = next(iter(names.values())).parent.relative_to(ROOT).as_posix()
            stray.append(f"tests/{rel}: names no module of {where}/")
    assert not stray, "test files that mirror no module:\n" + "\n".join(stray)


def test_the_cross_cutting_suites_are_in_their_own_folder():
    cross = TESTS / CROSS
    suites = {p.name for p in cross.glob("test_*.py")}
    assert {
        "test_conformance.py",
        "test_parity.py",
        "test_failure_modes.py",
        "test_error_texts.py",
        "test_docs_blocks.py",
        "test_docstrings.py",
        "test_layers.py",
        "test_public_api.py",
        "test_examples.py",
        "test_layout_of_tests.py",
    } <= suites
    assert (cross / "conformance" / "index_maps.json").is_file()  # the vectors: data, kept here
    assert not (TESTS / "data" / "conformance").exists()  # tests/data/ is the data package's


def test_the_rule_maps_module_names_as_documented():
    def rel(module):
        return expected_test_file(PACKAGE / module).relative_to(ROOT).as_posix()

    assert rel("_core/sharding.py") == "tests/core/test_sharding.py"
    assert rel("data/_loader.py") == "tests/data/test_loader.py"
    assert rel("_backend/dtensor/staging.py") == "tests/backend/dtensor/test_staging.py"
    assert (
        rel("_backend/dtensor/_torch_private.py") == "tests/backend/dtensor/test_torch_private.py"
    )
    assert rel("_tools/bench/_display.py") == "tests/tools/bench/test_display.py"
    assert rel("errors.py") == "tests/test_errors.py"
    gate = expected_test_file(GATE).relative_to(ROOT).as_posix()
    assert gate == "tests/testing/test_torchshard_pytestplugin.py"
    names = {"host_to_global": 1, "host": 1, "loader": 1}
    assert _module_named("host_to_global_properties", names) == "host_to_global"
    assert _module_named("loader", names) == "loader"
    assert _module_named("loaders", names) is None


def _lab_modules() -> dict[str, pathlib.Path]:
    """``{name without leading underscores: module path}`` of the lab's modules."""
    out: dict[str, pathlib.Path] = {}
    for path in sorted(LAB.glob("*.py")):
        if path.name not in NOT_MODULES:
            name = path.stem.lstrip("_")
            assert name not in out, f"{path} and {out[name]} mirror to one test file name"
            out[name] = path
    return out


def test_every_lab_module_has_a_test_file_beside_it():
    missing = [
        f"{m.relative_to(ROOT)} -> {(LAB_TESTS / f'test_{name}.py').relative_to(ROOT)}"
        for name, m in _lab_modules().items()
        if not (LAB_TESTS / f"test_{name}.py").is_file()
    ]
    assert not missing, "lab modules without a test file of their name:\n" + "\n".join(missing)
    assert "cli" in _lab_modules() and "plot" in _lab_modules()


def test_every_lab_test_file_names_a_lab_module():
    names = _lab_modules()
    stray = [
        f"{path.relative_to(ROOT)}: names no module of benchmarks/"
        for path in sorted(LAB_TESTS.rglob("*.py"))
        if "__pycache__" not in path.parts
        and path.name != "conftest.py"
        and (
            path.parent != LAB_TESTS
            or not path.name.startswith("test_")
            or _module_named(path.stem.removeprefix("test_"), names) is None
        )
    ]
    assert not stray, "lab test files that mirror no lab module:\n" + "\n".join(stray)
    assert not list(LAB.glob("test_*.py")), "the lab's tests live in benchmarks/tests/"
