"""Bounded, named cross-process steps of the torchax backend, over torchshard's exchange tree
(``_backend/exchange/``): the agreement exchange, a loader epoch's outcome exchanges, the value
check, and the error that names the call and the processes.

One ``Session`` per JAX job (``jax.distributed.initialize``), made when torchshard first needs
one (the first mesh entry). It is bootstrapped through JAX's coordination service, the job's
key-value store (``key_value_set`` / ``blocking_key_value_get``): this process's address (one
``set``), its parent's (one ``get``), the tree's shape from process 0 (one ``get``). After that
the store is never used: exchanges go through the tree's own TCP connections, and never through
a JAX computation, so a loader's thread runs them under ``jax.thread_guard`` (which refuses
multi-process JAX operations from other threads than the guarded one).

**The timeout.** Every wait is bounded by ``TORCHSHARD_JAX_TIMEOUT`` seconds (the environment
variable, read when the session is made; default 300, JAX's own ``initialization_timeout``).

JAX computations torchshard runs across processes (``replicate_to_local_data``'s gather) are
``guarded``: the call is recorded locally, and a transport failure becomes a
``CollectiveError`` naming the processes that are not in it (a survey through the tree).

The address a process publishes is the one its traffic to the coordinator's host leaves from
(``TORCHSHARD_EXCHANGE_HOST`` overrides it). JAX does not say which processes share a host, so
each process is a host of its own in the tree (an 8-ary tree of the processes).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torchshard._backend.exchange.session import Session
from torchshard._backend.torchax._jax_private import coordination_client
from torchshard._backend.torchax.runtime import jax
from torchshard._core.agreement import on_switch
from torchshard._core.verdict import Verdict

PREFIX = "torchshard/"
HOST_ENV = "TORCHSHARD_EXCHANGE_HOST"
TIMEOUT_ENV = "TORCHSHARD_JAX_TIMEOUT"
DEFAULT_TIMEOUT = 300.0  # seconds: jax.distributed.initialize's own initialization_timeout


def timeout() -> float:
    """The bound on every wait between the processes, in seconds (``TORCHSHARD_JAX_TIMEOUT``)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"environment variable {TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0 "
            f"(the bound on torchshard's waits between JAX processes; default "
            f"{DEFAULT_TIMEOUT:g}), e.g. {TIMEOUT_ENV}=120."
        )
    return value


def is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` comes from JAX's transport between processes (a timeout, a lost peer)
    rather than from the arguments of the computation."""
    text = str(error)
    return type(error).__name__ == "JaxRuntimeError" and any(
        s in text
        for s in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "Gloo", "gloo", "Connection", "timed out")
    )


def _coordinator_host() -> str | None:
    from jax._src import distributed  # the address jax.distributed.initialize was given

    address = getattr(distributed.global_state, "coordinator_address", None)
    if not address:
        return None
    host = address.rsplit(":", 1)[0]
    return host.strip("[]") or None


def local_address(peer: str | None) -> tuple[str, str]:
    """``(address the others reach this process at, address to listen on)``: the interface this
    process's traffic to ``peer`` (the coordinator's host) leaves from; loopback when the
    coordinator is on loopback (the job runs on one machine)."""
    forced = os.environ.get(HOST_ENV)
    if forced:
        return forced, "0.0.0.0"
    if peer in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1", "127.0.0.1"
    if not peer:
        peer = "192.0.2.1"  # TEST-NET-1: a route is chosen, no packet is sent
    try:
        family, kind, _, _, where = socket.getaddrinfo(peer, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(where)  # no packet: only the route is chosen
            mine = s.getsockname()[0]
    except OSError:  # no route: one machine
        return "127.0.0.1", "0.0.0.0"
    if mine.startswith("127."):
        return "127.0.0.1", "127.0.0.1"
    return mine, "::" if ":" in mine else "0.0.0.0"


def _make_session() -> Session:
    j = jax()
    client = coordination_client()
    rank, world = int(j.process_index()), int(j.process_count())
    bound = timeout()
    # Keys of an earlier session on the same coordination service (a Session closed and made
    # again) must not be read as this one's: every process counts itself in.
    generation = (int(client.key_value_increment(PREFIX + "generation", 1)) - 1) // world
    prefix = f"{PREFIX}{generation}/"
    host, bind = local_address(_coordinator_host())

    def kv_set(key: str, value: str) -> None:
        client.key_value_set(prefix + key, value)

    def kv_get(key: str, wait: float) -> str:
        return str(client.blocking_key_value_get(prefix + key, max(1, int(wait * 1000))))

    return Session(
        rank,
        world,
        timeout=bound,
        kv_set=kv_set,
        kv_get=kv_get,
        host=host,
        bind=bind,
        local_size=1,
        tag=prefix,
    )


class _Current:
    """The session of the JAX job (``None`` on one process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.session: Session | None = None
        self.client: Any = None  # the coordination client the session was made through

    def get(self) -> Session | None:
        s = self.session
        if s is not None and coordination_client() is self.client:
            return s
        if int(jax().process_count()) == 1 or coordination_client() is None:
            return None
        with self.lock:
            client = coordination_client()
            if self.session is not None and client is self.client:
                return self.session
            if self.session is not None:  # an earlier job's (shut down and initialised again)
                self.session.close()
            self.session = _make_session()
            self.client = client
            return self.session


_CURRENT = _Current()


def session() -> Session | None:
    """The exchange session of the JAX job (``None`` on one process)."""
    return _CURRENT.get()


def world() -> int:
    return int(jax().process_count())


def _switched(name: str, value: Any) -> None:
    s = _CURRENT.session
    if s is not None:
        with contextlib.suppress(OSError):
            s.switched(name, value)


on_switch(_switched)


def begin(
    what: str, items: Sequence[str], channel: str | None = None, counts: Sequence[int] = ()
) -> Callable[[], Verdict]:
    """The exchange of ``[what, *items]`` (and ``counts``) in two halves; ``begin`` returns the
    end, the ``Verdict``."""
    s = session()
    if s is None:
        mine = [what, *items]
        return lambda: Verdict.alone(mine, counts)
    return s.begin(what, items, channel, counts)


def exchange(
    what: str, items: Sequence[str], channel: str | None = None, counts: Sequence[int] = ()
) -> Verdict:
    """Every process's ``[what, *items]`` compared and ``counts`` reduced, on ``channel``."""
    return begin(what, items, channel, counts)()


def open_channel(what: str) -> tuple[str, Verdict] | None:
    s = session()
    return None if s is None else s.open_channel(what)


def close_channel(channel: str, *, finished: bool, taken: int) -> None:
    s = session()
    if s is not None:
        s.close_channel(channel, finished=finished, taken=taken)


def replicas(what: str, blocks: dict[str, tuple[str, int]]) -> list[tuple[str, Any]] | None:
    """The value check's exchange (``Session.replicas``; ``None`` on one process)."""
    s = session()
    return None if s is None else s.replicas(what, blocks)


@contextlib.contextmanager
def guarded(what: str) -> Iterator[None]:
    """Records this process's arrival at the JAX computation ``what``; a transport failure
    inside becomes a ``CollectiveError`` naming ``what`` and the processes that did not
    answer."""
    s = session()
    if s is None:
        yield
        return
    with s.guarded(what, is_comm_error):
        yield
