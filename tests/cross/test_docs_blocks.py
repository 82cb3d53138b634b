"""Every code block of the README and the guides runs, or says why not.

Each fenced block of ``DOCUMENTS`` has a marker comment on the line above it (``<!-- KIND:NAME
-->``, the kinds below; ``docs/migration.md`` has the table for readers):

- ``run:NAME``: a Python script, run in a fresh interpreter (8 CPU-emulated devices when it
  asks for them: ``ts.setup_cpu_emulation(8)``);
- ``continues:NAME``: runs after the earlier blocks of ``NAME`` of the same page, in the same
  script (a fragment that continues a named block);
- ``torchrun:NAME``: as ``run``, under ``torchrun --standalone --nproc-per-node 2`` (gloo);
- ``ci:NAME``: run by CI on a clean checkout (``.ci/run``: the set-up commands); the Python
  ones (the DTensor quick start) are also run here, under torchrun;
- ``shell:NAME``: a command, run in a temporary folder with ``python`` meaning this test's
  interpreter; ``output:NAME`` is what it prints, compared exactly;
- ``example:NAME``: run by another test, which must name the marker (the pytest plugin's
  example, ``tests/testing/test_spmd.py``);
- ``fragment:NAME``: not run (it needs a TPU, a pod or a package CI does not install); Python
  fragments must compile and shell ones must parse (``bash -n``).

A block without a marker, an unknown kind, a ``continues`` or ``output`` with nothing to
continue, or a ``ci``/``example`` marker that nothing runs fails ``test_every_block_is_marked``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = (
    "README.md",
    "docs/migration.md",
    "docs/tpu.md",
    "docs/torchax.md",
    "docs/training.md",
    "docs/testing.md",
    "docs/layout.md",
    "docs/data.md",
    "docs/stacks.md",
)
KINDS = {"run", "continues", "torchrun", "ci", "shell", "output", "example", "fragment"}
MARKER = re.compile(r"<!-- (?P<kind>[a-z]+):(?P<name>[A-Za-z0-9_-]+) -->")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
# The ci markers that .ci/run (and the CI steps the lead wires) run.
CI_MARKERS = {"demo", "test", "dtensor-quickstart"}
TIMEOUT = 600


@dataclasses.dataclass(frozen=True)
class Block:
    document: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: str | None
    name: str | None

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def blocks(document: str) -> list[Block]:
    """The fenced blocks of ``document`` with the marker on the nearest non-blank line above."""
    lines = (ROOT / document).read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        above = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
        marker = MARKER.fullmatch(above)
        out.append(
            Block(
                document,
                i + 1,
                fence["lang"],
                "\n".join(lines[i + 1 : end]) + "\n",
                marker["kind"] if marker else None,
                marker["name"] if marker else None,
            )
        )
        i = end + 1
    return out


ALL = [b for d in DOCUMENTS for b in blocks(d)]


def chains(kind: str) -> list[tuple[Block, list[Block]]]:
    """Each ``kind`` block (``run``/``torchrun``/``ci``) with the ``continues`` blocks of its
    name that follow it on its page."""
    out = []
    for head in ALL:
        if head.kind != kind or head.lang != "python":
            continue
        same_page = [b for b in ALL if b.document == head.document and b.line > head.line]
        tail = [b for b in same_page if b.kind == "continues" and b.name == head.name]
        out.append((head, tail))
    return out


def _problems(block: Block) -> list[str]:
    where = block.where
    if block.kind is None:
        return [f"{where}: a ```{block.lang} block with no <!-- KIND:NAME --> marker above it"]
    if block.kind not in KINDS:
        return [f"{where}: unknown marker kind {block.kind!r} (known: {sorted(KINDS)})"]
    earlier = [b for b in ALL if b.document == block.document and b.line < block.line]
    names = {(b.kind, b.name) for b in earlier}
    if block.kind == "continues" and not {("run", block.name), ("torchrun", block.name)} & names:
        return [f"{where}: continues {block.name!r}, which no earlier run/torchrun block names"]
    if block.kind == "output" and ("shell", block.name) not in names:
        return [f"{where}: output of {block.name!r}, but no earlier shell:{block.name} block"]
    if block.kind == "ci" and block.name not in CI_MARKERS:
        return [f"{where}: ci:{block.name} is not one of the blocks CI runs ({CI_MARKERS})"]
    if block.kind == "example":
        marker = f"<!-- example:{block.name} -->"
        if not any(marker in p.read_text() for p in ROOT.joinpath("tests").rglob("test_*.py")):
            return [f"{where}: no test names {marker}"]
    if block.kind == "fragment":
        return _fragment_problems(block)
    return []


def _fragment_problems(block: Block) -> list[str]:
    if block.lang == "python":
        try:
            compile(block.code, block.where, "exec")
        except SyntaxError as e:
            return [f"{block.where}: the Python fragment does not compile: {e}"]
    if block.lang == "bash":
        result = subprocess.run(
            ["bash", "-n"], input=block.code, capture_output=True, text=True, check=False
        )
        if result.returncode:
            return [f"{block.where}: the shell fragment does not parse: {result.stderr}"]
    return []


def test_every_block_is_marked():
    assert len(ALL) >= 15, [b.where for b in ALL]
    problems = [p for b in ALL for p in _problems(b)]
    assert not problems, "\n".join(problems)


def test_the_ci_blocks_are_where_ci_reads_them():
    readme = {(b.kind, b.name): b for b in blocks("README.md")}
    assert readme[("ci", "test")].lang == "bash" and "pytest" in readme[("ci", "test")].code
    assert readme[("ci", "demo")].lang == "bash"
    quickstart = readme[("ci", "dtensor-quickstart")]
    assert quickstart.lang == "python" and "init_process_group" in quickstart.code


def test_the_readme_is_a_front_page():
    """At most 150 lines; exactly the two set-up commands (the demo, the tests) as blocks."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    bash = [b for b in blocks("README.md") if b.lang == "bash"]
    assert [(b.kind, b.name) for b in bash] == [("ci", "demo"), ("ci", "test")]


def test_the_dtensor_training_example_is_the_documented_one():
    """The block is the example file whole, with nothing that continues it: running the file
    (test_examples) runs the block."""
    for (document, name), example in RUN_AS_EXAMPLES.items():
        (block,) = [b for b in blocks(document) if b.name == name]
        assert block.kind == "torchrun"
        assert block.code == (ROOT / example).read_text()
        assert [t for h, t in chains("torchrun") if h.name == name] == [[]]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    return env


def _script(tmp_path: pathlib.Path, head: Block, tail: list[Block]) -> pathlib.Path:
    """The chain as one script; a comment before each block names where it comes from."""
    parts = [f"# --- {b.where} ({b.kind}:{b.name})\n{b.code}" for b in [head, *tail]]
    path = tmp_path / f"{head.name}.py"
    path.write_text("\n".join(parts))
    return path


def _check(result: subprocess.CompletedProcess, script: pathlib.Path) -> None:
    assert result.returncode == 0, (
        f"{script.read_text()}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


RUN_CHAINS = chains("run")


@pytest.mark.xla  # the run: blocks use the XLA emulation (the DTensor ones are torchrun:)
@pytest.mark.parametrize(
    ("head", "tail"), RUN_CHAINS, ids=[f"{h.document}:{h.name}" for h, _ in RUN_CHAINS]
)
def test_run_blocks(tmp_path, head, tail):
    script = _script(tmp_path, head, tail)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env=_env(),
        check=False,
    )
    _check(result, script)


# A block that is an example file whole runs as that file in tests/cross/test_examples.py (with
# warnings as errors and its output checked): run once there, not twice.
RUN_AS_EXAMPLES = {("docs/training.md", "train-dtensor"): "examples/train_dtensor.py"}
TORCHRUN_CHAINS = [
    (head, tail)
    for head, tail in chains("torchrun") + chains("ci")
    if (head.document, head.name) not in RUN_AS_EXAMPLES
]


@pytest.mark.parametrize(
    ("head", "tail"), TORCHRUN_CHAINS, ids=[f"{h.document}:{h.name}" for h, _ in TORCHRUN_CHAINS]
)
def test_torchrun_blocks(tmp_path, head, tail):
    script = _script(tmp_path, head, tail)
    env = _env()
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS", "XLA_USE_SPMD"):
        env.pop(name, None)  # one process per device: no emulated XLA devices
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = subprocess.run(
        [*command, "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    _check(result, script)


SHELL = [b for b in ALL if b.kind == "shell"]


@pytest.mark.parametrize("block", SHELL, ids=[f"{b.document}:{b.name}" for b in SHELL])
def test_shell_blocks_print_their_output(tmp_path, block):
    command = re.sub(r"^python ", f"{sys.executable} ", block.code.strip())
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env=_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    outputs = [b for b in ALL if b.kind == "output" and b.name == block.name]
    for output in outputs:
        assert result.stdout == output.code, f"{output.where} differs from what the command printed"


def test_the_overview_names_every_public_name():
    """``docs/index.md``'s table (the site's home page) keeps up with the public surface."""
    import torchshard
    import torchshard.data
    import torchshard.errors
    import torchshard.testing

    text = (ROOT / "docs" / "index.md").read_text()
    missing = [
        f"{module.__name__}.{name}"
        for module in (torchshard, torchshard.data, torchshard.testing, torchshard.errors)
        for name in module.__all__
        if f"`{name}" not in text and f".{name}" not in text
    ]
    assert not missing, f"docs/index.md does not mention {missing}"
