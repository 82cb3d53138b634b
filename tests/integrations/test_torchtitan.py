"""torchtitan (torchshard.integrations.torchtitan), on gloo processes (2 ranks: dp 2; 4 ranks:
dp 2 x tp 2): ``dataloader(source, parallel_dims=...)`` is a torchtitan ``BaseDataLoader`` on
the data-loading mesh of ``ParallelDims``, yields local tensors equal to the stock per-rank
feed, keys its state by dp rank (as torchtitan's own loader) and resumes exactly, also through
torch.distributed.checkpoint on dp 2 x tp 2 (the tp peers share their dp rank's entry). Skips
without torchtitan. torchtitan main's grain loader (``grain_dataloader``, 2 gloo processes,
grain's own ``ElasticIterator`` the oracle): finite data ends every dp rank at the same step,
and its checkpoint in torchtitan main's layout resumes dp 2 -> dp 1 through
torch.distributed.checkpoint and dp 1 -> dp 2. Skips without grain."""

import importlib.util
import re

import _stacks_cases  # noqa: F401 -- the workers import it; here it must import too
import _torchtitan_grain_cases  # noqa: F401 -- as _stacks_cases
import numpy as np
import pytest

from torchshard._core.version import pip_install
from torchshard.integrations.torchtitan import (
    TorchshardGrainDataLoader,
    dataloader,
    dataloading_mesh,
)

HAS_TITAN = importlib.util.find_spec("torchtitan") is not None
needs_titan = pytest.mark.skipif(not HAS_TITAN, reason=f"needs torchtitan: {pip_install('stacks')}")
needs_grain = pytest.mark.skipif(
    importlib.util.find_spec("grain") is None, reason=f"needs grain: {pip_install('grain')}"
)


@needs_titan
@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
def test_the_loader_is_torchtitans_and_feeds_the_stock_rows(pools, tmp_path, world, tp):
    """On dp 2 x tp 2 the checkpoint keeps one value per dp rank, process 0's or 1's: the tp
    peer resumes from its peer's entry (it read the same examples)."""
    path = str(tmp_path / "dcp") if tp > 1 else None
    results = pools(world).run("_stacks_cases:torchtitan_loader", tp=tp, path=path)
    for rank, r in enumerate(results):
        dp_rank = rank // tp
        assert r["is_base"] and r["plain"] and r["equal_own"] and r["resumed_equal"], r
        # torchtitan 0.3.0's own dataloader tests read these (the stock loader's: 2, 0), and
        # warn, naming the key, on a state without this rank's (the rank starts afresh)
        assert r["attributes"] == (2, 0), r
        warning = (
            f"DataLoader state is empty for dp rank {dp_rank}, expected key dp_rank_{dp_rank} "
            f"(the state has ['dp_rank_{world // tp + 5}', 'world_size']); this rank starts "
            "from the beginning of its feed, as torchtitan's own loader does"
        )
        assert r["warned"] == [("WARNING", warning)], r
        assert r["afresh"], r
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


@needs_titan  # dataloader() reads torchtitan's loader before its arguments
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


# -- torchtitan main's grain loader (grain_dataloader): needs grain, not torchtitan ----------


@needs_grain
@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_gloo_finite_grain_pipeline_ends_every_dp_rank_together(pools, last_batch):
    """11 samples, global batch 4 on dp 2: grain's own ElasticIterator gives rank 0 three
    batches and rank 1 two (torchtitan main refuses repeat=False with dp > 1 for this: the
    ranks' collectives would hang). Through torchshard both ranks stop after the same step:
    "drop" after 2 (grain's own first two batches on each rank), "pad" after 3 with rank 1's
    third block masked."""
    results = pools(2).run("_torchtitan_grain_cases:finite", n=11, last_batch=last_batch)
    own = [r["own"] for r in results]
    assert own == [[[0, 2], [4, 6], [8, 10]], [[1, 3], [5, 7]]]  # uneven: the hang
    for rank, r in enumerate(results):
        assert r["kinds"] == [("Tensor", "Tensor")], r
        assert r["dp"] == (rank, 2, 2), r
    if last_batch == "drop":
        assert [r["got"] for r in results] == [o[:2] for o in own]
    else:
        assert results[0]["got"] == own[0]
        assert results[1]["got"][:2] == own[1] and len(results[1]["got"]) == 3
        # each rank's block of the mask (local views): rank 1's third block is padding
        assert results[0]["masks"] == [[True, True]] * 3
        assert results[1]["masks"] == [[True, True]] * 2 + [[False, False]]


@needs_grain
def test_gloo_grain_checkpoint_of_dp_2_resumes_on_dp_1_through_dcp(pools, tmp_path):
    """dp 2 reads 2 steps of 4 and saves with torch.distributed.checkpoint in torchtitan
    main's layout (version, dp_world_size, dp_rank_<r>); one process (dp 1) loads it with
    dcp.load (its keys are all in the checkpoint) and reads on from global index 8: each
    sample once, and what grain's own ElasticIterator reads from there on one shard. On the
    old code there is no grain_dataloader (ImportError), and torchtitan's own loader refuses:
    "cannot resume after changing the effective data-parallel degree"."""
    path = str(tmp_path / "dcp")
    saved = pools(2).run("_torchtitan_grain_cases:save", path=path, n=16, steps=2)
    for rank, r in enumerate(saved):
        assert r["keys"] == sorted([f"dp_rank_{rank}", "dp_world_size", "version"]), r
        assert r["state"]["dp_world_size"] == 2 and r["state"]["version"] == 1
    (loaded,) = pools(1).run("_torchtitan_grain_cases:resume", n=16, index=8, path=path)
    taken = [i for r in saved for b in r["taken"] for i in b]
    rest = [i for b in loaded["rest"] for i in b]
    assert loaded["rest"] == loaded["own"] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert sorted(taken + rest) == list(range(16))


@needs_grain
def test_gloo_grain_state_of_dp_1_resumes_on_dp_2_where_rank_1_has_no_key(pools, tmp_path):
    """Saved on one process (keys dp_rank_0 only), loaded on dp 2: rank 1's key is missing and
    it reads the job's position from rank 0's entry (torchtitan main raises "checkpoint is
    missing dataloader state for dp_rank_1"); both read on as grain's own from index 4."""
    (saved,) = pools(1).run("_torchtitan_grain_cases:save", path=str(tmp_path / "d"), n=12, steps=1)
    assert saved["keys"] == ["dp_rank_0", "dp_world_size", "version"]
    loaded = pools(2).run("_torchtitan_grain_cases:resume", n=12, index=4, state=saved["state"])
    for r in loaded:
        assert r["rest"] == r["own"] and r["rest"], r
    rest = [i for r in loaded for b in r["rest"] for i in b]
    assert sorted(saved["taken"][0] + rest) == list(range(12))


def test_a_dp_rank_the_checkpoint_never_saved_is_refused_not_restarted():
    """dcp.load onto more dp ranks than saved keeps a new rank's key as it was (its fresh
    state): that rank would read its data from the start again, silently; it is refused, and
    a state that also holds a saved rank's entry resumes from that one."""
    never_used = object()  # the refusal comes before the loader is read
    loader = TorchshardGrainDataLoader(never_used, 1, 2, 4)  # type: ignore[arg-type]
    fresh = {"version": 1, "dp_world_size": 1, "dp_rank_1": b"fresh"}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "TorchshardGrainDataLoader.load_state_dict: the state was saved on 1 dp rank(s), so "
            "its 'dp_rank_1' is not from the checkpoint"
        ),
    ):
        loader.load_state_dict(fresh)
