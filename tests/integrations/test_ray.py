"""Ray Data (torchshard.integrations.ray): ``feed_split`` on a local Ray cluster that this test
starts (one per module, ended by the pids it started), read by 2 gloo processes that join it.
The oracle is Ray's own ``streaming_split(n, equal=...)`` consumed directly: every feed's rows
equal its split's, the peers of a feed (tp) read the same batches, the ragged end is padded
and masked (every row once), and a loader resumed from its state through a new hub reads
exactly the rest. Skips without Ray."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest

from torchshard._core.version import pip_install

ray = pytest.importorskip("ray", reason=f"needs ray: {pip_install('ray')}")
psutil = pytest.importorskip("psutil")
import _ray_cases  # noqa: E402, F401 -- the workers import it; here it must import too

from torchshard.integrations.ray import FeedSplit, feed_split  # noqa: E402

# Ray 2.60's DataContext warns about its own deprecated fields when it copies itself.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster (head node in this process's children), its address; the processes
    it started are ended by pid afterwards, whatever ``ray.shutdown`` leaves."""
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the gloo processes join it
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # stay on 127.0.0.1
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def splits_of(rows: int, blocks: int, n: int, batch: int, equal: bool) -> list[list[list[int]]]:
    """The oracle: Ray's own ``streaming_split`` of the same dataset, each split consumed by
    its own thread (its one consumer), in batches of ``batch``; the order preserved, as the hub
    runs it."""
    ds = ray.data.range(rows, override_num_blocks=blocks)
    ds.context.execution_options.preserve_order = True
    its = ds.streaming_split(n, equal=equal)
    out: list[list[list[int]]] = [[] for _ in range(n)]

    def consume(i: int) -> None:
        for b in its[i].iter_batches(batch_size=batch, batch_format="numpy"):
            out[i].append([int(x) for x in b["id"]])

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def _real(ids: list[list[int]], masks: list[list[bool]]) -> list[int]:
    return [
        i for row, m in zip(ids, masks, strict=True) for i, keep in zip(row, m, strict=True) if keep
    ]


@pytest.mark.parametrize(
    ("tp", "equal"), [(1, False), (2, True)], ids=["dp2-ragged", "tp2-peers-equal"]
)
def test_feeds_read_rays_own_splits_and_resume(cluster, pools, tp, equal):
    rows, blocks, batch, stop = 23, 5, 4, 2
    results = pools(2).run(
        "_ray_cases:feeds",
        address=cluster,
        name=f"test-{tp}-{equal}",
        tp=tp,
        rows=rows,
        blocks=blocks,
        batch=batch,
        equal=equal,
        stop=stop,
    )
    feeds = 2 // tp
    oracle = splits_of(rows, blocks, feeds, batch, equal)
    steps = max(len(s) for s in oracle)
    for rank, r in enumerate(results):
        f = rank // tp
        assert (r["feed"], r["feeds"]) == (f, feeds)
        # Every batch has the feed's full rows; the real ones are the split's, in order.
        assert len(r["ids"]) == steps and all(len(b) == batch for b in r["ids"])
        assert _real(r["ids"], r["masks"]) == [i for b in oracle[f] for i in b]
        assert _real(r["second"], r["second_masks"]) == _real(r["ids"], r["masks"])
        # Resumed after `stop` batches through a new hub: exactly the rest.
        assert r["rest"] == r["ids"][stop:] and r["rest_masks"] == r["masks"][stop:]
    if tp == 2:  # the peers of the one feed read the same batches
        assert results[0]["ids"] == results[1]["ids"]
    every = sorted(i for r in results[::tp] for i in _real(r["ids"], r["masks"]))
    if equal:  # Ray drops up to feeds - 1 rows so that the splits are equal
        assert len(every) == rows // feeds * feeds and len(set(every)) == len(every)
    else:  # every row once; the splits' ragged end padded and masked
        assert every == list(range(rows))
        assert len({sum(map(len, s)) for s in oracle}) > 1  # the splits are ragged


def test_the_example_runs_under_torchrun_on_the_cluster(cluster, tmp_path):
    """examples/stacks/ray_data.py, as docs/stacks.md runs it (the cluster is this module's,
    not `ray start`'s), on (dp=1, tp=2): the two peers read one split."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_"))}
    env.update(OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    script = root / "examples" / "stacks" / "ray_data.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    out = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", str(script), "--address", cluster, "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("ray_data:")]
    expected = (
        "ray_data: 2 processes on (dp=1, tp=2), 50 rows in batches of 4 per feed: every row "
        "once per pass, tp peers alike, resumed after 2 batches with the rest"
    )
    assert lines == [expected], out.stdout + out.stderr[-3000:]


def test_arguments_and_states(cluster, monkeypatch):
    ds = ray.data.range(4)
    with pytest.raises(TypeError, match=re.escape("feed_split: batch_size must be an int >= 1")):
        feed_split(ds, batch_size=0)
    with pytest.raises(TypeError, match=re.escape("dataset must be a ray.data.Dataset")):
        feed_split([1, 2], batch_size=2)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=re.escape("call ray.init(address=")):
        feed_split(ds, batch_size=2)
    monkeypatch.undo()
    source = FeedSplit(None, feed=1, feeds=2, batch_size=4, timeout=1.0, name="x")
    state = source.state_dict()
    assert state == {"feeds": 2, "feed": 1, "batch_size": 4, "pass": 0, "batches": 0}
    with pytest.raises(ValueError, match=re.escape("saved by feed 0 of 2 with batch_size=4")):
        source.load_state_dict({**state, "feed": 0})
    with pytest.raises(ValueError, match=re.escape("expected a dict with keys")):
        source.load_state_dict({"batches": 3})
    with pytest.raises(ValueError, match=re.escape("['batches']: expected an int >= 0")):
        source.load_state_dict({**state, "batches": -1})
