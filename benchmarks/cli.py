"""The lab's command line: ``python -m benchmarks NAME [options]``, on ``python -m torchshard
bench``'s machinery (``torchshard._tools.cli``: ``bench_parser`` and ``run``).

The same options as ``bench`` (``--devices``, ``--quick``, ``--json``, ``--strict``,
``--plain``, ``--threads``) and ``--plot PATH``; the same one-line input errors (exit status
2, ``python -m benchmarks: error: ...``), emulation and verdicts. A name is required: ``all``
runs every bench of ``benchmarks.BENCHES`` (the wheel's and the lab's) one after another.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from torchshard._tools import cli

PROG = "python -m benchmarks"
DESCRIPTION = (
    "The maintainers' benchmarks, run from a checkout's root: the wheel's (python -m torchshard "
    "bench) and the lab's own; `all` runs every one, one after another (many minutes). "
    "dtensor_loader starts --devices gloo processes."
)


def build_parser() -> argparse.ArgumentParser:
    """The lab's parser: the bench command alone, its choices ``benchmarks.BENCHES``."""
    return cli.bench_parser(PROG, "benchmarks", DESCRIPTION)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the lab's command line; returns the exit status."""
    return cli.run(build_parser(), argv)
