"""Bounded, named cross-process steps of the DTensor backend, over torchshard's exchange tree
(``_backend/exchange/``): the agreement exchange, a loader epoch's outcome exchanges, the value
check, and the error that names the call and the ranks.

One ``Session`` per default process group, made when torchshard first needs one (the first
mesh entry: building a ``DeviceMesh`` is a collective every process makes). It is bootstrapped
through the default group's store: this process's address (one ``set``), its parent's (one
``get``), the tree's shape from rank 0 (one ``get``). After that the store is never used: the
exchanges go through the tree's own connections (one per process opened, to its parent), so
rank 0's store server, a single thread, is off every step's path (at 512 processes the store
exchange cost 45.6 ms per exchange, 4N + 1 requests through that thread; the tree's cost grows
as its depth: docs/design.md).

The torch collectives torchshard issues (a read-back gather, a dispatch or constraint
collective) are ``guarded``: the call is recorded locally (no message), and a transport failure
becomes a ``CollectiveError`` naming the ranks that are not in the call (a survey through the
tree). Every wait is bounded by the default group's timeout (``init_process_group(timeout=
...)``); the ``DeviceMesh`` groups torchshard builds get it too (torch's ``new_group`` would
give them 30 minutes).

The address a process publishes is the one its traffic to the store's host leaves from
(``TORCHSHARD_EXCHANGE_HOST`` overrides it, e.g. another network interface); the tree groups
the processes of a host by torchrun's ``LOCAL_WORLD_SIZE`` (rank 0's, for every process).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchshard._backend.dtensor._torch_private import default_store, set_group_timeout
from torchshard._backend.exchange.session import Session
from torchshard._core.agreement import on_switch
from torchshard._core.verdict import Verdict

PREFIX = "torchshard/"
HOST_ENV = "TORCHSHARD_EXCHANGE_HOST"


def is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` comes from torch.distributed's transport (a timeout, a lost peer)
    rather than from the arguments of the collective."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("/gloo/", "Connection closed", "Connection reset", "Timed out", "NCCL")
    )


def _store_host(store: Any) -> str | None:
    """The host of the default group's TCPStore (``None`` for another store)."""
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return os.environ.get("MASTER_ADDR")


def local_address(peer: str | None) -> tuple[str, str]:
    """``(address the others reach this process at, address to listen on)``: the interface
    this process's traffic to ``peer`` (the store's host) leaves from; loopback when the store
    is on loopback (the job runs on one machine). Without a known peer (a FileStore and no
    MASTER_ADDR), the interface of the default route, listening on every interface."""
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


def _local_size(world: int) -> int:
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1
    return n if n >= 1 and world % n == 0 else 1


def _make_session() -> Session:
    store = default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = store.timeout.total_seconds()
    # Keys of an earlier default group on the same store (torchrun's agent store outlives
    # init_process_group) must not be read as this one's: every process counts itself in.
    generation = (store.add(PREFIX + "generation", 1) - 1) // world
    prefix = f"{PREFIX}{generation}/"
    host, bind = local_address(_store_host(store))
    local = threading.local()

    def client() -> Any:  # a client per thread: a waiting get holds its connection
        c = getattr(local, "store", None)
        if c is None:
            c = local.store = store.clone()
        return c

    def kv_set(key: str, value: str) -> None:
        client().set(prefix + key, value)

    def kv_get(key: str, wait: float) -> str:
        c = client()
        c.wait([prefix + key], timedelta(seconds=wait))
        return c.get(prefix + key).decode()

    return Session(
        rank,
        world,
        timeout=timeout,
        kv_set=kv_set,
        kv_get=kv_get,
        host=host,
        bind=bind,
        local_size=_local_size(world),
        tag=prefix,
    )


class _Current:
    """The session of the current default group, held with the group weakly: torchshard must
    not keep a destroyed group, or rank 0's TCPStore server, alive."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.group: Any = None  # weakref to the group
        self.session: Session | None = None

    def get(self) -> Session | None:
        world = dist.GroupMember.WORLD
        s, g = self.session, self.group
        if s is not None and g is not None and g() is world:
            return s
        if world is None or dist.get_world_size() == 1:
            return None
        with self.lock:
            if self.session is not None and self.group is not None and self.group() is world:
                return self.session
            if self.session is not None:  # an earlier group's: its tree goes with it
                self.session.close()
            self.session = _make_session()
            self.group = weakref.ref(world)
            return self.session


_CURRENT = _Current()


def session() -> Session | None:
    """The exchange session of the current default group (``None`` on one process)."""
    return _CURRENT.get()


def _switched(name: str, value: Any) -> None:
    s = _CURRENT.session
    if s is not None and _CURRENT.group is not None and _CURRENT.group() is not None:
        with contextlib.suppress(OSError):
            s.switched(name, value)


on_switch(_switched)


def existing(*, destroyed: bool = False) -> Session | None:
    """The current default group's session if one was made (never makes one: a process that
    made no torchshard collective has nothing to judge). ``destroyed``: also the last group's
    after ``destroy_process_group`` (its tree is torchshard's own: still up)."""
    s, g = _CURRENT.session, _CURRENT.group
    if s is None or g is None:
        return None
    world = dist.GroupMember.WORLD
    alive = world is not None and g() is world
    return s if alive or (destroyed and world is None) else None


def begin(
    what: str,
    items: Sequence[str],
    channel: str | None = None,
    counts: Sequence[int] = (),
    *,
    eager: bool = False,
) -> Callable[[], Verdict]:
    """The exchange of ``[what, *items]`` (and ``counts``) in two halves, so that work that runs
    no collective (DTensor's ``from_local``) overlaps the wait for the other processes:
    ``begin`` returns the end, the ``Verdict``. ``eager``: ``Session.begin``'s (the end may
    come late)."""
    s = session()
    if s is None:
        mine = [what, *items]
        return lambda: Verdict.alone(mine, counts)
    return s.begin(what, items, channel, counts, eager=eager)


def exchange(
    what: str, items: Sequence[str], channel: str | None = None, counts: Sequence[int] = ()
) -> Verdict:
    """Every process's ``[what, *items]`` compared and ``counts`` reduced, on ``channel``
    (default: the caller's stream). Raises ``CollectiveError`` naming the ranks that did not
    answer in time, or the rank whose epoch ended (a loader's channel)."""
    return begin(what, items, channel, counts)()


def open_channel(what: str) -> tuple[str, Verdict] | None:
    """``Session.open_channel`` (``None`` on one process); call it in program order."""
    s = session()
    return None if s is None else s.open_channel(what)


def close_channel(channel: str, *, finished: bool, taken: int) -> None:
    """Ends a named channel (``Session.close_channel``)."""
    s = session()
    if s is not None:
        s.close_channel(channel, finished=finished, taken=taken)


def replicas(what: str, blocks: dict[str, tuple[str, int]]) -> list[tuple[str, Any]] | None:
    """The value check's exchange (``Session.replicas``; ``None`` on one process)."""
    s = session()
    return None if s is None else s.replicas(what, blocks)


@contextlib.contextmanager
def guarded(what: str) -> Iterator[None]:
    """Records this process's arrival at collective ``what``; a transport failure inside
    becomes a ``CollectiveError`` naming ``what`` and the ranks that did not answer."""
    s = session()
    if s is None:
        yield
        return
    with s.guarded(what, is_comm_error):
        yield


def bound_timeouts(groups: Sequence[Any]) -> None:
    """Gives each of ``groups`` (a ``DeviceMesh``'s, other than the default group) the default
    group's timeout, which torch's ``new_group`` does not inherit."""
    s = session()
    if s is None:
        return
    world = dist.GroupMember.WORLD
    for g in groups:
        if g is not None and g is not world:
            set_group_timeout(timedelta(seconds=s.timeout), g)
