"""Shared by the torchshard.data tests: a fake dispatcher, a counting dataset, thread checks,
an epoch plan made by hand, and the save/resume harness."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

import torchshard as ts

LOADER_THREAD = "torchshard-loader"


def wait_until(cond, timeout=20.0):
    """Polls ``cond`` until it holds; the timeout only stops a hang (no time is asserted)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def loader_threads():
    """The live torchshard loader threads (after a collection, so finalisers have run)."""
    gc.collect()
    return [t for t in threading.enumerate() if t.name.startswith(LOADER_THREAD) and t.is_alive()]


def no_loader_thread_left():
    return wait_until(lambda: not loader_threads(), timeout=15.0)


def run_script(path, text):
    """Runs ``text`` as the script ``path`` in a fresh interpreter that imports this
    checkout's torchshard."""
    path.write_text(text)
    root = str(Path(ts.__file__).resolve().parents[1])
    return subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": root},
    )


def make_plan(mesh, spec, **fields):
    """An ``EpochPlan`` made by hand, as the loader's ``iter()`` would make it, for tests that
    drive a ``Producer`` or an ``Epoch`` directly (``fields``: the plan's other fields)."""
    from torchshard._backend.registry import lookup
    from torchshard.data._loader.plan import EpochPlan

    return EpochPlan(mesh=mesh, backend=lookup(mesh), spec=spec, **fields)


class FakeDispatcher:
    """Duck-typed stand-in for issue 3's InputDispatcher: counts calls, pads nothing."""

    def __init__(self, partition_spec=None, *, num_shards=1, shard_index=0, add_key=False):
        self.partition_spec = ts.P("data") if partition_spec is None else partition_spec
        self.calls = 0
        self._config = {"num_shards": num_shards, "shard_index": shard_index}
        self._add_key = add_key

    def feed_read_config(self):
        return dict(self._config)

    def logical_to_physical_batch(self, batch):
        self.calls += 1
        if self._add_key:
            n = len(batch["id"])
            batch = {**batch, "__physical_to_logical_batch_dispatch": np.arange(n)}
        return batch


class Rows(torch.utils.data.Dataset):
    """Example ``i`` is ``{"id": i, "x": [i, i, i] float32}``."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": np.int64(i), "x": np.full(3, i, np.float32)}


def ids(global_batch):
    """The example ids of a global batch, in global row order (read back from the devices)."""
    return ts.replicate_to_local_data(global_batch["id"]).tolist()


def process_entry(state):
    """The one process's entry (``"process_<i>"``) of a loader's state."""
    (entry,) = [v for k, v in state.items() if k.startswith("process_")]
    return entry


def save_resume(make, *, midpoint, prefetch, batch_bytes, read=ids):
    """The shared save/resume check of a stateful loader.

    ``make(prefetch)`` returns a fresh loader over fresh sources with the same order;
    ``read(global_batch)`` turns a batch into something comparable (default: its ids). Takes
    ``midpoint`` batches (``"end"``: the whole epoch and its StopIteration), lets the prefetch
    run ahead, saves, resumes in a new loader and checks that exactly the batches not taken
    follow, in order, and that the epoch after is whole (its order is the source's business:
    StatefulDataLoader's next epoch after a resume differs from an uninterrupted run's).
    """
    reference = [read(b) for b in make(prefetch)]
    n = len(reference)

    def whole_epoch(batches):  # the source decides the order of later epochs
        return sorted(i for b in batches for i in b) == sorted(i for b in reference for i in b)

    loader = make(prefetch)
    it = iter(loader)
    stop = n if midpoint == "end" else midpoint
    taken = [read(next(it)) for _ in range(stop)]
    if midpoint == "end":
        assert next(it, None) is None
    else:  # wait until the thread has transferred what it may ahead of the consumer
        ahead = min(stop + prefetch, n)
        assert wait_until(lambda: loader.stats.bytes >= ahead * batch_bytes)
    state = loader.state_dict()
    assert process_entry(state)["next_batch"] == (0 if midpoint == "end" else stop)
    loader.close()

    resumed = make(prefetch)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))  # as a checkpoint holds it
    rest = [read(b) for b in resumed]
    if midpoint == "end":
        assert taken == reference
        assert len(rest) == n and whole_epoch(rest)  # a finished epoch resumes at the next
    else:
        assert taken + rest == reference
        assert whole_epoch([read(b) for b in resumed])
    assert no_loader_thread_left()
