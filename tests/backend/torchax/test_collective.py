"""The torchax backend's exchanges (torchshard._backend.torchax.collective): the timeout's
environment variable, which JAX errors are transport failures, the address a process
publishes, and one process's verdicts (no session). Exchanges between real JAX processes are in
test_backend_multiprocess.py."""

from __future__ import annotations

import pytest
from torchax_env import jax8, needs_torchax

pytestmark = needs_torchax


@pytest.fixture(scope="module")
def collective():
    jax8()
    from torchshard._backend.torchax import collective

    return collective


def test_the_timeout_comes_from_the_environment(collective, monkeypatch):
    monkeypatch.delenv(collective.TIMEOUT_ENV, raising=False)
    assert collective.timeout() == 300.0
    monkeypatch.setenv(collective.TIMEOUT_ENV, "12.5")
    assert collective.timeout() == 12.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(collective.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=rf"TORCHSHARD_JAX_TIMEOUT='{bad}': expected"):
            collective.timeout()


def test_transport_errors_are_told_from_argument_errors(collective):
    class JaxRuntimeError(Exception):
        pass

    assert collective.is_comm_error(JaxRuntimeError("DEADLINE_EXCEEDED: barrier"))
    assert collective.is_comm_error(JaxRuntimeError("Gloo connection closed"))
    assert not collective.is_comm_error(JaxRuntimeError("INVALID_ARGUMENT: shapes"))
    assert not collective.is_comm_error(RuntimeError("DEADLINE_EXCEEDED"))


def test_the_published_address(collective, monkeypatch):
    monkeypatch.delenv(collective.HOST_ENV, raising=False)
    assert collective.local_address("127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    assert collective.local_address("localhost") == ("127.0.0.1", "127.0.0.1")
    monkeypatch.setenv(collective.HOST_ENV, "10.1.2.3")
    assert collective.local_address("127.0.0.1") == ("10.1.2.3", "0.0.0.0")


def test_one_process_has_no_session_and_agrees_with_itself(collective):
    assert collective.session() is None and collective.world() == 1
    v = collective.exchange("h2g", ["a", "b"], counts=[3])
    assert v.agreed and v.groups[0].items == ("h2g", "a", "b") and v.sums == (3,)
    assert collective.open_channel("loader") is None
    assert collective.replicas("check", {"0 ((0, 8),)": ("abc", 1)}) is None
    with collective.guarded("gather"):
        pass
