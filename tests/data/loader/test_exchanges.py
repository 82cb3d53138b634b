"""An epoch's outcome exchanges (torchshard.data._loader.exchanges): each exchange runs on the
epoch's channel; closing the channel happens once, saying whether the exchanges agreed on the
end and how many batches the consumer took; the verdict on one batch's outcomes raises their
disagreement (located: it names its batch itself) or notes it on this process's own error."""

from __future__ import annotations

import threading

import pytest

import torchshard as ts
from torchshard._core.verdict import Verdict
from torchshard.data._loader.exchanges import Exchanges, judge
from torchshard.data._loader.prefetch import LOCATED


class Recorder:
    """The backend's process checks as a recorder of what is called on which channel."""

    def __init__(self):
        self.calls = []

    def exchange(self, mesh, items, *, what, channel=None, force=False, counts=()):
        self.calls.append(("exchange", channel, what, list(items), force, list(counts)))
        return None

    def begin_exchange(self, mesh, items, *, what, channel=None):
        self.calls.append(("begin", channel, what, list(items)))
        return lambda: Verdict.of([["a"], ["b"]])

    def close_channel(self, mesh, channel, *, finished, taken):
        self.calls.append(("close", channel, finished, taken))


def test_every_exchange_runs_on_the_epochs_channel():
    checks = Recorder()
    exchanges = Exchanges(checks, mesh=None, channel="MainThread.loader4")
    verdict = exchanges.exchange(
        ["x"], what="GlobalBatchLoader: batch 0", force=True, counts=[8, 0, 0]
    )
    assert verdict is None
    end = exchanges.begin(["x"], what="GlobalBatchLoader: batch 1")
    assert end().per_process() == [("a",), ("b",)]
    assert checks.calls == [
        ("exchange", "MainThread.loader4", "GlobalBatchLoader: batch 0", ["x"], True, [8, 0, 0]),
        ("begin", "MainThread.loader4", "GlobalBatchLoader: batch 1", ["x"]),
    ]


def test_closing_happens_once_and_says_what_the_consumer_took():
    checks = Recorder()
    exchanges = Exchanges(checks, mesh=None, channel="c")
    for _ in range(3):
        exchanges.count_taken()
    closers = [threading.Thread(target=exchanges.close) for _ in range(8)]
    for t in closers:
        t.start()
    for t in closers:
        t.join()
    exchanges.close()
    assert checks.calls == [("close", "c", False, 3)] and exchanges.closed
    finished = Exchanges(checks, mesh=None, channel="d")
    finished.agreed_end()
    finished.close()
    assert checks.calls[-1] == ("close", "d", True, 0)


def test_the_verdict_of_outcomes_that_agree_is_silent():
    assert judge("GlobalBatchLoader: batch 2", None, lambda i: f"leaf {i}", None) is None
    agreed = Verdict.of([["structure s"]] * 3)
    assert judge("GlobalBatchLoader: batch 2", agreed, lambda i: f"leaf {i}", None) is None


def test_the_verdict_raises_a_located_disagreement():
    every = [["structure s", "(8,) float32"], ["the end of the source"]]
    with pytest.raises(ts.errors.ProcessDisagreementError) as info:
        judge("GlobalBatchLoader: batch 2", Verdict.of(every), lambda i: f"leaf {i}", None)
    assert str(info.value).startswith(
        "GlobalBatchLoader: batch 2: every process must make the batch or end its source at the "
        "same batch, but process 0: a batch; process 1: the end of the source."
    )
    assert getattr(info.value, LOCATED) is True


def test_the_verdict_notes_the_others_on_this_processs_own_error():
    error = OSError("bad record")
    every = [["a failure: OSError: bad record"], ["structure s", "(8,) float32"]]
    judge("GlobalBatchLoader: batch 5", Verdict.of(every), lambda i: f"leaf {i}", error)
    note = (
        "(the other processes' outcomes differ: GlobalBatchLoader: batch 5: every process must "
        "make the batch or end its source at the same batch, but process 0: a failure: OSError: "
        "bad record; process 1: a batch. Give every process a source that yields the same "
        "number of batches (e.g. torchshard.host_sampler with drop_last=True).)"
    )
    assert error.__notes__ == [note]
