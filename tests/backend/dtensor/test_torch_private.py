"""Every private torch name torchshard uses (torchshard._backend.dtensor._torch_private), through
DTensors with a ``_StridedShard`` placement: dispatch, a constraint and a read-back, on real
processes (2 and 4 gloo workers), against numpy indexing of the global value.

``_StridedShard`` is a ``Shard`` subclass up to torch 2.13 and a separate placement from 2.14
on; the DTensor backend must recognise it on both (on 2.14 it once returned wrong rows, or
failed, when it did not).
"""

from __future__ import annotations

import _dtensor_strided_cases as cases
import numpy as np
import pytest
import torch

from torchshard._backend.dtensor._torch_private import StridedShard, is_strided_shard

WORLD = {"1d": 2, "2x1": 2, "2x2": 4}


def test_is_strided_shard_by_type_on_this_torch():
    from torch.distributed.tensor import Partial, Replicate, Shard

    assert is_strided_shard(StridedShard(0, split_factor=2))
    assert not any(is_strided_shard(p) for p in (Shard(0), Replicate(), Partial()))


def test_the_numpy_oracle_of_the_layouts():
    # FSDP2 + TP on (2, 2): rank (i, j) holds quarter 2 j + i (docs of _StridedShard).
    assert [cases.rows_held("2x2", r) for r in range(4)] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert [cases.rows_held("1d", r) for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert cases.rows_held("2x1", 1) == [2, 3, 6, 7]


@pytest.mark.parametrize("layout", list(WORLD))
def test_strided_shard_dispatch_constrain_read_back(pools, layout):
    world = WORLD[layout]
    g = torch.as_tensor(cases.global_batch())
    results = pools(world).run("_dtensor_strided_cases:strided", layout=layout)
    grid = np.asarray(cases.LAYOUTS[layout][0])
    data = grid.shape[0]  # the "data" axis: P("data") splits the rows over it
    for rank, r in enumerate(results):
        assert r["input_placements"][0] == "_S(0,2)"
        assert r["held"] == cases.rows_held(layout, rank)
        assert torch.equal(r["full"], g), "torch reads the layout differently from the oracle"
        # Dispatch: logical row l is physical row PICK[l] (the wrong answer on a (2, 1)
        # mesh mixed zeros into them).
        assert r["dispatched_keys"] == ["x"]
        assert torch.equal(r["dispatched"], g[cases.PICK])
        assert r["dispatched"][:, 0].tolist() == [50, 20, 60, 0, 70, 30]
        # A constraint to P("data"): contiguous blocks over the data axis, same value.
        c = int(np.argwhere(grid == rank)[0][0])
        n = cases.PHYSICAL // data
        assert r["constrained"] == ["S(0)"] + ["R"] * (grid.ndim - 1)
        assert torch.equal(r["constrained_local"], g[c * n : (c + 1) * n])
        assert torch.equal(r["constrained_full"], g)
        # Read back: this rank's block of the rows split in mesh order (the strided split
        # moved to a plain one), never rows of another layout.
        rows = cases.PHYSICAL // grid.size
        assert torch.equal(r["back"], g[rank * rows : (rank + 1) * rows])
        assert r["input_untouched"]


def test_group_timeouts_use_torchs_public_call_where_it_has_one(monkeypatch):
    """``set_group_timeout``: torch's public ``set_timeout`` (2.14 on), else the private call it
    replaced (whose every call warns from 2.14 on: a FutureWarning pointing at torchshard)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from torchshard._backend.dtensor import _torch_private

    calls = []
    monkeypatch.setattr(dist, "set_timeout", lambda t, g: calls.append(("public", t, g)), False)
    monkeypatch.setattr(
        distributed_c10d, "_set_pg_timeout", lambda t, g: calls.append(("private", t, g))
    )
    _torch_private.set_group_timeout(7, "group")
    monkeypatch.delattr(dist, "set_timeout")
    _torch_private.set_group_timeout(8, "group")
    assert calls == [("public", 7, "group"), ("private", 8, "group")]


def test_setting_a_group_timeout_warns_nothing_on_this_torch(tmp_path):
    """On a real gloo group of one process, in a fresh interpreter (a default group in this one
    would change the default backend of later tests), with every warning an error."""
    import subprocess
    import sys

    code = (
        "import datetime, warnings\n"
        "warnings.simplefilter('error')\n"
        "import torch.distributed as dist\n"
        "from torchshard._backend.dtensor._torch_private import set_group_timeout\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rdv', rank=0, "
        "world_size=1)\n"
        "g = dist.new_group([0])\n"
        "set_group_timeout(datetime.timedelta(seconds=5), g)\n"
        "set_group_timeout(datetime.timedelta(seconds=5), None)\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    out = [line for line in run.stdout.splitlines() if not line.startswith("[Gloo]")]
    assert run.returncode == 0 and out == ["ok"], run.stdout + run.stderr
