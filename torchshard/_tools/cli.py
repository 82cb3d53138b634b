"""The command line: ``python -m torchshard {demo,bench,layout}``.

Commands that run on devices (``bench``, ``demo``) get the CPU emulation (``--devices``, 8 by
default, SPMD on) before anything imports torch_xla, unless a TPU is present. ``layout`` is
pure index maths and never starts torch_xla.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import sys
from collections.abc import Sequence
from typing import Any


def _bench(args: argparse.Namespace) -> int:
    from torchshard._tools.bench import BENCHES
    from torchshard._tools.bench._display import Progress, print_tables
    from torchshard._tools.bench._machine import machine_info
    from torchshard._tools.bench._report import Report, configure

    names = list(BENCHES) if args.name == "all" else [args.name]
    if args.plot:
        from torchshard._tools.bench._plot import check_plot_available

        check_plot_available()  # fail before a long run, not after it
        if "sweep" not in names:
            names.append("sweep")
    configure(quick=args.quick)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = {
        "devices": args.devices,
        "quick": args.quick,
        "benches": names,
        "torch_threads": torch.get_num_threads(),
    }
    report = Report(meta={"machine": machine_info(), "settings": settings})
    with Progress(len(names), plain=args.plain) as progress:
        report.progress = progress.message
        for name in names:
            progress.start(name)
            importlib.import_module(BENCHES[name]).run(report)
            progress.advance()
    print_tables(report, plain=args.plain)
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from torchshard._tools.bench._plot import plot_sweep

        plot_sweep(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _ints(option: str) -> Any:
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ints such as 4,2, but got {text!r}"
            )
        return values

    parse.__name__ = option  # argparse names the option's type in its messages
    return parse


def _names(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated axis names such as data,model, but got {text!r}"
        )
    return names


class _BareNames(ast.NodeTransformer):
    """Bare axis names (``data``) become the strings they name (``'data'``)."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Constant(node.id), node)


def parse_spec(text: str) -> Any:
    """A partition spec from what one writes inside ``P(...)``: ``"('data','model'),None"``.

    Parsed with ``ast.literal_eval`` (literals only, never ``eval``); bare names are axis names
    (``data,None``), and ``P(...)`` around it and an empty string (replicated) are accepted.
    """
    from torchshard._core.spec import PartitionSpec

    inner = text.strip()
    m = re.fullmatch(r"(?:P|PartitionSpec)\((.*)\)", inner, flags=re.S)
    if m:
        inner = m.group(1).strip()
    if not inner:
        return PartitionSpec()
    try:
        tree = _BareNames().visit(ast.parse(f"({inner},)", mode="eval"))
        entries = ast.literal_eval(tree)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _spec_error(text, "it is not made of None, axis names and tuples of them") from None
    try:
        return PartitionSpec(*entries)
    except (ValueError, TypeError) as e:
        raise _spec_error(text, str(e).rstrip(".")) from None


def _spec_error(text: str, why: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(
        f"cannot read {text!r} as a partition spec ({why}); write the entries as inside "
        "P(...): None, 'axis' or ('axis1', 'axis2'), separated by commas, e.g. "
        "\"('data','model'),None\""
    )


def _layout(args: argparse.Namespace) -> int:
    import numpy as np

    import torchshard as ts

    mesh = ts.Mesh(np.arange(int(np.prod(args.mesh))).reshape(args.mesh), args.axes)
    layout = ts.describe_layout(mesh, args.spec, args.shape, num_hosts=args.hosts)
    ts.visualize_sharding(layout, use_rich=False if args.plain else None)
    if args.png:
        layout.save_png(args.png)
        print(f"wrote {args.png}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from torchshard._tools.demo import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from torchshard._tools.bench import BENCHES

    parser = argparse.ArgumentParser(prog="python -m torchshard")
    parser.add_argument("--devices", type=int, default=8, help="CPU-emulated device count (no TPU)")
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
    demo.add_argument(
        "--backend",
        choices=["auto", "xla", "dtensor"],
        default="auto",
        help="xla: --devices emulated XLA devices; dtensor: --devices gloo processes on "
        "DTensor (default auto: xla when torch_xla is installed, else dtensor)",
    )
    demo.set_defaults(func=_demo)
    bench = sub.add_parser("bench", help="run benchmarks, print figures and ratios")
    bench.add_argument("name", nargs="?", default="all", choices=[*BENCHES, "all"])
    bench.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    bench.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw a PNG of throughput against batch size (runs the sweep bench)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="tiny sizes and 3 rounds: checks the command runs"
    )
    bench.add_argument("--plain", action="store_true", help="plain text output, no rich")
    bench.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads (default: torch's); 1 avoids OpenMP stalls on a shared host",
    )
    bench.set_defaults(func=_bench)
    layout = sub.add_parser(
        "layout",
        help="print which host and device own which block (pure maths; no devices needed)",
        description="Example: python -m torchshard layout --mesh 4,2 --axes data,model "
        "--spec \"('data','model'),None\" --shape 16,8 --hosts 2",
    )
    layout.add_argument("--mesh", type=_ints("mesh"), required=True, help="mesh shape, e.g. 4,2")
    layout.add_argument("--axes", type=_names, required=True, help="axis names, e.g. data,model")
    layout.add_argument(
        "--spec",
        type=parse_spec,
        default="",
        help="the partition spec as written inside P(...), e.g. \"('data','model'),None\" "
        "(default: replicated)",
    )
    layout.add_argument("--shape", type=_ints("shape"), required=True, help="global shape")
    layout.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="hosts, each owning an equal, contiguous group of device ids (default 1)",
    )
    layout.add_argument("--png", metavar="PATH", help="also draw the layout into a PNG")
    layout.add_argument("--plain", action="store_true", help="plain text, no rich")
    layout.set_defaults(func=_layout, needs_runtime=False, input_errors=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":  # the dtensor demo runs gloo processes: no XLA emulation
        from torchshard._tools.demo import resolve_backend

        args.backend = resolve_backend(args.backend)
        args.needs_runtime = args.backend == "xla"
    from torchshard._core.errors import MissingDependencyError

    try:
        if getattr(args, "needs_runtime", True):
            from torchshard._backend.xla_env import setup_cpu_emulation

            setup_cpu_emulation(args.devices)
        return int(args.func(args))
    except MissingDependencyError as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        if not getattr(args, "input_errors", False):
            raise
        # The layout command's input is the user's: its errors are messages, not tracebacks.
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
