"""The host -> global benchmark (torchshard._tools.bench.h2g): its meshes and sizes, the three
methods it compares (each places the batch as torchshard does: checked against numpy slicing
of the batch), and its run wired to the report, with the timing stubbed."""

import pytest
import torch
from helpers import xla_shards

import torchshard as ts
from torchshard._tools.bench import BENCHES, h2g
from torchshard._tools.bench._report import Report

pytestmark = pytest.mark.xla


def test_registered_with_its_meshes_and_sizes(quick):
    assert BENCHES[h2g.NAME] == "torchshard._tools.bench.h2g"
    names = [(name, dict(mesh.shape)) for name, mesh in h2g.meshes()]
    assert names == [("(8,)", {"data": 8}), ("(4,2)", {"data": 4, "model": 2})]
    assert h2g.sizes(Report()) == (h2g.QUICK_ROWS, h2g.QUICK_COLS) == (64, 32)


def test_full_sizes_without_quick():
    assert h2g.sizes(Report()) == (1024, 2048)


@pytest.mark.parametrize("which", [0, 1])
def test_every_method_places_the_batch_over_every_axis(which):
    name, mesh = h2g.meshes()[which]
    batch = {
        f"x{i}": torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)
    }
    index = ts.NamedSharding(mesh, ts.P(mesh.axis_names)).devices_indices_map((16, 4))
    with mesh:
        methods = h2g.methods(mesh, batch)
        assert list(methods) == ["torchshard", "direct", "to+mark_sharding"]
        for method, fn in methods.items():
            out = fn()
            assert set(out) == set(batch), method
            for k, g in out.items():
                shards = xla_shards(g)
                assert sorted(shards) == list(range(8)), (name, method)
                for d, (_, data) in shards.items():
                    assert torch.equal(data, batch[k][index[d]]), (name, method, d)


def test_run_records_every_case_and_ratio(quick, stub_measure):
    calls = stub_measure(h2g)
    report = Report()
    h2g.run(report)
    cases = [f"{n}x[64,32] f32 {m}" for m in ("(8,)", "(4,2)") for n in (1, 8)]
    assert [(f.case, f.method) for f in report.figures] == [
        (c, m) for c in cases for m in ("torchshard", "direct", "to+mark_sharding")
    ]
    assert all(f.bench == "h2g" and f.unit == "GB/s" for f in report.figures)
    nbytes = 64 * 32 * 4
    assert report.figures[0].value == pytest.approx(nbytes / 0.001 / 1e9)
    assert [(r.case, r.denominator, r.target) for r in report.ratios] == [
        (c, d, t) for c in cases for d, t in (("direct", 0.95), ("to+mark_sharding", 1.5))
    ]
    assert len(calls["torchshard"]) == 2 * len(cases)
