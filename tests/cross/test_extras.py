"""The optional extras, seen from outside the code that uses them: the type checker's result does
not depend on which of them an environment has installed."""

from __future__ import annotations

import ast
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What an environment that runs mypy always has: the dependencies, and pytest (the plugin's;
# the test extra, which pins mypy, brings it). mypy reads their types.
ALWAYS = {"torch", "numpy", "optree", "pytest"}


def _checked_files() -> list[pathlib.Path]:
    """The files mypy checks (``[tool.mypy] files``)."""
    out: list[pathlib.Path] = []
    for entry in PYPROJECT["tool"]["mypy"]["files"]:
        path = ROOT / entry
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def _third_party_imports(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports (dotted), other than the standard library's and this
    project's own (``torchshard``, the gate)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    own = set(sys.stdlib_module_names) | {"torchshard", "_torchshard_pytestplugin"}
    return {name for name in names if name.split(".")[0] not in own}


def _skipped(module: str) -> bool:
    """Whether mypy types ``module`` as ``Any`` whether installed or not: an override that names
    it (or ``package.*`` above it) with ``follow_imports = "skip"``, for stubs too, and
    ``ignore_missing_imports``."""
    for override in PYPROJECT["tool"]["mypy"].get("overrides", []):
        patterns = override["module"]
        patterns = [patterns] if isinstance(patterns, str) else patterns
        named = any(
            module == p or (p.endswith(".*") and (module + ".").startswith(p[:-1]))
            for p in patterns
        )
        skip = (
            override.get("follow_imports") == "skip"
            and override.get("follow_imports_for_stubs") is True
            and override.get("ignore_missing_imports") is True
        )
        if named and skip:
            return True
    return False


def test_every_optional_import_is_typed_the_same_installed_or_not():
    """mypy reads an optional library's types only where it is installed, so an import of one
    made the result depend on the environment (an unused ``type: ignore`` and a list item type
    on torch 2.14 without rich and matplotlib): each one is skipped, installed or not."""
    found: dict[str, list[str]] = {}
    for path in _checked_files():
        for module in _third_party_imports(path):
            if module.split(".")[0] not in ALWAYS:
                found.setdefault(module, []).append(path.relative_to(ROOT).as_posix())
    assert {"rich", "matplotlib", "torch_xla"} <= {m.split(".")[0] for m in found}, found
    read = {module: files for module, files in sorted(found.items()) if not _skipped(module)}
    assert read == {}, (
        "optional modules that mypy reads where they are installed (add them to the skipped "
        f"override in pyproject.toml): {read}"
    )
