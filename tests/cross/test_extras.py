"""The optional extras, seen from outside the code that uses them: every install command the
package, the docs, the examples and the tests print names the distribution's real name
(``torchshard-input``; the index's ``torchshard`` is an unrelated project) or a checkout, and
the package builds its own with one helper (``version.pip_install``); importing torchshard
imports no stack; the type checker's result does not depend on which extras an environment has
installed."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What an environment that runs mypy always has: the dependencies, and pytest (the plugin's;
# the test extra, which pins mypy, brings it). mypy reads their types.
ALWAYS = {"torch", "numpy", "optree", "pytest"}


# Where install commands are written: the package, the gate, the docs, the examples, the tests,
# the benchmarks, CI and the top-level files.
ROOTS = ("torchshard", "docs", "examples", "tests", "benchmarks", ".ci")
TOP = ("README.md", "CHANGELOG.md", "pyproject.toml", "mkdocs.yml", "_torchshard_pytestplugin.py")
TEXT = {".py", ".md", ".toml", ".txt", ".yml", ".yaml", ".cfg", ".ini", ".sh", ""}
PIP_INSTALL = re.compile(r"""\bpip"?\s+install\b""")
# One argument of the command: quoted, or up to a space, a backtick or the end of a sentence
# (a parenthesis, a comma, a semicolon, a shell operator).
ARGUMENT = re.compile(r"""\s*('[^'`]*'|"[^"`]*"|[^\s`'"(),;|&]+)""")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _files() -> list[pathlib.Path]:
    found = [ROOT / name for name in TOP]
    for root in ROOTS:
        found += [
            p
            for p in sorted((ROOT / root).rglob("*"))
            if p.is_file() and p.suffix in TEXT and "__pycache__" not in p.parts
        ]
    return [p for p in found if p.is_file() and p.resolve() != pathlib.Path(__file__).resolve()]


def install_commands(text: str) -> list[str]:
    """Every ``pip install ...`` command in ``text``, as far as its arguments go."""
    commands = []
    for match in PIP_INSTALL.finditer(text):
        end = match.end()
        while (arg := ARGUMENT.match(text, end)) is not None:
            end = arg.end()
        commands.append(text[match.start() : end])
    return commands


def installs(command: str) -> set[str]:
    """What of this project ``command`` installs: ``"distribution"`` (``torchshard-input``,
    with or without extras and versions), ``"checkout"`` (``.``, ``.[xla]``, a path), and
    ``"wrong"`` (the index's unrelated ``torchshard``)."""
    found = set()
    start = PIP_INSTALL.search(command)
    assert start is not None, command
    for arg in ARGUMENT.findall(command[start.end() :]):
        arg = arg.strip("'\"")
        name = NAME.match(arg)
        if arg.startswith((".", "/")):
            found.add("checkout")
        elif name is not None and not arg.startswith("-"):
            normal = re.sub(r"[-_.]+", "-", name.group().lower())
            if normal == "torchshard":
                found.add("wrong")
            elif normal == "torchshard-input":
                found.add("distribution")
    return found


def test_the_check_tells_the_real_distribution_from_the_unrelated_one():
    assert installs("pip install 'torchshard[stacks]'") == {"wrong"}  # 0.1.0's hint
    assert installs("pip install torchshard==0.1.0") == {"wrong"}
    assert installs("pip install 'torchshard-input[xla]'") == {"distribution"}
    assert installs("pip install -U torchshard_input") == {"distribution"}
    assert installs("pip install -e '.[xla,test]'") == {"checkout"}
    assert installs('"$venv/bin/pip" install -q -e .') == {"checkout"}
    assert installs("pip install psutil") == set()
    text = "install it (`pip install lightning`, or `pip install 'torchshard[stacks]'` for all)"
    assert install_commands(text) == ["pip install lightning", "pip install 'torchshard[stacks]'"]
    text = "needs psutil: pip install psutil (or pip install -e '.[test]')."
    assert install_commands(text) == ["pip install psutil", "pip install -e '.[test]'"]


def test_every_install_command_names_the_distribution_or_a_checkout():
    """``pip install 'torchshard[...]'`` installs the index's unrelated ``torchshard``."""
    files = _files()
    assert {"README.md", "docs/stacks.md", "torchshard/_core/version.py"} <= {
        p.relative_to(ROOT).as_posix() for p in files
    }
    wrong = [
        f"{p.relative_to(ROOT)}:{n}: {command}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for command in install_commands(line)
        if "wrong" in installs(command)
    ]
    assert wrong == [], "install commands that install the unrelated torchshard:\n" + "\n".join(
        wrong
    )


def _strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """The string constants of ``path``'s code (f-strings' literal parts included), without
    the docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_the_package_builds_its_install_commands_with_one_helper():
    """Every install command of torchshard's messages comes from ``version.pip_install``, so
    the distribution's name is written once; the helper's own command installs it by its
    name, and from a checkout."""
    from torchshard._core.version import DISTRIBUTION, pip_install

    helper = ROOT / "torchshard" / "_core" / "version.py"
    elsewhere = [
        f"{p.relative_to(ROOT)}:{line}: {text!r}"
        for p in [
            *sorted((ROOT / "torchshard").rglob("*.py")),
            ROOT / "_torchshard_pytestplugin.py",
        ]
        if p != helper
        for line, text in _strings(p)
        if "pip install" in text
        and ("torchshard" in text or re.search(r"install(\s+-e)?\s+'?\.", text))
    ]
    assert elsewhere == []
    assert DISTRIBUTION == "torchshard-input"
    commands = install_commands(pip_install("stacks"))
    assert [installs(c) for c in commands] == [{"distribution"}, {"checkout"}], commands


def test_importing_torchshard_imports_no_stack():
    code = (
        "import sys, torchshard, torchshard.integrations;"
        "print(sorted(m for m in ('lightning', 'accelerate', 'torchtitan', 'grain', 'ray', "
        "'datasets', 'torchshard.integrations.lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _checked_files() -> list[pathlib.Path]:
    """The files mypy checks (``[tool.mypy] files``, less its ``exclude``)."""
    excluded = [re.compile(e) for e in PYPROJECT["tool"]["mypy"].get("exclude", [])]
    out: list[pathlib.Path] = []
    for entry in PYPROJECT["tool"]["mypy"]["files"]:
        path = ROOT / entry
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [p for p in out if not any(e.search(p.relative_to(ROOT).as_posix()) for e in excluded)]


def _third_party_imports(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports (dotted), other than the standard library's and this
    project's own (``torchshard``, the gate, the maintainers' ``benchmarks``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    own = set(sys.stdlib_module_names) | {"torchshard", "_torchshard_pytestplugin", "benchmarks"}
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
