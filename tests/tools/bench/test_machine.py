"""The machine a bench ran on (torchshard._tools.bench._machine): cores, CPU model, RAM and the
versions, as the JSON records them."""

import os
import platform
from importlib import metadata

from torchshard._tools.bench import _machine


def test_machine_info():
    info = _machine.machine_info()
    assert set(info) == {
        "nproc",
        "cpu_model",
        "ram_gib",
        "platform",
        "python",
        "torch",
        "torch_xla",
    }
    assert info["nproc"] == len(os.sched_getaffinity(0))
    assert info["python"] == platform.python_version()
    assert info["torch"] == metadata.version("torch")
    assert isinstance(info["ram_gib"], float) and info["ram_gib"] > 0
    assert info["cpu_model"] is None or isinstance(info["cpu_model"], str)


def test_versions_of_missing_distributions_are_none():
    assert _machine._version("torchshard-no-such-distribution") is None
    assert _machine._version("numpy") == metadata.version("numpy")


def test_cpu_model_and_ram_read_proc(monkeypatch, tmp_path):
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU @ 3.00GHz\n")
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\n")
    real = open

    def fake_open(path, *args, **kwargs):
        path = {"/proc/cpuinfo": cpuinfo, "/proc/meminfo": meminfo}.get(path, path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert _machine._cpu_model() == "Test CPU @ 3.00GHz"
    assert _machine._ram_gib() == 16.0
