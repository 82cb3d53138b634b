"""The stack examples (``examples/stacks/<name>.py``) run under torchrun on gloo, as a user runs
them, and print their summary: FSDP2 and DDP, TP and SP on (dp=2, tp=2), each fed by a
``GlobalBatchLoader`` and by a ``DistributedSampler`` with ``torch.equal`` losses, context
parallel sharding equal to torch's ``context_parallel``, and, where the stack is installed
(else they skip, naming it), torchtitan (``torch.equal`` losses against its stock
``ParallelAwareDataloader``, and a resume through torch.distributed.checkpoint; its main
branch's grain loader protocol against grain's own ``ElasticIterator``) and accelerate
(the examples of every step equal to accelerate's own feed, the losses within float
rounding). (Lightning's examples run in ``tests/integrations/test_lightning.py``, where
Lightning is installed.)

docs/stacks.md shows each script's essential part: the text between the script's lines
``# --- docs/stacks.md: NAME`` and ``# --- end``, dedented, is the block after the marker
``<!-- example:stacks-NAME -->`` there (``<!-- example:stacks-fsdp2-ddp -->``,
``<!-- example:stacks-tp-sp -->``, ``<!-- example:stacks-context-parallel -->``,
``<!-- example:stacks-context-parallel-packed -->``,
``<!-- example:stacks-torchtitan-dp -->``, ``<!-- example:stacks-torchtitan-grain -->``,
``<!-- example:stacks-accelerate-ddp -->``,
Lightning's ``<!-- example:stacks-lightning-ddp -->`` and
``<!-- example:stacks-lightning-resume -->``, and Ray's
``<!-- example:stacks-ray-data -->``), so the page shows code that CI runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from torchshard._core.version import pip_install

ROOT = pathlib.Path(__file__).resolve().parents[2]
STACKS = ROOT / "examples" / "stacks"
PAGE = "docs/stacks.md"


@dataclasses.dataclass(frozen=True)
class Example:
    script: str
    processes: int
    needs: tuple[tuple[str, str], ...]  # (module, attribute) the script imports from torch
    summary: str  # the line rank 0 prints
    stack: str | None = None  # the stack the script imports, not a dependency of torchshard

    @property
    def name(self) -> str:
        return self.script.removesuffix(".py").replace("_", "-")


# The packed rows' line: torch's own balancers are the oracle where torch has them (>= 2.13).
try:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (  # noqa: F401
        _PTRRLoadBalancer,
    )

    _HAS_BALANCERS = True
except ImportError:  # torch 2.9
    _HAS_BALANCERS = False
PACKED = (
    "context_parallel: packed rows of 64, per_document and ptrr: every rank's tokens, segment "
    "ids and positions equal "
    + (
        "torch's balancers' shard"
        if _HAS_BALANCERS
        else "the reference's shard (rows indexed by context_parallel_order)"
    )
    + ", and no query sees a key of another document"
)

EXAMPLES = [
    Example(
        "fsdp2_ddp.py",
        2,
        (("torch.distributed.fsdp", "fully_shard"),),
        "fsdp2_ddp: 2 processes, FSDP2 and DDP, 8 steps over 2 epochs each: losses equal to a "
        "DistributedSampler feed",
    ),
    Example(
        "tp_sp.py",
        4,
        (
            ("torch.distributed.fsdp", "fully_shard"),
            ("torch.distributed.tensor.parallel", "SequenceParallel"),
        ),
        "tp_sp: 4 processes on (dp=2, tp=2), TP and SP with FSDP2 over dp, 2 steps each: losses "
        "equal to a DistributedSampler feed",
    ),
    Example(
        "context_parallel.py",
        2,
        (("torch.distributed.tensor.experimental", "context_parallel"),),
        "context_parallel: 2 processes on (dp=1, cp=2), 16 tokens: every rank's tokens, labels "
        "and positions equal torch's context_parallel shard\n" + PACKED,
    ),
    Example(
        "context_parallel.py",
        4,
        (("torch.distributed.tensor.experimental", "context_parallel"),),
        "context_parallel: 4 processes on (dp=2, cp=2), 16 tokens: every rank's tokens, labels "
        "and positions equal torch's context_parallel shard\n" + PACKED,
    ),
    Example(
        "torchtitan_dp.py",
        2,
        (("torch.distributed.fsdp", "fully_shard"),),
        "torchtitan_dp: 2 processes, FSDP2, 4 steps: losses equal to torchtitan's "
        "ParallelAwareDataloader; resumed from dcp with the same batches",
        stack="torchtitan",
    ),
    Example(
        "torchtitan_grain.py",
        2,
        (("torch.distributed.fsdp", "fully_shard"),),
        "torchtitan_grain: 2 processes, FSDP2, 23 samples: every rank stopped after step 5 "
        "(grain alone: 6 and 5); resumed from dcp with grain's own batches",
        stack="grain",
    ),
    Example(
        "accelerate_ddp.py",
        2,
        (),
        "accelerate_ddp: 2 processes, DDP, 8 steps over 2 epochs: the examples of every step "
        "equal accelerate's feed, losses within float rounding",
        stack="accelerate",
    ),
]
IDS = [e.name if e.processes == 2 else f"{e.name}-{e.processes}" for e in EXAMPLES]
# (script, NAME) of every script docs/stacks.md shows a part of.
# (Lightning's and Ray's run in tests/integrations/test_lightning.py and test_ray.py, where the
# stack is installed; Ray's on the Ray cluster that module starts.)
SHOWN = list(dict.fromkeys((e.script, e.name) for e in EXAMPLES))
SHOWN += [
    ("lightning_ddp.py", "lightning-ddp"),
    ("lightning_resume.py", "lightning-resume"),
    ("ray_data.py", "ray-data"),
    ("context_parallel.py", "context-parallel-packed"),
]


def shown_block(name: str) -> str:
    """The body of the ```python block after ``<!-- example:NAME -->`` on the page (the
    marker convention of ``test_docs_blocks.py``, which checks that a test names it)."""
    lines = (ROOT / PAGE).read_text().splitlines()
    marker = f"<!-- example:{name} -->"
    at = [i for i, line in enumerate(lines) if line.strip() == marker]
    assert len(at) == 1, f"{PAGE}: expected one line {marker}, found {len(at)}"
    body = lines[at[0] + 1 :]
    while body and not body[0].strip():
        body = body[1:]
    assert body and body[0] == "```python", f"{PAGE}: no ```python block right after {marker}"
    end = body.index("```", 1)
    return "\n".join(body[1:end]) + "\n"


def marked_part(script: pathlib.Path, name: str) -> str:
    """The dedented text between ``# --- docs/stacks.md: NAME`` and ``# --- end``, without
    the blank lines at either end (the formatter puts two after a function)."""
    lines = script.read_text().splitlines()
    begin = f"# --- docs/stacks.md: {name}"
    starts = [i for i, line in enumerate(lines) if line.strip() == begin]
    assert len(starts) == 1, f"{script.name}: expected one line {begin!r}, found {len(starts)}"
    ends = [i for i, line in enumerate(lines) if line.strip() == "# --- end" and i > starts[0]]
    assert ends, f"{script.name}: no '# --- end' after {begin!r}"
    return textwrap.dedent("\n".join(lines[starts[0] + 1 : ends[0]])).strip("\n") + "\n"


@pytest.mark.parametrize(("script", "name"), SHOWN, ids=[name for _, name in SHOWN])
def test_the_page_shows_the_scripts_marked_part(script, name):
    assert shown_block(f"stacks-{name}") == marked_part(STACKS / script, name), (
        f"{PAGE}: the block after <!-- example:stacks-{name} --> differs from "
        f"examples/stacks/{script}'s marked part: copy the part between its markers into the "
        "block"
    )


def test_marked_part_reads_between_the_markers(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "def f():\n    # --- docs/stacks.md: s\n\n    a = 1\n\n    b = 2\n\n\n    # --- end\n"
    )
    assert marked_part(script, "s") == "a = 1\n\nb = 2\n"
    with pytest.raises(
        AssertionError, match=re.escape("expected one line '# --- docs/stacks.md: t'")
    ):
        marked_part(script, "t")


@pytest.mark.parametrize("example", EXAMPLES, ids=IDS)
def test_the_example_runs_under_torchrun(tmp_path, example):
    for module, attribute in example.needs:
        if not hasattr(importlib.import_module(module), attribute):
            pytest.skip(f"torch {torch.__version__} has no {module}.{attribute}")
    if example.stack is not None and importlib.util.find_spec(example.stack) is None:
        pytest.skip(f"needs {example.stack}: {pip_install('stacks')}")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PJRT_", "XLA_")) and k not in ("CPU_NUM_DEVICES", "PYTHONWARNINGS")
    }
    env["OMP_NUM_THREADS"] = "1"  # the processes share the cores
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(example.processes),
            str(STACKS / example.script),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Rank 0's line, once (torch 2.9's gloo prints its own "[Gloo] Rank ..." lines too).
    stem = example.script.removesuffix(".py")
    lines = [line for line in out.stdout.splitlines() if line.startswith(f"{stem}:")]
    assert lines == example.summary.splitlines(), out.stdout + out.stderr[-3000:]
