"""A griffe extension for the API reference: the docstrings' examples as code.

torchshard's docstrings are Google style with doctest examples (``tests/cross/test_docstrings.py``
runs them). Their example headings carry a caption (``Example (2 hosts, 4 rows from each):``)
and the examples that need several processes are reStructuredText literal blocks (a paragraph
ending in ``::``). Griffe's Google parser knows neither: it would render ``>>>`` lines as
Markdown quotes and a literal block as a paragraph. Before parsing, this extension rewrites

- ``Example (caption):`` followed by ``>>>`` lines into an ``Examples:`` section whose first
  line is the caption (griffe renders the ``>>>`` lines, with their output, as Python code);
- a paragraph ending in ``::`` followed by an indented block into the paragraph (ending in
  ``:``) and a fenced Python block.

The docstrings themselves stay as they are (they are read by ``help()`` and doctest too).
Loaded by ``mkdocs.yml`` (``extensions: [docs/griffe_rst_examples.py]``); mkdocs does not
publish it (``exclude_docs``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(
    r"^(?P<indent>\s*)Examples?(?:\s*\((?P<caption>.*)\))?\s*:(?P<literal>:?)\s*$"
)
_LITERAL = re.compile(r"^(?P<indent>\s*)(?P<text>\S.*)::\s*$")


def _depth(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block(lines: list[str], start: int, depth: int) -> int:
    """The index after the block of lines indented deeper than ``depth`` (or blank)."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _depth(lines[end]) > depth):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def rewrite(doc: str) -> str:
    """The docstring with its captioned examples and literal blocks made Google/Markdown."""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = _HEADING.match(line)
        literal = _LITERAL.match(line) if heading is None else None
        if heading is not None and not heading["literal"]:
            indent = heading["indent"]
            out.append(f"{indent}Examples:")
            if heading["caption"]:
                out += [f"{indent}    {heading['caption']}:", ""]
            i += 1
            continue
        if heading is not None or literal is not None:
            match = heading if heading is not None else literal
            indent = match["indent"]
            depth = len(indent)
            end = _block(lines, i + 1, depth)
            start = i + 1
            while start < end and not lines[start].strip():
                start += 1
            body = lines[start:end]
            inner = min((_depth(s) for s in body if s.strip()), default=depth + 4)
            if heading is not None:
                caption = heading["caption"] or "not run here"
                out += [f"{indent}Examples:", f"{indent}    Example ({caption}):", ""]
                fence_indent = indent + "    "
            else:
                out += [f"{indent}{literal['text']}:", ""]
                fence_indent = indent
            out.append(f"{fence_indent}```python")
            out += [fence_indent + s[inner:] if s.strip() else "" for s in body]
            out.append(f"{fence_indent}```")
            i = end
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RstExamples(griffe.Extension):
    """Rewrites every docstring with ``rewrite`` as soon as griffe has read it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
