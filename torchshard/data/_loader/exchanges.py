"""An epoch's exchanges of each batch's outcome between the processes (``Exchanges``), and the
verdict on one batch's outcomes (``judge``).

When the processes compare each batch (the DTensor agreement check on several processes) or
must know where the others' sources end (``last_batch="drop"``/``"pad"``), every batch's
*outcome* (its description, the end of the source, or a failure, with the status that
``last_batch`` needs) is exchanged on the epoch's channel: a sequence of bounded exchanges that
every process makes in the same order, opened by ``iter()`` in program order (``plan.py``) and
run by whoever makes the batches (the loader's thread, or ``next()`` with ``prefetch=0``).
``close()`` ends the channel once nothing runs its exchanges any more; the consumer counts the
batches it takes (``taken``), which that close names to the processes still waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from torchshard._backend.protocols import ProcessChecks
from torchshard._core.agreement import outcome_disagreement
from torchshard._core.mesh import Mesh
from torchshard._core.verdict import Verdict
from torchshard.data._loader.prefetch import LOCATED


class Exchanges:
    """An epoch's channel of outcome exchanges (``ProcessChecks.open_channel``). The producer
    runs them and says when they agreed on the end (``agreed_end``), the consumer counts the
    batches it takes (``count_taken``), and ``close`` ends the channel. It owns that state;
    holding no reference to the epoch, it can be closed by an abandoned iterator's finaliser."""

    def __init__(self, checks: ProcessChecks, mesh: Mesh, channel: str) -> None:
        self.checks = checks
        self.mesh = mesh
        self.channel = channel
        self._taken = 0  # batches the consumer took
        self._finished = False  # the exchanges agreed on the end of every process's sources
        self._closed = False
        self._lock = threading.Lock()  # the loader and a finaliser's thread may both close it

    @property
    def taken(self) -> int:
        """The batches the consumer took."""
        return self._taken

    @property
    def finished(self) -> bool:
        """Whether the last exchange was the agreed end of every process's sources."""
        return self._finished

    @property
    def closed(self) -> bool:
        """Whether the channel is closed."""
        return self._closed

    def count_taken(self) -> None:
        """The consumer took one more batch (its ``next()``)."""
        self._taken += 1

    def agreed_end(self) -> None:
        """The producer's last exchange settled on the end of every process's sources: closing
        the channel then leaves nobody waiting, and its keys go."""
        self._finished = True

    def exchange(
        self, items: Sequence[str], *, what: str, force: bool = False, counts: Sequence[int] = ()
    ) -> Verdict | None:
        """The processes' ``items`` compared and ``counts`` reduced (``ProcessChecks.exchange``
        on this channel)."""
        return self.checks.exchange(
            self.mesh, items, what=what, channel=self.channel, force=force, counts=counts
        )

    def begin(self, items: Sequence[str], *, what: str) -> Callable[[], Verdict | None]:
        """``exchange`` in two halves (``ProcessChecks.begin_exchange`` on this channel)."""
        return self.checks.begin_exchange(self.mesh, items, what=what, channel=self.channel)

    def close(self) -> None:
        """Ends the channel (once): every process still to reach its next exchange, or waiting
        in it, raises naming this process, unless the exchanges agreed on the end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.checks.close_channel(
            self.mesh, self.channel, finished=self._finished, taken=self._taken
        )


def judge(
    what: str,
    verdict: Verdict | None,
    paths: Callable[[int], str],
    error: BaseException | None,
) -> None:
    """The verdict on a batch's outcomes (``None``: not compared): raises their disagreement,
    or notes it on this process's own ``error`` (a failure of the source or the check, which
    the caller raises)."""
    if verdict is None or verdict.agreed:
        return
    problem = outcome_disagreement(what, verdict.groups, paths)
    if error is not None:
        error.add_note(f"(the other processes' outcomes differ: {problem})")
        return
    setattr(problem, LOCATED, True)
    raise problem
