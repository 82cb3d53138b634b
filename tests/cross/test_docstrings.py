"""Every ``>>>`` example in the library's docstrings runs, as one test item per docstring.

The examples are found in every module of the ``torchshard`` package (``torchshard.__main__``
aside, as importing it runs the command line) with ``doctest.DocTestFinder``: the docstrings of
the module and of the classes, functions, methods and properties it defines (a re-exported name
is collected once, in the module that defines it). Each docstring is one item, named as doctest
names it (``torchshard._core.mesh.Mesh``), run with ``ELLIPSIS | NORMALIZE_WHITESPACE``; a
failing example fails its item with doctest's report.

The namespace of an example is its module's globals plus a small standard set, the same for
every example:

- ``np``: numpy;
- ``torch``: torch;
- ``torchshard``: the package itself.

Anything else (a mesh, arrays, a dataset, ``from torchshard.testing import virtual_hosts``,
``from torch.utils.data import DataLoader``) is defined or imported by the example itself, so
that it can be pasted after ``import numpy as np, torch, torchshard``. Examples run in this
pytest process, on its 8 CPU-emulated devices (the torchshard plugin), so they enter meshes
with ``with mesh:`` and leave them, as every test must (conftest's autouse fixture); several
hosts are played with ``virtual_hosts``. Each item forgets the once-per-process deprecation
warnings before and after (an example may show a deprecated name, under
``warnings.catch_warnings()``, as ``filterwarnings = error`` applies to examples too).

An example that cannot run in one process (it needs several torch.distributed processes) is a
literal block introduced by ``::`` (``Example (on each of 4 processes)::``) and holds no ``>>>``
line; a runnable one is introduced by a single colon. Every ``Example`` section of the package
is one or the other (``test_example_sections_are_doctests_or_literal_blocks``), and the ``>>>``
lines of every public name (and of its methods and properties) are collected
(``test_public_examples_run``).
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import io
import pkgutil
import re
import types
from typing import Any

import numpy as np
import pytest
import torch

import torchshard
import torchshard.data
import torchshard.testing

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
STANDARD_NAMESPACE = {"np": np, "torch": torch, "torchshard": torchshard}
SKIPPED_MODULES = {"torchshard.__main__"}  # importing it runs the command line
PUBLIC_MODULES = [torchshard, torchshard.data, torchshard.testing]
# 41 docstrings had examples when this floor was set; a finder that silently collects nothing
# (or a fraction) fails test_doctests_are_collected. Raise it as examples are added.
MIN_DOCTESTS = 40


def _modules() -> list[types.ModuleType]:
    names = [torchshard.__name__] + [
        info.name
        for info in pkgutil.walk_packages(torchshard.__path__, prefix=torchshard.__name__ + ".")
    ]
    return [importlib.import_module(n) for n in sorted(names) if n not in SKIPPED_MODULES]


def _docstrings() -> list[doctest.DocTest]:
    """Every docstring of the package as a ``DocTest`` (most with no examples), by name."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for module in _modules():
        globs = {**vars(module), **STANDARD_NAMESPACE}
        tests += finder.find(module, module.__name__, globs=globs)
    return sorted(tests, key=lambda t: t.name)


DOCSTRINGS = _docstrings()
DOCTESTS = [t for t in DOCSTRINGS if t.examples]


@pytest.mark.xla
@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
@pytest.mark.usefixtures("fresh_deprecations")  # an example may call a deprecated name
def test_docstring_examples(test: doctest.DocTest):
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report = io.StringIO()
    try:
        result = runner.run(test, out=report.write, clear_globs=True)
    finally:
        test.globs.clear()
    if result.failed:
        pytest.fail(
            f"{result.failed} of {result.attempted} examples of {test.name} failed "
            f"({test.filename}:{test.lineno}):\n{report.getvalue()}",
            pytrace=False,
        )


def test_doctests_are_collected():
    names = [t.name for t in DOCTESTS]
    assert len(names) == len(set(names))
    assert len(DOCTESTS) >= MIN_DOCTESTS, names
    # Named after the defining module (not a re-exporting one): a class, a method.
    expected = {
        "torchshard._mesh.mesh.Mesh",
        "torchshard._step.input_dispatcher.InputDispatcher.logical_to_physical_batch",
    }
    assert expected <= set(names)


# A section heading such as "Example:", "Examples:" or "Example (on each of 4 processes)::".
_HEADING = re.compile(r"^(?P<indent>\s*)Examples?\b[^\n]*?(?P<colons>::?)\s*$")


def _example_sections(doc: str) -> list[tuple[str, bool, str]]:
    """``(heading, literal, body)`` for each ``Example`` section of ``doc``: ``literal`` when
    the heading ends with ``::``; the body is the lines under it, indented deeper (or blank)."""
    lines = doc.splitlines()
    sections = []
    for i, line in enumerate(lines):
        match = _HEADING.match(line)
        if match is None:
            continue
        depth = len(match["indent"])
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= depth:
                break
            body.append(following)
        sections.append((line.strip(), match["colons"] == "::", "\n".join(body)))
    return sections


_MEMBERS = (types.FunctionType, property, classmethod, staticmethod)


def _public_objects() -> dict[str, Any]:
    """Every public name of the public modules, and the public methods and properties of the
    public classes, by a name for the report."""
    objects = {}
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if not getattr(obj, "__module__", "").startswith("torchshard"):
                continue  # a constant (its docstring is its type's)
            objects[f"{module.__name__}.{name}"] = obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and isinstance(member, _MEMBERS) and member.__doc__:
                        objects[f"{module.__name__}.{name}.{attr}"] = member
    return objects


def _section_problems(where: str, doc: str) -> list[str]:
    problems = []
    for heading, literal, body in _example_sections(inspect.cleandoc(doc)):
        if literal and ">>>" in body:
            problems.append(f"{where}: {heading!r} is a literal block (::) but has >>>")
        if not literal and ">>>" not in body:
            problems.append(f"{where}: {heading!r} has no >>> example (or end it with ::)")
    return problems


def test_example_sections_are_doctests_or_literal_blocks():
    """In every docstring of the package, an ``Example:`` section holds ``>>>`` lines and an
    ``Example ...::`` section (not run) holds none."""
    assert len(DOCSTRINGS) > 2 * len(DOCTESTS)
    problems = [p for t in DOCSTRINGS for p in _section_problems(t.name, t.docstring or "")]
    assert not problems, "\n".join(problems)


def test_public_examples_run():
    """Every public name with an ``Example`` section has ``>>>`` examples that are collected,
    or (for an example that needs several processes) a literal block with no ``>>>``."""
    collected = {t.name: t for t in DOCTESTS}
    problems = []
    for where, obj in _public_objects().items():
        doc = obj.__doc__ or ""
        problems += _section_problems(where, doc)
        if ">>>" not in doc:
            continue
        target = obj.fget if isinstance(obj, property) else obj
        target = getattr(target, "__func__", target)  # classmethod, staticmethod
        name = f"{target.__module__}.{target.__qualname__}"
        if name not in collected or not collected[name].examples:
            problems.append(f"{where}: its >>> examples are not collected (as {name})")
    assert not problems, "\n".join(problems)
