"""The soak benchmark (benchmarks.soak): its probes (the process's RSS, the loader
threads alive) and a shortened run."""

import re
import sys
import threading

import pytest

from benchmarks import soak
from torchshard._tools.bench._report import Report
from torchshard.errors import MissingDependencyError


def test_rss_is_the_processes_resident_memory():
    psutil = pytest.importorskip("psutil")
    rss = soak._rss_mb()
    assert rss > 10
    assert abs(rss - psutil.Process().memory_info().rss / 2**20) < 64


def test_without_psutil_the_rss_probe_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(
        MissingDependencyError,
        match=re.escape(
            "bench soak needs psutil, which is not installed; install the optional extra with "
            "`pip install 'torchshard-input[test]'` (from a checkout: `pip install -e "
            "'.[test]'`), or `pip install psutil`."
        ),
    ):
        soak._rss_mb()


def test_loader_threads_are_found_by_name():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="torchshard-loader-probe")
    t.start()
    try:
        assert t in soak._loader_threads()
        assert all(x.name.startswith("torchshard-loader") for x in soak._loader_threads())
    finally:
        stop.set()
        t.join(10)
    assert t not in soak._loader_threads()


@pytest.mark.xla
def test_a_short_soak_records_its_figures(monkeypatch):
    pytest.importorskip("psutil")
    monkeypatch.setattr(soak, "BATCHES", 12)
    monkeypatch.setattr(soak, "EPOCH", 4)
    report = Report()
    soak.run(report)
    assert [f.method for f in report.figures] == [
        "RSS after warm-up",
        "RSS growth after warm-up",
        "loader threads left",
        "parked threads left after expiry",
        "threads added (all, after expiry)",
    ]
    assert report.figures[2].value == 0
    assert report.notes[-1].startswith("soak: RSS grew ")
