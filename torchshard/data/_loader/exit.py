"""Process exit: every loader thread stopped and joined, boundedly, before the interpreter
finalizes (standard library only).

A daemon thread still running once the interpreter finalizes is killed when it next takes the
GIL; inside torch's C++ (a tensor freed as a job's frame is cleared, a store write) that kill
aborts the process ("terminate called without an active exception", exit -6; docs/design.md,
"Data"). So at exit, before ``atexit``'s hooks (which tear down torch_xla's runtime and
torch.distributed's stores), ``at_exit``:

1. retires every prefetcher whose run may still go on (``track``: a weak set; the thread stops
   at its next check, runs its ``on_finish``, which closes the epoch's exchanges, and exits);
2. closes the thread pool (``threads.close_pool``: the parked threads end, none parks again);
3. joins every thread still running, for at most ``EXIT_SECONDS`` in all, and names in a
   warning the ones still running after that (placing a batch, or in an exchange).

A thread inside its source (``Prefetcher.in_source``: a slow dataset, stuck DataLoader
workers) is not waited for: retired, it can only leave the source by raising, without running
torch's code again, so it is safe to finalize under it; waiting for it held Ctrl-C's exit up by
``EXIT_SECONDS`` (the plain ``DataLoader`` loop exits at once).

The hook is registered with ``threading`` (its exit hooks run before ``atexit``'s and before
non-daemon threads are joined). A forked child forgets the parent's prefetchers, as the pool
forgets its threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Protocol

from torchshard.data._loader import threads

EXIT_SECONDS = 2.0  # how long the interpreter's exit waits for all threads, in all

_log = logging.getLogger(__name__)


class Retirable(Protocol):
    """What exit retires: a ``Prefetcher``."""

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None: ...

    def in_source(self) -> threading.Thread | None: ...


_LIVE: weakref.WeakSet[Retirable] = weakref.WeakSet()


def track(prefetcher: Retirable) -> None:
    """Retires ``prefetcher`` at exit if its run has not finished by then (held weakly: its
    running job holds it while the run goes on)."""
    _LIVE.add(prefetcher)


def shutdown(
    timeout: float, skip: frozenset[threading.Thread] = frozenset()
) -> list[threading.Thread]:
    """Closes the thread pool and waits at most ``timeout`` seconds in all for every thread to
    end (their runs must have been retired), but for those in ``skip`` (inside their source);
    returns the threads still running, ``skip``'s apart."""
    running = [t for t in threads.close_pool() if t not in skip]
    end = time.monotonic() + timeout
    current = threading.current_thread()
    for thread in running:
        if thread is not current:
            thread.join(timeout=max(0.0, end - time.monotonic()))
    return [t for t in running if t.is_alive()]


def at_exit() -> None:
    """Retires every live run and joins the threads (bounded), but those inside their source:
    none runs torch's code into finalization."""
    live = list(_LIVE)
    for prefetcher in live:
        prefetcher.close(wait=False)
    in_source = frozenset(t for p in live if (t := p.in_source()) is not None)
    left = shutdown(EXIT_SECONDS, skip=in_source)
    if left:
        _log.warning(
            "at exit, torchshard's threads %s did not stop within %g s (busy outside their "
            "source: placing a batch, or in an exchange with the other processes); the "
            "interpreter may abort if one is inside torch when it finalizes.",
            [t.name for t in left],
            EXIT_SECONDS,
        )


def _forget() -> None:
    """In a forked child: the parent's prefetchers run no thread here."""
    global _LIVE
    _LIVE = weakref.WeakSet()


os.register_at_fork(after_in_child=_forget)

# threading's exit hooks run before atexit's (and before non-daemon threads are joined), so
# the threads stop while torch_xla's runtime and torch.distributed's stores still exist.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(at_exit)
else:  # pragma: no cover - every supported Python has it
    import atexit

    atexit.register(at_exit)
