"""The command line: ``python -m torchshard {demo,bench,layout}``.

Commands that run on devices (``bench``, ``demo``) get the CPU emulation (``--devices``, 8 by
default, SPMD on) before anything imports torch_xla, unless a TPU is present, and build their
meshes from the run's device count (``bench._devices``, ``_demo_common.mesh_shape``).
``layout`` is pure index maths and never starts torch_xla.

``bench`` runs the benches of a registry module (``BENCHES``, ``NEEDS_NO_XLA``, ``PLOT``,
``GLOO_PER_DEVICE``): the wheel's ``torchshard._tools.bench``, or, through ``run`` with a parser
of its own, the maintainers' lab (``python -m benchmarks`` in a checkout, ``benchmarks/``),
which reuses this machinery: options, emulation, report, tables, JSON, verdicts.

Errors in what the user typed end the command with exit status 2 and one line on stderr
(``python -m torchshard layout: error: ...``), never a traceback: argparse's own errors (one
line, without the usage block), the option checks below (positive counts, writable output
paths, the size of a layout; ``demo``'s ``--hosts`` and ``--batch`` against ``--devices``, the
gloo processes' cap, all before any device starts) and the ``ValueError``/``TypeError``/
``OSError`` of the layout command, whose whole input is the user's. ``bench --strict`` exits
with 1 when a target is missed. The global options (``--devices``) are accepted before or
after the subcommand.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import math
import os
import re
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

# ``bench`` with no name runs this one (host -> global, the library's main call, against
# torch_xla's two ways of doing it): short, and the comparison most readers want first.
DEFAULT_BENCH = "h2g"
# ... and this one without torch_xla (a plain install): host -> global on DTensor.
DEFAULT_BENCH_DTENSOR = "dtensor"
# ... and this one with --backend torchax: host -> global against JAX's own call.
DEFAULT_BENCH_TORCHAX = "torchax"
# The registry of the benches ``python -m torchshard bench`` runs (the lab has its own).
WHEEL_BENCHES = "torchshard._tools.bench"
# ``layout`` describes at most this many devices: 65,536 take about 0.1 s (numpy; the text is
# the runs of blocks and hosts, ``--full`` a row per block: 65,536 rows); a 2048 x 2048 mesh
# (4 M devices) would take seconds and gigabytes.
MAX_LAYOUT_DEVICES = 65_536
# ``layout --png`` draws one patch and one label per device: a 256 x 256 mesh passed 3 GB of
# RSS in matplotlib; past this many devices the picture is unreadable anyway.
MAX_PNG_DEVICES = 1_024
# ``--threads`` at most this many torch threads per core: 100,000 ran away (load ~800 on 2
# cores) and 2**40 was a traceback from torch.
THREADS_PER_CORE = 4
MAX_THREADS = THREADS_PER_CORE * (os.cpu_count() or 1)
# ``demo --backend dtensor`` and the lab's ``dtensor_loader`` start one gloo process per device,
# each a Python with torch (about 300 MB, seconds to start): 512 of them would not fit a laptop.
MAX_GLOO_PROCESSES = 32
# ``demo --workers`` starts that many DataLoader worker processes, each a Python with torch: as
# ``--threads``, at most this many per core (100,000 would start 100,000 interpreters).
MAX_DEMO_WORKERS = THREADS_PER_CORE * (os.cpu_count() or 1)
# ``demo --seed`` seeds numpy's generator (no negative seed) and torch's (64 bits).
MAX_SEED = 2**63 - 1
# The XLA demo trains with autograd, and torch's autograd engine keeps its per-device queues
# under a c10::DeviceIndex (int8): on 128 or more devices backward() fails an INTERNAL ASSERT
# (measured: 127 trains, 128 and 512 do not). The benches use no autograd and run on 512.
MAX_XLA_DEMO_DEVICES = 127


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class UsageError(Exception):
    """A check of the command's input failed after parsing: one line, exit status 2."""


class OutputError(Exception):
    """Writing the command's output failed (a full disk, a closed stdout): one line, exit 1."""


@contextlib.contextmanager
def writing(what: str) -> Any:
    """Turns an ``OSError`` while writing ``what`` into an ``OutputError`` naming it."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"could not write {what}: {e.strerror or e}") from None


@contextlib.contextmanager
def printing() -> Any:
    """The command's output on standard output, flushed at the end: an ``OSError`` writing it
    (its reader closed the pipe, ``| head``; a full device) is an ``OutputError``, and standard
    output then goes to ``/dev/null``, so that the interpreter's last flush is quiet."""
    try:
        yield
        sys.stdout.flush()
    except OSError as e:
        why = e.strerror or str(e)
        if isinstance(e, BrokenPipeError):
            why += " (its reader closed it before the end, as `| head` does)"
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no fd: nothing to flush
            fd = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        raise OutputError(f"could not write standard output: {why}") from None


# -- argument types -------------------------------------------------------------------------


def _count(option: str, minimum: int = 1, maximum: int | None = None, why: str = "") -> Any:
    """An int option that must be at least ``minimum`` (and at most ``maximum``: ``why``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            what = {0: "a non-negative int", 1: "a positive int"}.get(
                minimum, f"an int >= {minimum}"
            )
            raise argparse.ArgumentTypeError(f"expected {what}, but got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(
                f"expected at most {maximum:,} ({why}), but got {text!r}"
            )
        return value

    parse.__name__ = option  # argparse names the option's type in its messages
    return parse


def _finite(option: str, minimum: float) -> Any:
    """A float option that must be finite and at least ``minimum`` (``nan``, ``inf`` and
    ``-1`` are floats to Python, and no learning rate)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(
                f"expected a finite number >= {minimum:g}, but got {text!r}"
            )
        return value

    parse.__name__ = option
    return parse


def _ints(option: str, minimum: int = 1) -> Any:
    """Comma-separated ints, each at least ``minimum`` (a mesh's or an array's shape)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ints such as 4,2, but got {text!r}"
            )
        bad = [v for v in values if v < minimum]
        if bad:
            what = {0: "non-negative", 1: "positive"}.get(minimum, f">= {minimum}")
            raise argparse.ArgumentTypeError(
                f"every entry must be {what}, but {text!r} has {bad[0]}"
            )
        return values

    parse.__name__ = option
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


# A negative value: ``-16,8``, ``-1e-3``, ``-inf`` (argparse takes these for option names).
_NEGATIVE = re.compile(r"-(?:\d[\d,.]*(?:[eE][-+]?\d+)?|inf|infinity|nan)", re.IGNORECASE)


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--shape -16,8`` -> ``--shape=-16,8`` (``--lr -1e-3``, ``--lr -inf``): argparse takes
    ``-16,8`` for an option name and reports a missing value; joined, the value reaches the
    option's check, which names it.
    """
    takes_value: set[str] = set()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.nargs != 0:
                takes_value.update(action.option_strings)
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in takes_value and _NEGATIVE.fullmatch(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def check_output_path(path: str, *, overwrite: bool = True) -> None:
    """Raises ``UsageError`` unless a file can be written at ``path`` (before a long run, not
    after it): its folder exists, it is not a folder, it may be created or replaced; with
    ``overwrite=False`` an existing file is refused too. Leaves no file behind."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder; give a file name, e.g. {os.path.join(path, 'x')}")
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {path}: the folder {folder} does not exist")
    existed = os.path.exists(path)
    if existed and not overwrite:
        raise UsageError(f"{path} exists; pass --overwrite to replace it, or give another path")
    regular = not existed or stat.S_ISREG(os.stat(path).st_mode)  # not /dev/null, a pipe
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            # Writes nothing to a file, a pipe or a terminal; a device that refuses every write
            # refuses this one too (/dev/full: ENOSPC), before the run rather than after it.
            os.write(fd, b"")
            disk = os.fstatvfs(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if not existed:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    if not existed:
        os.remove(path)
    if regular and disk.f_blocks and not disk.f_bavail:
        raise UsageError(
            f"cannot write {path}: the file system holding {folder} is full (0 bytes available)"
        )


# -- the commands ---------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    benches = importlib.import_module(args.registry)
    if args.strict and args.quick:
        raise UsageError(
            "--strict judges the targets, and --quick measures nothing worth judging (tiny "
            "sizes, 3 rounds); drop one of them"
        )
    plot_path = args.plot
    if plot_path and benches.PLOT is None:
        raise UsageError(
            "--plot draws the sweep, which is one of the maintainers' benchmarks, not in the "
            "package: in a checkout of the repository, run `python -m benchmarks sweep --plot "
            f"{plot_path}` from its root"
        )
    for path in (args.json, plot_path):
        if path:
            check_output_path(path)
    if args.name is None and getattr(args, "backend", "auto") == "auto":
        print(_default_bench_notice(benches.BENCHES), file=sys.stderr)
    backend = getattr(args, "backend", "auto")
    names = bench_names(args.name, args.registry, backend)
    jax_benches: frozenset[str] = getattr(benches, "NEEDS_TORCHAX", frozenset())
    if args.name == "all" and backend != "torchax" and jax_benches:
        print(
            f"bench all: the torchax benches ({', '.join(sorted(jax_benches))}) run with "
            "--backend torchax",
            file=sys.stderr,
        )
    if (
        args.name == "all"
        and backend != "torchax"
        and len(names) < len(benches.BENCHES) - len(jax_benches)
    ):
        skipped = ", ".join(n for n in benches.BENCHES if n not in names and n not in jax_benches)
        print(
            f"bench all: torch_xla is not installed, so only the benches that need none run "
            f"({', '.join(names)}); skipped: {skipped}",
            file=sys.stderr,
        )
    plot: Any = None
    if plot_path:
        plot = importlib.import_module(benches.PLOT)
        plot.check_plot_available()  # fail before a long run, not after it
        if plot.BENCH not in names:  # the bench whose figures it draws
            names.append(plot.BENCH)

    from torchshard._tools.bench._display import Progress, print_tables
    from torchshard._tools.bench._machine import machine_info
    from torchshard._tools.bench._report import Report, configure

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
    report = Report(meta={"machine": machine_info(), "settings": settings, "seconds": {}})
    if args.quick:
        report.notes.append(
            "--quick: tiny sizes and 3 rounds check that the commands run; no target is judged"
        )
    with Progress(len(names), plain=args.plain) as progress:
        report.progress = progress.message
        for bench_name in names:
            progress.start(bench_name)
            t0 = time.perf_counter()
            importlib.import_module(benches.BENCHES[bench_name]).run(report)
            report.meta["seconds"][bench_name] = round(time.perf_counter() - t0, 1)
            progress.advance()
    # The files first: a reader that closed standard output loses the tables, not the JSON.
    if args.json:
        with writing(args.json):
            report.write_json(args.json)
    if plot is not None:
        with writing(plot_path):
            plot.plot_sweep(report, plot_path)
    with printing():
        print_tables(report, plain=args.plain)
        for path in (args.json, plot_path if plot is not None else None):
            if path:
                print(f"wrote {path}")
    return verdict(report, strict=args.strict)


def default_bench(backend: str = "auto") -> str:
    """The bench that ``bench`` runs without a name: ``h2g``, or ``dtensor`` without torch_xla
    (``backend`` ``"auto"``); the named backend's (``torchax`` for ``"torchax"``)."""
    if backend == "torchax":
        return DEFAULT_BENCH_TORCHAX
    if backend == "dtensor":
        return DEFAULT_BENCH_DTENSOR
    if backend == "xla":
        return DEFAULT_BENCH
    from torchshard._backend.xla.env import xla_installed

    return DEFAULT_BENCH if xla_installed() else DEFAULT_BENCH_DTENSOR


def bench_names(
    name: str | None, registry: str = WHEEL_BENCHES, backend: str = "auto"
) -> list[str]:
    """The benches ``bench NAME`` runs from ``registry``: ``all`` is every one (without
    torch_xla, every one that needs none; the torchax benches only with ``backend``
    ``"torchax"``, which runs those alone); no name is ``default_bench(backend)``. A name the
    backend does not run is a ``UsageError``."""
    from torchshard._backend.xla.env import xla_installed

    benches = importlib.import_module(registry)
    jax_benches: frozenset[str] = getattr(benches, "NEEDS_TORCHAX", frozenset())
    if name == "all":
        if backend == "torchax":
            return [n for n in benches.BENCHES if n in jax_benches]
        return [
            n
            for n in benches.BENCHES
            if n not in jax_benches and (xla_installed() or n in benches.NEEDS_NO_XLA)
        ]
    if name is None:
        return [default_bench(backend)]
    if backend == "torchax" and name not in jax_benches:
        runs = ", ".join(sorted(jax_benches)) or "none"
        raise UsageError(
            f"bench {name} runs on {'DTensor' if name in benches.NEEDS_NO_XLA else 'torch_xla'}"
            f", not on torchax; --backend torchax runs {runs} (or leave out --backend)"
        )
    return [name]


def _default_bench_notice(benches: dict[str, str]) -> str:
    default = default_bench()
    others = ", ".join(n for n in benches if n != default)
    what = (
        "host -> global against torch_xla's two ways"
        if default == DEFAULT_BENCH
        else "host -> global on DTensor gloo processes, and the agreement check's cost"
    )
    return (
        f"bench: no name given, so running the short default, {default} ({what}). "
        f"Others: {others}. `bench all` runs all "
        f"{len(benches)} one after another (9 rounds of a 60-step training loop and 2 gloo "
        "processes among them): a few minutes on an idle machine, many minutes on a small shared "
        "one, each bench's seconds recorded in the --json file; `--quick` checks that they run, "
        "in seconds each. The maintainers' benchmarks are in a checkout: python -m benchmarks."
    )


def verdict(report: Any, *, strict: bool) -> int:
    """The bench command's exit status: 1 under ``strict`` when a target is missed (each
    missed one named on stderr), else 0. Quick runs judge nothing (``Report.verdicts``)."""
    if not report.verdicts:
        return 0
    missed = [r for r in report.ratios if r.ok is False]
    if not strict or not missed:
        return 0
    for r in missed:
        print(
            f"bench: target missed: {r.bench} {r.case}: {r.numerator} / {r.denominator} = "
            f"{r.value:.3f}x, target >= {r.target:g}",
            file=sys.stderr,
        )
    return 1


def _layout(args: argparse.Namespace) -> int:
    devices = math.prod(args.mesh)
    if devices > MAX_LAYOUT_DEVICES:
        shape = " x ".join(str(n) for n in args.mesh)
        raise UsageError(
            f"a {shape} mesh has {devices:,} devices; layout describes at most "
            f"{MAX_LAYOUT_DEVICES:,} (--full prints a row for each), so describe a smaller mesh "
            "with the same axes"
        )
    if args.png:
        from torchshard._core.optional import require_matplotlib

        require_matplotlib("layout --png")
        check_output_path(args.png, overwrite=args.overwrite)
        if not args.png.lower().endswith(".png"):
            raise UsageError(
                f"--png {args.png}: expected a file name ending in .png (the picture is a PNG), "
                f"e.g. {os.path.splitext(args.png)[0]}.png"
            )
        if devices > MAX_PNG_DEVICES:
            shape = " x ".join(str(n) for n in args.mesh)
            raise UsageError(
                f"--png: a {shape} mesh has {devices:,} devices; the picture draws at most "
                f"{MAX_PNG_DEVICES:,} (one box each), so leave out --png for the text layout or "
                "draw a smaller mesh with the same axes"
            )
    import numpy as np

    import torchshard as ts

    mesh = ts.Mesh(np.arange(devices).reshape(args.mesh), args.axes)
    layout = ts.describe_layout(mesh, args.spec, args.shape, num_hosts=args.hosts)
    with printing():
        ts.visualize_sharding(layout, use_rich=False if args.plain else None, full=args.full)
    if args.png:
        with writing(args.png):
            layout.save_png(args.png)
        with printing():
            print(f"wrote {args.png}")
    return 0


def check_demo_devices(args: argparse.Namespace) -> None:
    """Raises ``UsageError`` (before any device starts) when ``demo``'s ``--devices``,
    ``--hosts``, ``--batch`` and ``--workers`` cannot run together: hosts that do not divide
    the devices (``--hosts 8 --devices 4``), a batch that does not split evenly or whose data
    would not fit (``_demo_common.MAX_DATA_BYTES``), more gloo processes than
    ``MAX_GLOO_PROCESSES`` or more XLA devices than ``MAX_XLA_DEMO_DEVICES``."""
    from torchshard._tools.demo import check_sizes, default_batch

    if args.backend == "dtensor" and args.devices > MAX_GLOO_PROCESSES:
        raise UsageError(
            f"--devices {args.devices}: the dtensor demo starts one gloo process per device and "
            f"runs at most {MAX_GLOO_PROCESSES} (each a Python with torch); pass --devices "
            f"{MAX_GLOO_PROCESSES} or fewer, or --backend xla to emulate more devices"
        )
    if args.backend == "xla" and args.devices > MAX_XLA_DEMO_DEVICES:
        raise UsageError(
            f"--devices {args.devices}: the demo trains with torch's autograd, which handles at "
            f"most {MAX_XLA_DEMO_DEVICES} devices of a kind (its device index is 8 bits); pass "
            f"--devices {MAX_XLA_DEMO_DEVICES} or fewer (bench runs on more)"
        )
    batch = default_batch(args.devices) if args.batch is None else args.batch
    why = check_sizes(args.devices, args.hosts, batch, backend=args.backend, workers=args.workers)
    if why:
        raise UsageError(why)


def check_bench_devices(args: argparse.Namespace) -> None:
    """Raises ``UsageError`` when ``bench``'s ``--devices`` asks a bench of the registry's
    ``GLOO_PER_DEVICE`` (the lab's ``dtensor_loader``: one gloo process per device, unless
    ``--quick``) for more than ``MAX_GLOO_PROCESSES``."""
    per_device = importlib.import_module(args.registry).GLOO_PER_DEVICE
    backend = getattr(args, "backend", "auto")
    names = [n for n in bench_names(args.name, args.registry, backend) if n in per_device]
    if args.quick or not names or args.devices <= MAX_GLOO_PROCESSES:
        return
    raise UsageError(
        f"--devices {args.devices}: bench {names[0]} starts one gloo process per device "
        f"and runs at most {MAX_GLOO_PROCESSES} (each a Python with torch); pass --devices "
        f"{MAX_GLOO_PROCESSES} or fewer (or --quick, which runs 2)"
    )


def _demo(args: argparse.Namespace) -> int:
    from torchshard._tools.demo import main

    return main(args)


# -- the parser -----------------------------------------------------------------------------


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command takes, before or after its name: on the main parser with
    their defaults, on each subcommand with ``SUPPRESS`` (``suppress=True``), so that when
    absent there they do not overwrite what was given before the name."""
    parser.add_argument(
        "--devices",
        type=_count("devices"),
        default=argparse.SUPPRESS if suppress else 8,
        help="CPU-emulated device count when no TPU is present (default 8): the demo's and "
        "the torch_xla benches' meshes are built from it; on dtensor, the demo's gloo "
        f"processes (at most {MAX_GLOO_PROCESSES})",
    )


def add_bench_arguments(
    parser: argparse.ArgumentParser, registry: str, *, name_required: bool
) -> None:
    """The bench command's arguments on ``parser``: the name (the choices are ``registry``'s
    ``BENCHES`` and ``all``; optional, for the short default, unless ``name_required``) and the
    options (``--plot`` shown only where the registry has a ``PLOT`` module; elsewhere it
    says where to find it)."""
    benches = importlib.import_module(registry)
    choices = [*benches.BENCHES, "all"]
    if name_required:
        parser.add_argument("name", choices=choices)
    else:
        parser.add_argument("name", nargs="?", default=None, choices=choices)
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        # Without a PLOT module (the wheel) the option only says where it went (_bench).
        help="also draw a PNG of throughput against batch size (runs the sweep bench)"
        if benches.PLOT is not None
        else argparse.SUPPRESS,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and 3 rounds: checks the command runs (judges no target)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a target is missed"
    )
    parser.add_argument("--plain", action="store_true", help="plain text output, no rich")
    parser.add_argument(
        "--threads",
        type=_count("threads", maximum=MAX_THREADS, why=f"{THREADS_PER_CORE} per core"),
        metavar="N",
        help="torch intra-op threads (default: torch's); 1 avoids OpenMP stalls on a shared host",
    )
    parser.set_defaults(func=_bench, registry=registry)


def bench_parser(prog: str, registry: str, description: str) -> argparse.ArgumentParser:
    """A parser of the bench command alone (``prog NAME [options]``, the name required), for a
    registry of its own: the lab's ``python -m benchmarks``; run it with ``run``."""
    parser = _Parser(prog=prog, description=description)
    _global_options(parser, suppress=False)
    add_bench_arguments(parser, registry, name_required=True)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from torchshard._core.version import __version__

    parser = _Parser(prog="python -m torchshard")
    parser.add_argument("--version", action="version", version=f"torchshard {__version__}")
    _global_options(parser, suppress=False)
    common = _Parser(add_help=False)
    _global_options(common, suppress=True)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="train a small MLP data-parallel, fed by a DataLoader through torchshard",
    )
    demo.add_argument(
        "--steps", type=_count("steps", 2), default=300, help="training steps (default 300)"
    )
    demo.add_argument(
        "--hosts",
        type=_count("hosts"),
        default=1,
        help="virtual hosts, each owning an equal share of the devices: a divisor of --devices "
        "(default 1)",
    )
    demo.add_argument(
        "--batch",
        type=_count("batch"),
        default=None,
        help="global batch size, a multiple of --devices (default 256, rounded up to one)",
    )
    demo.add_argument(
        "--workers",
        type=_count(
            "workers", 0, maximum=MAX_DEMO_WORKERS, why=f"{THREADS_PER_CORE} processes per core"
        ),
        default=2,
        help="DataLoader worker processes in all (default 2)",
    )
    demo.add_argument(
        "--lr", type=_finite("lr", 0.0), default=3e-3, help="Adam learning rate (default 3e-3)"
    )
    demo.add_argument(
        "--seed",
        type=_count("seed", 0, maximum=MAX_SEED, why="numpy's and torch's seeds are 64-bit"),
        default=0,
        help="the data's and the model's seed (default 0)",
    )
    demo.add_argument(
        "--backend",
        choices=["auto", "xla", "dtensor", "torchax"],
        default="auto",
        help="xla: --devices emulated XLA devices; dtensor: --devices gloo processes on "
        "DTensor; torchax: PyTorch on JAX, --devices JAX CPU devices in one process (the "
        "extra torchax) (default auto: xla when torch_xla is installed, else dtensor)",
    )
    demo.set_defaults(func=_demo)
    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="run benchmarks, print figures and ratios",
        description=f"Without a name, runs the short default ({DEFAULT_BENCH}; without "
        f"torch_xla, {DEFAULT_BENCH_DTENSOR}); `all` runs every bench one after another "
        "(minutes).",
    )
    add_bench_arguments(bench, WHEEL_BENCHES, name_required=False)
    bench.add_argument(
        "--backend",
        choices=["auto", "xla", "dtensor", "torchax"],
        default="auto",
        help="the backend whose benches run: without a name, its default (xla: "
        f"{DEFAULT_BENCH}; dtensor: {DEFAULT_BENCH_DTENSOR}; torchax: {DEFAULT_BENCH_TORCHAX}, "
        "host -> global against JAX's own make_array_from_process_local_data on --devices JAX "
        "CPU devices); with `all`, its benches (default auto: xla when torch_xla is "
        "installed, else dtensor; torchax only when asked)",
    )
    layout = sub.add_parser(
        "layout",
        parents=[common],
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
    layout.add_argument(
        "--shape", type=_ints("shape", 0), required=True, help="global shape, e.g. 16,8"
    )
    layout.add_argument(
        "--hosts",
        type=_count("hosts"),
        default=1,
        help="hosts, each owning an equal, contiguous group of device ids (default 1)",
    )
    layout.add_argument("--png", metavar="PATH", help="also draw the layout into a new PNG file")
    layout.add_argument(
        "--overwrite", action="store_true", help="let --png replace an existing file"
    )
    layout.add_argument("--plain", action="store_true", help="plain text, no rich")
    layout.add_argument(
        "--full",
        action="store_true",
        help="every block and host, however many (by default more than 64 print as the runs "
        "they form: the first and last of each, and the step between them)",
    )
    layout.set_defaults(func=_layout, needs_runtime=False, input_errors=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``) with ``parser`` (``build_parser()``, or a
    ``bench_parser``) and runs the command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_join_negative_values(parser, argv))
    command = getattr(args, "command", None)
    prefix = f"{parser.prog} {command}: error:" if command else f"{parser.prog}: error:"
    from torchshard._core.errors import MissingDependencyError

    if sys.stdout is None or sys.stdout.closed:  # started with fd 1 closed (`>&-`)
        print(
            f"{prefix} standard output is closed, so there is nowhere to print to; redirect it "
            "to a file or to /dev/null instead of closing it.",
            file=sys.stderr,
        )
        return 1

    try:
        jax_devices = False  # whether --devices are JAX's (the torchax backend)
        if command == "demo":  # the dtensor demo runs gloo processes: no XLA emulation
            from torchshard._tools.demo import resolve_backend

            args.backend = resolve_backend(args.backend)
            args.needs_runtime = args.backend == "xla"
            jax_devices = args.backend == "torchax"
            check_demo_devices(args)
        if args.func is _bench:  # the DTensor benchmarks run gloo processes only
            registry = importlib.import_module(args.registry)
            names = bench_names(args.name, args.registry, getattr(args, "backend", "auto"))
            args.needs_runtime = any(n not in registry.NEEDS_NO_XLA for n in names)
            jax_devices = any(n in getattr(registry, "NEEDS_TORCHAX", ()) for n in names)
            check_bench_devices(args)
        if jax_devices:  # before JAX starts: --devices CPU devices (a TPU keeps its chips)
            from torchshard._backend.torchax.runtime import setup_cpu_devices

            setup_cpu_devices(args.devices)
        if getattr(args, "needs_runtime", True):
            from torchshard._backend.xla.env import setup_cpu_emulation

            setup_cpu_emulation(args.devices)
        return int(args.func(args))
    except (UsageError, MissingDependencyError) as e:
        print(f"{prefix} {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        print(f"{prefix} {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as e:
        if not getattr(args, "input_errors", False):
            raise
        # The layout command's input is the user's: its errors are messages, not tracebacks.
        print(f"{prefix} {e}", file=sys.stderr)
        return 2
