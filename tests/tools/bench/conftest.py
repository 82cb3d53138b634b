"""Fixtures of the bench tests: quick mode, and measurements stubbed out (``bench_helpers``,
shared with the lab's tests in ``benchmarks/tests/``)."""

from bench_helpers import quick, stub_measure

__all__ = ["quick", "stub_measure"]
