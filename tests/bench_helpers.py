"""Fixtures of the bench tests, the wheel's (``tests/tools/bench/``) and the lab's
(``benchmarks/tests/``): quick mode, and measurements stubbed out (each method is called, so
that what it computes can be checked, but nothing is timed). Each conftest imports them."""

import pytest

from torchshard._tools.bench import _report


@pytest.fixture
def quick():
    """``--quick`` for the test's duration."""
    _report.configure(quick=True)
    yield
    _report.configure(quick=False)


@pytest.fixture
def stub_measure(monkeypatch):
    """Replaces ``measure``/``compare`` in the given bench modules: each method is called twice
    and gets the samples (1, 2, 3) ms; returns the calls made, per method name."""
    calls = {}

    def measure(methods, **_):
        for name, fn in methods.items():
            for _ in range(2):
                calls.setdefault(name, []).append(fn())
        return {name: _report.Timing((0.001, 0.002, 0.003), 1) for name in methods}

    def compare(methods, **kwargs):
        return {name: t.best for name, t in measure(methods, **kwargs).items()}

    def install(*modules):
        for module in modules:
            if hasattr(module, "measure"):
                monkeypatch.setattr(module, "measure", measure)
            if hasattr(module, "compare"):
                monkeypatch.setattr(module, "compare", compare)
        return calls

    return install
