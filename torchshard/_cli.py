"""The command line: ``python -m torchshard {demo,bench,layout}``.

The CPU emulation (8 devices, SPMD) is set up before anything imports torch_xla, unless a
TPU is present.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def _bench(args: argparse.Namespace) -> int:
    from torchshard._bench import BENCHES
    from torchshard._bench._report import Report

    names = list(BENCHES) if args.name == "all" else [args.name]
    report = Report(progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    for name in names:
        importlib.import_module(BENCHES[name]).run(report)
    print(report.render())
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from torchshard._demo import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from torchshard._bench import BENCHES

    parser = argparse.ArgumentParser(prog="python -m torchshard")
    parser.add_argument(
        "--devices", type=int, default=8, help="CPU-emulated device count (no TPU)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a small MLP data-parallel, fed by a DataLoader through torchshard"
    )
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument(
        "--hosts", type=int, default=1, choices=[1, 2, 4, 8], help="virtual hosts (default 1)"
    )
    demo.add_argument("--batch", type=int, default=256, help="global batch size (default 256)")
    demo.add_argument(
        "--workers", type=int, default=2, help="DataLoader worker processes in all (default 2)"
    )
    demo.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    bench = sub.add_parser("bench", help="run benchmarks, print figures and ratios")
    bench.add_argument("name", nargs="?", default="all", choices=[*BENCHES, "all"])
    bench.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from torchshard._env import setup_cpu_emulation

    setup_cpu_emulation(args.devices)
    return int(args.func(args))
