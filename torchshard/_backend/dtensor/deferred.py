"""A direct ``host_to_global_array``'s agreement check judged off the step's path.

The call begins the check's exchange and returns its DTensors at once; the check is judged at
whichever comes first (docs/design.md, "The exchanges at pod scale"):

- the first op that reads any of the result's tensors (torch's ``AsyncCollectiveTensor`` with
  a ``Work`` whose wait judges: ``_torch_private.wait_at_first_use``), so no step computes, and
  no collective meets, on tensors the processes disagree about;
- the next torchshard call on the same stream (``Session.defer``: the stream's calls meet in
  program order, and at most one exchange is outstanding on it);
- leaving the mesh's ``with`` block (its stream's check), and interpreter exit (every one).

A ``Judgement`` runs the check's end once, raises its error once (at the first of those
points, naming the call it belongs to), and then drops every tensor's registration, so that
nothing the check held outlives it. torch 2.9 cannot make a tensor's first use wait: there (and
with ``set_agreement_deferred(False)``) the check is judged in the call, as before.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchshard._backend.dtensor import collective
from torchshard._backend.dtensor._torch_private import first_use_wait, wait_at_first_use, waited
from torchshard._core.agreement import agreement_deferred, current_stream
from torchshard._core.tree import flatten

FIRST_USE = "at the first use of its result"


def deferring(processes: int) -> bool:
    """Whether a direct call's check among ``processes`` is judged after the call (the
    setting, and torch can make a tensor's first use wait)."""
    return agreement_deferred(processes) and first_use_wait()


class Judgement:
    """One call's deferred check: ``end`` (which raises what the check found), judged once."""

    __slots__ = ("_end", "_error", "_held", "_label", "_lock")

    def __init__(self, end: Callable[[], None], label: str) -> None:
        self._lock = threading.Lock()
        self._end: Callable[[], None] | None = end
        self._label = label
        self._error: BaseException | None = None
        # The DTensors whose first use judges, each with its own local tensor (put back once
        # judged: ``to_local()`` is then the plain tensor again).
        self._held: list[tuple[DTensor, torch.Tensor]] = []

    def hold(self, x: DTensor) -> None:
        self._held.append((x, wait_at_first_use(x, self)))

    def __call__(self, where: str = FIRST_USE) -> None:
        """Judges the check (once; later calls do nothing) and raises what it found."""
        with self._lock:
            end, self._end = self._end, None
            if end is not None:
                try:
                    end()
                except BaseException as e:  # noqa: BLE001 -- raised below, with its call
                    self._error = _later(e, self._label, where)
            error, self._error = self._error, None
            held, self._held = self._held, []
        for x, local in held:  # their waits call this again: nothing left to do
            waited(x, local)
        if error is not None:
            raise error


def _later(error: BaseException, label: str, where: str) -> BaseException:
    """``error`` (today's text: the call, the leaf or the ranks, the fix) with the call it
    belongs to and where it was raised."""
    note = (
        f" (Raised {where}: the agreement check of {label}, judged off the step's path; "
        "torchshard.set_agreement_deferred(False) judges it in the call.)"
    )
    try:
        later = type(error)(f"{error}{note}")
    except Exception:  # noqa: BLE001 -- an exception type that takes other arguments
        error.add_note(note.strip())
        return error
    later.__cause__ = error.__cause__
    return later.with_traceback(error.__traceback__)


def defer(end: Callable[[], None], out: Any, inputs: list[Any], what: str) -> Any:
    """Judges ``end`` later (``deferring()`` must be True, a session must exist): each DTensor
    of ``out`` that the call made (not one of ``inputs``, passed through) waits for it at its
    first use. Returns ``out``."""
    s = collective.existing()
    if s is None:  # nothing was exchanged (one process)
        end()
        return out
    stream = current_stream()
    judge = Judgement(end, f"{what} call #{s.calls(stream)} on stream {stream!r}")
    given = {id(x) for x in inputs}
    leaves, _ = flatten(out)
    for x in leaves:
        if isinstance(x, DTensor) and id(x) not in given:
            judge.hold(x)
    s.defer(stream, judge)
    return out


def settle(where: str, *, every: bool = False) -> None:
    """Judges the current stream's deferred check (every stream's, also after
    ``destroy_process_group``: ``every``) now."""
    s = collective.existing(destroyed=every)
    if s is not None and s.deferred:
        s.settle(None if every else current_stream(), where)


def _at_exit() -> None:
    settle("at interpreter exit", every=True)


atexit.register(_at_exit)
