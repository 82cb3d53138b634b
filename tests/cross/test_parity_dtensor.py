"""Parity with axlearn and JAX on the DTensor backend, which shares the engine: the same
behaviour on real gloo processes (``global_shape=``, already-global leaves, read-back outside a
mesh, complex64). The torch_xla cases are in test_parity.py."""

import torch


def test_dtensor_parity(pools):
    for rank, r in enumerate(pools(4).run("parity")):
        assert torch.equal(r["wide_local"], r["expected_local"]), rank
        assert torch.equal(r["whole_local"], r["expected_local"]), rank
        assert r["same"] is True
        assert r["other"].startswith(
            "ShardingError: host_arrays: already a global tensor, but not laid out as "
            "P('model',) on Mesh({'data': 2, 'model': 2}) asks; found per device (global "
            f"[start, stop) per dimension) {rank}: "
        )
        assert r["bad"] == (
            "ShardingError: host_arrays: dim 0 of the host block has size 1, but with "
            "global_shape (4, 8) a host passes along it either the whole dimension, 4 (each "
            "host then takes the slices its devices need), or its own part, 2 (1 distinct "
            "shard(s) of 2 on its devices), under P('data', 'model') on mesh {'data': 2, "
            "'model': 2}. Pass a block of one of those sizes, or fix global_shape."
        )
        assert r["disagree"].startswith("ProcessDisagreementError: "), r["disagree"]
        assert "global_shape (4, 8)" in r["disagree"]
        row = r["row"]
        assert torch.equal(r["outside_back"], r["expected_local"])  # one device per process
        assert torch.equal(r["outside_full"], r["g"])
        assert torch.equal(r["complex_back"], r["c"][2 * row : 2 * row + 2])
        assert torch.equal(r["complex_full"], r["c"])
