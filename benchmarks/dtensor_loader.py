"""The DTensor demo's training with the agreement check on and off: input wait and steps/s.

``python -m torchshard demo --backend dtensor`` (``_tools/demo_dtensor.py``: an MLP trained
data-parallel with ``DistributedDataParallel`` over ``--devices`` gloo processes, each fed by
its own ``DataLoader`` with worker processes through a ``GlobalBatchLoader``), run back to back
with every process's ``set_agreement_check(True)`` and ``(False)``, in the order on, off, off,
on (``ROUNDS`` times that pair of pairs; ``--quick``: once, two processes, few steps), so that a
drift of the shared machine falls on both alike.

Figures: the loader's ``input_wait_fraction`` (the share of step time spent waiting for input
after each epoch's warm-up, the largest over the processes; median over the runs) and steps/s
after the demo's warm-up (median). The check's cost to the step is the difference of the input
waits; the target: within 1 percentage point, judged as the ratio of the non-waiting shares,
``(1 - wait on) / (1 - wait off) >= 0.99``. The loader exchanges each batch's outcome on its
background thread, pipelined (a batch's exchange ends after the next batch is made), so the
check's round trips and the other processes' pace stay off the step's path.
"""

from __future__ import annotations

import statistics

from torchshard._tools.bench._report import Report

NAME = "dtensor_loader"
DESCRIPTION = "the DTensor demo's training: agreement check on vs off (input wait, steps/s)"
ROUNDS = 1  # each round: on, off, off, on
STEPS = 200
TARGET = 0.99  # (1 - wait on) / (1 - wait off): the check costs at most ~1 point of step time


def run(report: Report) -> None:
    """Runs the demo's training with the check on and off and records the figures."""
    from torchshard._tools import demo_dtensor

    quick = report.quick
    processes = 2 if quick else int(report.meta.get("settings", {}).get("devices", 8))
    steps = 20 if quick else STEPS
    waits: dict[str, list[float]] = {"check on": [], "check off": []}
    rates: dict[str, list[float]] = {"check on": [], "check off": []}
    order = [True, False] if quick else [True, False, False, True] * ROUNDS
    for k, checked in enumerate(order):
        method = "check on" if checked else "check off"
        report.progress(f"{NAME}: {method} ({k + 1}/{len(order)}, {processes} gloo processes)")
        r = demo_dtensor.train(
            processes=processes,
            steps=steps,
            batch_size=32 * processes,
            workers=2,
            agreement_check=checked,
            quiet=True,
        )
        waits[method].append(r.input_wait_fraction)
        rates[method].append(r.steps_per_second)
    case = f"{processes} processes, {steps} steps"
    wait = {m: statistics.median(v) for m, v in waits.items()}
    for method in waits:
        report.figure(NAME, case, method, 100 * wait[method], "% input wait")
        report.figure(NAME, case, method, statistics.median(rates[method]), "steps/s")
    report.figure(
        NAME,
        case,
        "check on - off",
        100 * (wait["check on"] - wait["check off"]),
        "points of input wait",
    )
    report.ratio(
        NAME,
        case,
        "check on (1 - input wait)",
        "check off (1 - input wait)",
        (1 - wait["check on"]) / (1 - wait["check off"]),
        target=TARGET,
    )
    report.ratio(
        NAME,
        case,
        "check on steps/s",
        "check off steps/s",
        statistics.median(rates["check on"]) / statistics.median(rates["check off"]),
    )
    report.notes.append(
        f"{NAME}: the DTensor demo's training (DDP, GlobalBatchLoader, 2 DataLoader workers per "
        f"process) with the agreement check on and off, in the order {order}; input wait = "
        "the largest LoaderStats.input_wait_fraction over the processes"
    )
