"""The torchax host -> global benchmark (torchshard._tools.bench.torchax_h2g): its meshes on
JAX's devices, the three methods it compares (each checked shard for shard against numpy
slicing of the batch), and its run wired to the report, with the timing stubbed."""

import numpy as np
import pytest
import torch
from torchax_env import jax8, needs_torchax

from torchshard._tools.bench import BENCHES, NEEDS_NO_XLA, NEEDS_TORCHAX, torchax_h2g
from torchshard._tools.bench._report import Report

pytestmark = needs_torchax


@pytest.fixture(scope="module")
def jax():
    return jax8()


def test_registered_with_its_meshes(jax):
    assert BENCHES["torchax"] == "torchshard._tools.bench.torchax_h2g"
    assert "torchax" in NEEDS_TORCHAX and "torchax" in NEEDS_NO_XLA
    names = [(name, dict(mesh.shape), mesh.backend) for name, mesh in torchax_h2g.meshes()]
    assert names == [
        ("(8,)", {"data": 8}, "torchax"),
        ("(4,2)", {"data": 4, "model": 2}, "torchax"),
    ]


@pytest.mark.parametrize("which", [0, 1])
def test_every_method_places_the_batch_over_every_axis(jax, which):
    _, mesh = torchax_h2g.meshes()[which]
    batch = {
        f"x{i}": torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)
    }
    order = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    with mesh:
        methods = torchax_h2g.methods(mesh, batch)
        assert list(methods) == [
            "torchshard",
            "make_array_from_process_local_data",
            "device_put(whole)",
        ]
        for method, fn in methods.items():
            out = fn()
            assert set(out) == set(batch), method
            for k, g in out.items():
                array = g.jax() if method == "torchshard" else g
                assert array.sharding.spec == jax.sharding.PartitionSpec(mesh.axis_names)
                for s in array.addressable_shards:
                    assert order.index(s.device) in range(8)
                    np.testing.assert_array_equal(np.asarray(s.data), batch[k].numpy()[s.index])


def test_run_records_every_case_and_ratio(jax, quick, stub_measure):
    stub_measure(torchax_h2g)
    report = Report()
    torchax_h2g.run(report)
    cases = [f"{n}x[64,32] f32 {m}" for m in ("(8,)", "(4,2)") for n in (1, 8)]
    methods = ("torchshard", "make_array_from_process_local_data", "device_put(whole)")
    assert [(f.case, f.method) for f in report.figures] == [(c, m) for c in cases for m in methods]
    assert all(f.bench == "torchax" and f.unit == "GB/s" for f in report.figures)
    assert [(r.case, r.denominator, r.target) for r in report.ratios] == [
        (c, d, t)
        for c in cases
        for d, t in (("make_array_from_process_local_data", 0.95), ("device_put(whole)", None))
    ]
    assert "jax 0.10" in report.notes[-1] or "jax " in report.notes[-1]
