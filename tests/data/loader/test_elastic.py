"""Elastic sources (torchshard.data._loader.elastic): the protocol, the job's position gathered
from every process's parts (an exchange's result in each of its forms: ``None``, a list per
process, a verdict's groups), and the checks of a saved position. No mesh needed: the exchange
is a stand-in that returns what the other processes passed."""

from __future__ import annotations

import json
import re
import types

import pytest

from torchshard.data._loader import elastic


class Counter:
    """An elastic source whose state is ``{"seen": {shard: n}}`` for its shards."""

    def elastic_part(self, state):
        return state["seen"]

    @staticmethod
    def merge_elastic_parts(parts):
        merged = {}
        for p in parts:
            for k, v in p.items():
                if merged.get(k, v) != v:
                    raise ValueError(f"shard {k}: {merged[k]} and {v}")
                merged[k] = v
        return merged

    def load_elastic_state(self, position):
        self.loaded = position


class Exchange:
    """``ProcessChecks.exchange`` of a job whose other processes pass ``others``, answering in
    the form ``form`` (``"list"``: every process's items; ``"verdict"``: groups)."""

    def __init__(self, others, form):
        self.others, self.form, self.calls = others, form, []

    def exchange(self, mesh, items, *, what, force):
        self.calls.append((what, force))
        every = [
            list(items),
            *[[json.dumps(sorted({json.dumps(o, sort_keys=True)}))] for o in self.others],
        ]
        if self.form == "list":
            return every
        groups = {}
        for items_ in every:
            groups.setdefault(tuple(items_), None)
        return types.SimpleNamespace(groups=[types.SimpleNamespace(items=list(k)) for k in groups])


def test_the_protocol_is_three_members():
    assert elastic.elastic(Counter())
    assert not elastic.elastic(object()) and not elastic.elastic([1, 2])
    assert elastic.kind(Counter()).endswith("test_elastic.Counter")


@pytest.mark.parametrize("form", ["list", "verdict"])
def test_the_job_position_merges_every_process_part(form):
    checks = Exchange([{"1": 3}, {"0": 5}, {"1": 3}], form)  # a peer passes an equal part
    job = elastic.gather(
        [Counter()], [{"seen": {"0": 5}}], mesh=object(), processes=checks, count=4
    )
    assert job == {"kind": elastic.kind(Counter()), "position": {"0": 5, "1": 3}}
    assert checks.calls == [("GlobalBatchLoader.state_dict: the job's position", True)]


def test_one_process_merges_its_own_sources_and_nothing_is_exchanged():
    job = elastic.gather(
        [Counter(), Counter()],
        [{"seen": {"0": 1}}, {"seen": {"1": 2}}],
        mesh=None,
        processes=None,
        count=1,
    )
    assert job["position"] == {"0": 1, "1": 2}
    # Several processes and no exchange (torch_xla): the parts stay in the entries.
    assert elastic.gather([Counter()], [{"seen": {}}], mesh=None, processes=None, count=2) is None
    assert elastic.parts_of([Counter()], [{"seen": {"0": 1}}]) == [{"0": 1}]
    # Not elastic, or no state yet (a loader never iterated): no position.
    assert elastic.gather([object()], [{}], mesh=None, processes=None, count=1) is None
    assert elastic.gather([Counter()], [None], mesh=None, processes=None, count=1) is None


def test_contradicting_parts_are_the_sources_error():
    checks = Exchange([{"0": 4}], "list")
    with pytest.raises(ValueError, match=re.escape("shard 0: 4 and 5")):
        elastic.gather([Counter()], [{"seen": {"0": 5}}], mesh=object(), processes=checks, count=2)


def test_a_saved_position_is_checked_against_the_sources():
    saved = {"kind": elastic.kind(Counter()), "position": {"0": 1}}
    assert elastic.check(saved, [Counter()], "w") is saved
    with pytest.raises(ValueError, match=re.escape("w: saved by sources of type x.Other")):
        elastic.check({"kind": "x.Other", "position": {}}, [Counter()], "w")
    with pytest.raises(ValueError, match=re.escape("w: expected the job's position")):
        elastic.check({"position": {}}, [Counter()], "w")
