"""torchtitan (torchshard.integrations.torchtitan), on gloo processes (2 ranks: dp 2; 4 ranks:
dp 2 x tp 2): ``dataloader(source, parallel_dims=...)`` is a torchtitan ``BaseDataLoader`` on
the data-loading mesh of ``ParallelDims``, yields local tensors equal to the stock per-rank
feed, keys its state by dp rank (as torchtitan's own loader) and resumes exactly, also through
torch.distributed.checkpoint on dp 2 x tp 2 (the tp peers share their dp rank's entry). Skips
without torchtitan."""

import importlib.util
import re

import _stacks_cases  # noqa: F401 -- the workers import it; here it must import too
import numpy as np
import pytest

from torchshard._core.version import pip_install

pytest.importorskip(
    "torchtitan.components.dataloader", reason=f"needs torchtitan: {pip_install('stacks')}"
)
from torchshard.integrations.torchtitan import dataloader, dataloading_mesh


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
def test_the_loader_is_torchtitans_and_feeds_the_stock_rows(pools, tmp_path, world, tp):
    """On dp 2 x tp 2 the checkpoint keeps one value per dp rank, process 0's or 1's: the tp
    peer resumes from its peer's entry (it read the same examples)."""
    path = str(tmp_path / "dcp") if tp > 1 else None
    results = pools(world).run("_stacks_cases:torchtitan_loader", tp=tp, path=path)
    for rank, r in enumerate(results):
        dp_rank = rank // tp
        assert r["is_base"] and r["plain"] and r["equal_own"] and r["resumed_equal"], r
        assert r["through_dcp"] is (True if path else None), r
        assert r["dp"] == r["expected_dp"] == (dp_rank, world // tp)
        assert r["state_keys"] == [f"dp_rank_{dp_rank}", "world_size"]
        assert r["mesh"] == {"pp": 1, "batch": world // tp, "cp": 1, "tp": tp}
        # torchtitan's own ParallelDims where it imports (it needs spmd_types==0.2.3; CI job 2
        # installs it), else a stand-in with its fields.
        real = importlib.util.find_spec("spmd_types") is not None
        assert r["parallel_dims"] == ("ParallelDims" if real else "SimpleNamespace"), r


class Dims:
    pp, dp_replicate, dp_shard, cp, tp, world_size = 1, 2, 2, 1, 2, 8


def test_the_dataloading_mesh_is_torchtitans_layout():
    mesh = dataloading_mesh(Dims())
    assert mesh.axis_names == ("pp", "batch", "cp", "tp")
    assert np.array_equal(mesh.devices, np.arange(8).reshape(1, 4, 1, 2))


def test_arguments():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "torchtitan.dataloader: pass exactly one of parallel_dims (torchtitan's "
            "ParallelDims: its data-loading mesh) and mesh (a torchshard.Mesh), but got neither."
        ),
    ):
        dataloader([])
    with pytest.raises(TypeError, match=re.escape("parallel_dims: expected torchtitan's")):
        dataloading_mesh(object())

    class Unresolved(Dims):
        dp_shard = -1

    with pytest.raises(ValueError, match=re.escape("is not world_size 8; call parallel_dims")):
        dataloading_mesh(Unresolved())
