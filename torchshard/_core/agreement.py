"""Cross-process agreement: every process must pass the same tree structure, shapes and dtypes.

With one process per device (the DTensor backend), each process infers the global shape of a
leaf from its own block. Processes that pass different shapes would build different global
tensors, and the first collective would then hang or mix data. So before anything is planned,
each process describes its call (the tree structure and partition, then each leaf's shape and
dtype), hashes the description to 8 bytes, and the processes exchange the digests (the
backend's bounded exchange: DTensor's exchange tree, overlapped with placement).
Only when the digests differ are the descriptions themselves exchanged, to name the first
leaf that differs; every process then raises the same ``ProcessDisagreementError``.

The check is on by default. ``set_agreement_check(False)`` turns it off for the process, and so
does the environment variable ``TORCHSHARD_AGREEMENT_CHECK=0``, read once when this module is
first imported (``0``, ``false``, ``no``, ``off``, ``disabled`` turn a check off; ``1``, ``true``,
``yes``, ``on``, ``enabled`` on; anything else is a ``ValueError``). The DTensor backend adds
the mesh to the description (``with_mesh``). Standard library only; the collective itself
belongs to the backend.

A ``GlobalBatchLoader`` assembles batches on a background thread, whose progress differs from
process to process (one process may be making batch 7 while another has stopped after 6), so
no collective may run there. Its consumer runs the check instead, once per ``next()``, on a
description of the *outcome* of that batch: a batch (``describe``), the end of the source
(``END_OF_DATA``) or a failure (``failure``). Processes whose outcomes differ all raise at the same
batch: the failing process its own error, the others ``outcome_disagreement``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torchshard._core.errors import ProcessDisagreementError, at
from torchshard._core.ranks import RankSet
from torchshard._core.verdict import Group

ENV_VAR = "TORCHSHARD_AGREEMENT_CHECK"
VALUES_ENV_VAR = "TORCHSHARD_VALUE_CHECK"
DEFERRED_ENV_VAR = "TORCHSHARD_AGREEMENT_DEFERRED"
# From this many processes a direct call's check is deferred by default: there the exchange
# (the model's 0.5 ms at 64 processes, 1.47 ms at 8,192) outweighs deferral's own cost (44 us
# of CPU a leaf); below it the exchange is ~0.2 ms, and deferral measured slower (2 processes:
# 4.1 against 3.4 ms an iteration, `python -m benchmarks deferred`).
DEFER_FROM = 64
_ON = ("1", "true", "yes", "on", "enabled")
_OFF = ("0", "false", "no", "off", "disabled", "")


def env_flag(name: str, default: bool | None) -> bool | None:
    """The switch in environment variable ``name`` (``default`` when unset): one of ``_ON`` or
    ``_OFF`` (any case, surrounding spaces ignored); anything else is a ``ValueError`` naming
    the variable, never read as either."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r}: expected one of {', '.join(_ON)} (on) or "
        f"{', '.join(v for v in _OFF if v)} (off), but got {raw!r}. Set {name}=0 to turn the "
        f"check off or {name}=1 to turn it on."
    )


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = bool(env_flag(ENV_VAR, True))
        # None: the default, each loader epoch's first batch; True: every batch; False: never
        self.values = env_flag(VALUES_ENV_VAR, None)
        # Whether a direct call's check is judged off the step's path (where torch can wait
        # at the result's first use): None (the default) from DEFER_FROM processes; this
        # process's own choice, not compared.
        self.deferred = env_flag(DEFERRED_ENV_VAR, None)


_STATE = _State()

# Who hears of a switch (the backends that tell the other processes): called with the switch's
# name and its new value, after it changed, on the thread that changed it.
_LISTENERS: list[Callable[[str, Any], None]] = []


def on_switch(listener: Callable[[str, Any], None]) -> None:
    """Registers ``listener(name, value)``, called after ``set_agreement_check`` or
    ``set_value_check`` changed a switch (``name`` is the function's)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def switches() -> dict[str, Any]:
    """This process's switches, by the name of the function that sets each."""
    return {"set_agreement_check": _STATE.enabled, "set_value_check": _STATE.values}


def _switched(name: str, value: Any) -> None:
    for listener in list(_LISTENERS):
        listener(name, value)


MAIN_STREAM = "main"
_STREAM: contextvars.ContextVar[str] = contextvars.ContextVar(
    "torchshard_call_stream", default=MAIN_STREAM
)


@contextlib.contextmanager
def call_stream(name: str, /) -> Iterator[None]:
    """Matches the torchshard calls made inside the block with the other processes' calls of
    the stream ``name``, in order, apart from the calls outside it.

    The processes' torchshard calls that compare or exchange something (the agreement check, a
    loader's epochs, read-backs on DTensor) meet in program order on the *main* stream, whatever
    thread makes them: a program whose ``host_to_global_array`` runs on ``MainThread`` on one
    process and on a thread named ``trainer`` on another is matched call for call. Two threads
    of one process that make such calls *at the same time* need a stream each, named alike on
    every process (a thread's calls outside any ``call_stream`` block are on ``"main"``)::

        def evaluate():
            with torchshard.call_stream("eval"):
                for batch in eval_loader: ...

    Raises ``TypeError`` for a name that is not a non-empty ``str``.
    """
    if not isinstance(name, str) or not name or "\x1f" in name:
        raise TypeError(
            f"call_stream: name must be a non-empty str, but got {name!r}; pass a name that is "
            "the same on every process, e.g. call_stream('eval')."
        )
    token = _STREAM.set(name)
    try:
        yield
    finally:
        _STREAM.reset(token)


def current_stream() -> str:
    """The calling context's stream of torchshard calls (``"main"`` outside ``call_stream``)."""
    return _STREAM.get()


def set_agreement_check(enabled: bool, /) -> bool:
    """Turns the cross-process shape/dtype agreement check on or off; returns the old setting.

    With one process per device (the DTensor backend), ``host_to_global_array`` first checks
    that every process passed the same tree structure, partition, shapes and dtypes, so that a
    disagreement is a clear error on every process instead of a hang. The check costs one
    exchange of a short digest of the call between the processes (torchshard's exchange tree:
    O(log N) hops), overlapped with placement, and is bounded by the default group's timeout;
    turn it off when the input pipeline guarantees equal shapes and that latency matters. The
    environment variable ``TORCHSHARD_AGREEMENT_CHECK=0`` also turns it off. The torch_xla
    backend does not check (it has no cheap collective outside a step).

    Example:
        >>> previous = torchshard.set_agreement_check(False)
        >>> torchshard.set_agreement_check(previous)
        False
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_agreement_check: expected a bool, but got {enabled!r}.")
    with _STATE.lock:
        old, _STATE.enabled = _STATE.enabled, enabled
    if old != enabled:
        _switched("set_agreement_check", enabled)
    return old


def set_agreement_deferred(enabled: bool | None, /) -> bool | None:
    """Whether ``host_to_global_array``'s agreement check is judged off the step's path
    (``True``), in the call (``False``), or off the path from 64 processes (``None``, the
    default: below that the exchange costs less than deferring it); returns the old setting.

    Deferred (on DTensor with torch >= 2.13), the call begins the check's exchange and returns
    at once; the check is judged at the first use of any tensor of its result (the first op on
    it waits for the exchange, and raises the check's ``ProcessDisagreementError`` or
    ``CollectiveError`` there), or before the next torchshard call on the same stream, or when
    the mesh's ``with`` block is left, or at interpreter exit, whichever comes first. So the
    exchange overlaps the work between the call and that point (the step of the batch placed
    before, when the next batch is placed ahead). An error raised later names the call it
    belongs to (its number on its stream). ``set_agreement_deferred(False)`` (or
    ``TORCHSHARD_AGREEMENT_DEFERRED=0``; ``=1`` defers at any size) judges it in the call, as
    torch 2.9 always does (it cannot make a tensor's first use wait for the check, and letting
    the step run first would let its collectives meet on tensors the processes disagree
    about). A loader's batches are judged by the loader as before; the value check
    (``set_value_check``) judges first. Each process may choose for itself (nothing is
    compared).

    Example:
        >>> previous = torchshard.set_agreement_deferred(False)
        >>> torchshard.set_agreement_deferred(previous)
        False
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            f"set_agreement_deferred: expected True, False or None (deferred from "
            f"{DEFER_FROM} processes), but got {enabled!r}."
        )
    with _STATE.lock:
        old, _STATE.deferred = _STATE.deferred, enabled
    return old


_IN_THE_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchshard_agreement_in_the_call", default=False
)


def agreement_deferred(processes: int) -> bool:
    """Whether a direct call's agreement check among ``processes`` may be judged after the
    call returns."""
    if _IN_THE_CALL.get():
        return False
    setting = _STATE.deferred
    return processes >= DEFER_FROM if setting is None else setting


@contextlib.contextmanager
def judged_in_the_call() -> Iterator[None]:
    """Inside the block, a direct call's agreement check is judged in the call (a call that
    torch.compile traces: its result enters the graph, which must not see a tensor that
    waits)."""
    token = _IN_THE_CALL.set(True)
    try:
        yield
    finally:
        _IN_THE_CALL.reset(token)


def set_value_check(enabled: bool | None, /) -> bool | None:
    """Turns the cross-process value check on, off or back to its default; returns the old
    setting (``None`` for the default).

    With one process per device (the DTensor backend), processes whose blocks of a leaf cover
    the same global ranges (a replicated leaf, ``P()``; or a mesh axis the leaf's spec leaves
    free) must pass the same values: each process's block is what its own device holds, so
    replicas that differ are silently wrong (``replicate_to_local_data`` shows one process's).
    With this check on, ``host_to_global_array`` and every ``GlobalBatchLoader`` batch
    exchange a checksum of each process's block and raise ``ProcessDisagreementError`` on
    every process, naming the leaf and the ranks, when blocks of the same ranges differ.

    By default (``None``) a ``GlobalBatchLoader`` on several DTensor processes checks the
    first batch of every epoch, so that a feed that gives processes sharing a block different
    examples (each process reading its own shard where the mesh gives several the same block)
    is never silent; ``set_value_check(False)`` (or ``TORCHSHARD_VALUE_CHECK=0``) turns that
    off too, ``True`` (or ``TORCHSHARD_VALUE_CHECK=1``) checks every batch and every
    ``host_to_global_array``.

    The cost: hashing every local block (blake2b, about 1 GB/s per process) and one exchange in
    which the processes' checksums are compared per block as they meet up the exchange tree
    (see docs/design.md for measurements). Environment variable: ``TORCHSHARD_VALUE_CHECK=1``.
    The torch_xla backend does not check across processes.

    Example:
        >>> previous = torchshard.set_value_check(True)
        >>> torchshard.set_value_check(previous)
        True
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_value_check: expected a bool or None, but got {enabled!r}.")
    with _STATE.lock:
        old, _STATE.values = _STATE.values, enabled
    if old != enabled:
        _switched("set_value_check", enabled)
    return old


def value_check_enabled() -> bool:
    """Whether processes compare the values of blocks that cover the same ranges, at every
    call and batch (``set_value_check(True)``)."""
    return _STATE.values is True


def value_check_first_batch() -> bool:
    """Whether a loader compares the values of its epochs' first batches (unless the check was
    turned off: ``set_value_check(False)``)."""
    return _STATE.values is not False


def agreement_check_enabled() -> bool:
    """Whether ``host_to_global_array`` checks that the processes agree."""
    return _STATE.enabled


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def describe(treespec: Any, leaves: Sequence[Any], partition: Any) -> list[str]:
    """One line for the call's structure and partition, then one ``"(shape) dtype"`` per leaf.

    numpy arrays and CPU tensors of the same shape and dtype describe alike (they place alike).
    """
    out = [f"structure {treespec}, partition {partition!r}"]
    for x in leaves:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        if shape is None or dtype is None:
            out.append(type(x).__name__)
        else:
            out.append(f"{tuple(int(n) for n in shape)} {_dtype_name(dtype)}")
    return out


def describe_mesh(mesh: Any) -> str:
    """The mesh a call runs on, as the agreement compares it: axis names and sizes in order,
    and the device ids of the grid (processes that built their meshes with the axes in
    another order place the same spec differently)."""
    return f"mesh {dict(mesh.shape)} of devices {mesh.devices.tolist()}"


def with_mesh(items: Sequence[str], mesh: Any) -> list[str]:
    """``describe`` output with the mesh added to its first line (the structure's)."""
    out = list(items)
    if out and out[0].startswith("structure "):
        out[0] = f"{out[0]}, {describe_mesh(mesh)}"
    return out


def digest(items: Sequence[str]) -> int:
    """A signed 64-bit hash of ``items`` (to all-gather as one int64)."""
    h = hashlib.blake2b(digest_size=8)
    for item in items:
        h.update(item.encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little", signed=True)


def disagreement(
    argname: str, groups: Sequence[Group], where: Callable[[int], str]
) -> ProcessDisagreementError:
    """The error naming the first item on which the processes' descriptions differ.

    ``groups``: the processes that passed each distinct ``describe`` output, the group of the
    lowest rank first (``Verdict.groups``); ``where(i)`` is leaf ``i``'s path.
    """
    ref = groups[0].items
    first = groups[0].ranks.first if groups[0].ranks.ranges else 0
    n = max(len(g.items) for g in groups)
    for i in range(n):
        seen = [g.items[i] if i < len(g.items) else "nothing" for g in groups]
        if len(set(seen)) == 1:
            continue
        by: dict[str, RankSet] = {}
        for g, d in zip(groups, seen, strict=True):
            if d != seen[0]:
                by[d] = by[d] | g.ranks if d in by else g.ranks
        got = "; ".join(f"{d} on process(es) [{ps}]" for d, ps in by.items())
        if i == 0 and len({d.rpartition(", mesh ")[0] for d in seen}) == 1 and ", mesh " in ref[0]:
            meshes = "; ".join(f"{_mesh_of(d)} on process(es) [{ps}]" for d, ps in by.items())
            return ProcessDisagreementError(
                at(
                    argname,
                    f"every process must place on the same mesh (axis names in the same order, "
                    f"the same sizes and devices); expected {_mesh_of(seen[0])} (as on "
                    f"process {first}), got {meshes}. Build the mesh alike on every process "
                    "(e.g. init_device_mesh(..., mesh_dim_names=...) with the same names in the "
                    "same order).",
                )
            )
        if i == 0:
            expected = seen[0]
            if ", mesh " in ref[0] and len({_mesh_of(d) for d in seen}) == 1:  # same mesh
                expected = expected.rpartition(", mesh ")[0]
                got = "; ".join(
                    f"{d.rpartition(', mesh ')[0]} on process(es) [{ps}]" for d, ps in by.items()
                )
            return ProcessDisagreementError(
                at(
                    argname,
                    f"every process must pass the same tree structure and partition; "
                    f"expected {expected} (as on process {first}), got {got}.",
                )
            )
        return ProcessDisagreementError(
            at(
                where(i - 1),
                f"every process must pass the same shape and dtype for a leaf (the "
                f"global shape is inferred from them); expected {seen[0]} (as on process "
                f"{first}), got {got}. Make every process's input yield the same shapes and "
                "dtypes (pad or drop a short last batch, or use torchshard.InputDispatcher).",
            )
        )
    return ProcessDisagreementError(
        at(
            argname,
            f"the processes' call descriptions hash differently but read alike "
            f"({ref!r}); this is a torchshard bug.",
        )
    )


def _mesh_of(line: str) -> str:
    return "mesh " + line.rpartition(", mesh ")[2]


END_OF_DATA = "the end of the source"  # the outcome of a batch past the sources' end


def failure(error: BaseException) -> list[str]:
    """The outcome description of a batch whose making raised ``error``."""
    text = str(error).splitlines()[0] if str(error) else ""
    return [f"a failure: {type(error).__name__}: {text}"]


def outcome_disagreement(
    what: str, groups: Sequence[Group], where: Callable[[int], str]
) -> ProcessDisagreementError:
    """The error for a loader's batch whose outcome differs between the processes.

    ``groups``: the processes of each distinct outcome (``describe`` output, ``[END_OF_DATA]``
    or ``failure(e)``), lowest rank first. When every process made a batch, this is
    ``disagreement``'s error."""
    if all(g.items and g.items[0].startswith("structure ") for g in groups):
        return disagreement(what, groups, where)
    seen = "; ".join(
        f"{'process' if len(g.ranks) == 1 else 'processes'} {g.ranks}: "
        f"{g.items[0] if g.items and not g.items[0].startswith('structure ') else 'a batch'}"
        for g in groups
    )
    return ProcessDisagreementError(
        at(
            what,
            f"every process must make the batch or end its source at the same batch, but "
            f"{seen}. Give every process a source that yields the same number of batches (e.g. "
            "torchshard.host_sampler with drop_last=True).",
        )
    )
