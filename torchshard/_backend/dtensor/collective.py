"""Bounded, named cross-process steps of the DTensor backend: the agreement exchange over the
default group's store, arrival records, and the error that names the call and the ranks.

Every process records, before each collective torchshard issues (the agreement exchange, a
loader batch's outcome exchange, a read-back gather, a dispatch or constraint collective), its
arrival in the default process group's store: one key per rank, ``at/<rank>``, holding the
call's sequence number and name (a ``set``, which TCPStore does not acknowledge: a few
microseconds, nothing waits). When a collective times out or loses a peer, each process reads
the others' keys, so the error names torchshard's call, the batch (a loader's call names it)
and the ranks that did not answer, with the last call each of them entered.

The agreement exchange itself runs over the store, not over a process group: each process
``compare_set``s its call's 8-byte digest against the first one written for that call, ``add``s
itself to the call's arrival count (adding a large constant when its digest differed), and the
last to arrive writes the verdict that the others ``get`` (one ``multi_set`` with the reset of
a later slot, applied in order). That is three round trips to the
store and no helper thread (a gloo all-gather is ~0.6 ms on loopback, most of it the wake-up of
gloo's worker thread), and it waits at most the store's timeout, which
``init_process_group(timeout=...)`` sets. Only when digests differ are the descriptions
themselves written and read. The digest and count keys live in a ring of four slots per
thread, each reset by the last arrival of the exchange two before its next use (unacknowledged
``set``s); only the verdict key is per call, deleted by the last arrival of the exchange two
after it, so the store does not grow. Two, not one: a thread may begin its next exchange
before it ends the current one (at most one outstanding, as a loader's thread does to keep the
other processes' pace off its own: ``begin``), so when the last process arrives at exchange
``x`` every process has ended ``x - 2``, but not necessarily ``x - 1``.

The store is the default group's: a TCPStore under torchrun (``env://``) or ``tcp://``, whose
waiting ``get`` returns as soon as the key is set. A FileStore (``init_method="file://..."``)
answers a waiting ``get`` by polling the file every 10 ms, so every exchange that has to wait
for another process waits 10 ms or more (the DTensor demo on a FileStore: ~10 ms per batch,
9.9 % input wait with the check on; on a TCPStore the same wait is 0.2 ms).

A channel is a sequence of exchanges that every process makes in the same order: by default the
calling thread's (its name: ``MainThread`` is the program's), or a named one. A loader's epoch
gets a channel of its own (``open_channel``: named by an exchange in program order, alike on
every process),
so that its background thread exchanges each batch's outcome one batch ahead of the consumer
(the store exchange is not a process-group collective: any thread may run it). When an epoch
ends early (``close_channel``), the process writes the verdict of the channel's next exchange as
"ended by rank r", so that a process still waiting in it (or reaching it later) raises at
once instead of after the timeout; an epoch that ran to its end deletes its keys.

The collectives of the ``DeviceMesh``es torchshard builds run on groups whose timeout is set to
the default group's (torch's ``new_group`` would give them 30 minutes).

After a timeout the processes are out of step (some left a call the others are still in): the
error says so; end the run, as after any timed-out torch collective.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchshard._backend.dtensor._torch_private import default_store, set_group_timeout
from torchshard._core.agreement import digest
from torchshard._core.errors import CollectiveError

PREFIX = "torchshard/"
_BAD = 1 << 32  # added to a call's arrival count by a process whose digest differed
_ENDED = "ended"  # the verdict of a channel's exchange that another process's early end wrote
_SLOTS = 4  # the digest and count keys of a thread's calls are reused in a ring of this size
GRACE = 2.0  # seconds a process whose collective failed waits for the others to report


def is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` comes from torch.distributed's transport (a timeout, a lost peer)
    rather than from the arguments of the collective."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("/gloo/", "Connection closed", "Connection reset", "Timed out", "NCCL")
    )


class _Session:
    """torchshard's collective state on one default process group."""

    @property
    def group(self) -> Any:
        """The default group this session is of (``None`` once it is destroyed)."""
        return self._group()

    def __init__(self, world: Any) -> None:
        # Weakly, and the default store is not kept either (threads clone it when first used):
        # torchshard must not keep a destroyed group, or rank 0's TCPStore server, alive. (Even
        # so, a new group on the *same* port can time out in gloo's connect in plain torch too,
        # about one run in four, on the stale keys of the server torch keeps; use a new port.)
        self._group = weakref.ref(world)
        store = default_store()
        self.local = threading.local()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout = store.timeout.total_seconds()
        # Keys of an earlier default group on the same store (torchrun's agent store outlives
        # init_process_group) must not be read as this one's: every process counts itself in.
        generation = (store.add(PREFIX + "generation", 1) - 1) // self.world
        self.prefix = f"{PREFIX}{generation}/"
        self.seq: dict[str, int] = {}  # per channel (calling thread's name): calls entered
        self.exchanges: dict[str, int] = {}  # per channel: exchanges begun (the slot ring's)
        # per channel: the call numbers of the last two exchanges (the older one's keys are the
        # next exchange's to delete)
        self.previous: dict[str, tuple[int, int]] = {}
        self.bad: set[str] = set()  # calls whose digests differed (their descriptions to delete)
        self.lock = threading.Lock()

    @property
    def store(self) -> Any:
        """This thread's client of the default store (a client is one connection, and a
        waiting ``get`` holds it: a loader thread and the main thread must not share one)."""
        store = getattr(self.local, "store", None)
        if store is None:
            store = self.local.store = default_store().clone()
        return store

    def enter(self, what: str, channel: str | None = None) -> tuple[str, int]:
        """Records this process's arrival at the next call of ``channel`` (default: the calling
        thread's)."""
        if channel is None:
            channel = threading.current_thread().name
        with self.lock:
            n = self.seq[channel] = self.seq.get(channel, 0) + 1
        self.store.set(f"{self.prefix}at/{channel}/{self.rank}", f"{n}\t{what}")
        return channel, n

    def begin(
        self, what: str, items: Sequence[str], channel: str | None = None
    ) -> Callable[[], list[list[str]] | None]:
        """Starts the exchange of ``[what, *items]`` (two short round trips, no waiting) and
        returns its end: every process's ``[what, *items]`` when they differ, ``None`` when
        they agree. The end must be called (on every process, on the thread that began it),
        also when the caller's own work in between failed. A thread may begin the channel's next
        exchange before ending this one, but not a third before ending this one: the ends are
        called in order, at most one exchange outstanding."""
        store, world = self.store, self.world
        channel, n = self.enter(what, channel)
        key = f"{self.prefix}{channel}/{n}/"
        x = self.exchanges[channel] = self.exchanges.get(channel, 0) + 1
        last_two = self.previous.get(channel, (0, 0))
        prev, self.previous[channel] = last_two[0], (last_two[1], n)
        slot = f"{self.prefix}{channel}/slot{x % _SLOTS}/"
        mine = [what, *items]
        code = str(digest(mine))
        try:
            differs = store.compare_set(slot + "d", "", code).decode() != code
            count = store.add(slot + "n", _BAD + 1 if differs else 1)
            last = count % _BAD == world
            if last:
                # Reset the slot of the exchange after next (every process began this one, so
                # ended the one before the last: that slot's last use is over), then the
                # verdict: a process begins the exchange after next only after reading this
                # verdict, and the store applies one connection's requests in order. Neither
                # waits.
                nxt = f"{self.prefix}{channel}/slot{(x + 2) % _SLOTS}/"
                verdict = "bad" if count >= _BAD else "ok"
                store.multi_set([nxt + "d", nxt + "n", key + "done"], ["", "0", verdict])
        except Exception as e:
            if is_comm_error(e):
                raise self.failed(channel, n, what, e) from None
            raise

        def end() -> list[list[str]] | None:
            try:
                if last:
                    verdict = "bad" if count >= _BAD else "ok"
                    self._forget(f"{self.prefix}{channel}/{prev}/")
                else:
                    verdict = store.get(key + "done").decode()
                if verdict == "ok":
                    return None
                if not verdict.startswith(_ENDED):
                    self.bad.add(key)
                    store.set(f"{key}desc/{self.rank}", json.dumps(mine))
                    blobs = [store.get(f"{key}desc/{q}") for q in range(world)]
            except Exception as e:
                if is_comm_error(e):
                    raise self.failed(channel, n, what, e) from None
                raise
            if verdict.startswith(_ENDED):
                raise self.ended(what, verdict)
            return [json.loads(b) for b in blobs]

        return end

    def _forget(self, key: str) -> None:
        """Deletes a call's keys (every process has ended it: each began the exchange after
        next)."""
        if key.endswith("/0/"):
            return
        self.store.delete_key(key + "done")
        if key in self.bad:
            self.bad.discard(key)
            for q in range(self.world):
                self.store.delete_key(f"{key}desc/{q}")

    def ended(self, what: str, verdict: str) -> CollectiveError:
        """The error of an exchange whose verdict another process wrote when its epoch ended
        early (``close_channel``): ``"ended <rank> <batches taken>"``."""
        _, rank, taken = verdict.split()
        return CollectiveError(
            f"{what}: rank {rank} ended this GlobalBatchLoader epoch after taking {taken} "
            "batch(es) (it left the loop, closed the loader or started another iter()), so it "
            "makes no more of its batches. Every process must take the same batches of an "
            "epoch: stop every process's loop at the same batch (e.g. the same number of "
            "steps), or give every process a source of the same length."
        )

    def open_channel(self, what: str) -> tuple[str, list[list[str]] | None]:
        """An exchange of ``what`` on the calling thread's channel, and the name of a new channel
        made by it: ``<thread>.loader<n>``, ``n`` that exchange's call number, which is the
        same on every process whose exchange paired with this one (else ``what`` differs, and
        the caller raises). Returns the name and the exchange's result."""
        caller = threading.current_thread().name
        end = self.begin(what, ["a new channel"], caller)
        with self.lock:
            n = self.seq[caller]
        return f"{caller}.loader{n}", end()

    def close_channel(self, channel: str, *, finished: bool, taken: int) -> None:
        """The end of a named channel, once no thread of this process runs its calls any more.
        ``finished``: its last exchange ended it on every process (a loader's end of data):
        its keys are deleted by the last process to get here. Else the next exchange's verdict
        is written as ended by this rank (``taken``: the batches its consumer took), which a
        process waiting in that exchange reads at once; the channel's few keys stay."""
        with self.lock:
            n = self.seq.pop(channel, 0)
            self.exchanges.pop(channel, None)
            last_two = self.previous.pop(channel, (0, 0))
        base = f"{self.prefix}{channel}/"
        store = self.store
        try:
            if not finished:
                store.set(f"{base}{n + 1}/done", f"{_ENDED} {self.rank} {taken}")
                return
            if store.add(base + "fin", 1) < self.world:
                return
            keys = [f"{base}slot{k}/{v}" for k in range(_SLOTS) for v in ("d", "n")]
            keys += [f"{base}{k}/done" for k in last_two if k] + [base + "fin"]
            keys += [f"{self.prefix}at/{channel}/{q}" for q in range(self.world)]
            for k in keys:
                store.delete_key(k)
        except Exception as e:
            if is_comm_error(e):  # the others are gone: nobody reads these keys any more
                return
            raise

    def where_is(self, channel: str, q: int) -> tuple[int, str] | None:
        k = f"{self.prefix}at/{channel}/{q}"
        if not self.store.check([k]):
            return None
        seq, _, what = self.store.get(k).decode().partition("\t")
        return int(seq), what

    def failed(self, channel: str, n: int, what: str, error: BaseException) -> CollectiveError:
        """The error of call ``n`` (``what``) whose collective failed with ``error``: it names
        the ranks that are not in the call, or that did not report within ``GRACE``."""
        cause = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        timed_out = "timeout" in cause.lower() or "timed out" in cause.lower()
        head = (
            f"{what}: torchshard's collective (call #{n} of thread {channel!r} on rank "
            f"{self.rank}) "
            + (f"timed out after {self.timeout:g} s" if timed_out else f"failed ({cause})")
        )
        try:
            fail = f"{self.prefix}fail/{channel}/{n}/"
            self.store.set(f"{fail}{self.rank}", "")
            absent, elsewhere = [], []
            for q in range(self.world):
                if q == self.rank:
                    continue
                at = self.where_is(channel, q)
                if at is None:
                    absent.append(
                        f"rank {q} (no torchshard call yet on a thread named {channel!r}: calls "
                        "are matched by the calling thread's name, so the threads making the "
                        "same calls must have the same name on every process)"
                    )
                elif at != (n, what):
                    elsewhere.append(f"rank {q} (its last torchshard call: #{at[0]} {at[1]})")
            if not timed_out:  # a lost peer: those in the call that do not report are gone
                deadline = time.monotonic() + min(GRACE, self.timeout)
                quiet = [q for q in range(self.world) if q != self.rank]
                while quiet and time.monotonic() < deadline:
                    quiet = [q for q in quiet if not self.store.check([f"{fail}{q}"])]
                    if quiet:
                        time.sleep(0.05)
                for q in quiet:
                    if self.where_is(channel, q) == (n, what):
                        absent.append(f"rank {q} (it entered the call, then stopped answering)")
        except Exception as e:  # noqa: BLE001 -- the store is gone: so is the rank hosting it
            return CollectiveError(
                f"{head}; the process group's store is unreachable too ({e!s:.120}), so the "
                "process hosting it (rank 0, at MASTER_ADDR) has most likely exited. "
                "Every process must make the same torchshard calls in the same order."
            )
        missing = absent + elsewhere
        who = (
            "ranks that did not answer: " + ", ".join(missing)
            if missing
            else "every rank entered this call"
        )
        return CollectiveError(
            f"{head}; {who}. Every process must make the same torchshard calls in the same "
            "order: a process that skips a call, leaves a loader loop early or exits leaves "
            "the others waiting (for at most the default group's timeout, "
            "init_process_group(timeout=...)). The processes are now out of step: end the run."
        )


_STATE: list[_Session | None] = [None]
_STATE_LOCK = threading.Lock()


def session() -> _Session | None:
    """The collective state of the current default group (``None`` on one process)."""
    world = dist.GroupMember.WORLD
    s = _STATE[0]
    if s is not None and s.group is world:
        return s
    if world is None or dist.get_world_size() == 1:
        return None
    with _STATE_LOCK:
        s = _STATE[0]
        if s is None or s.group is not world:
            s = _STATE[0] = _Session(world)
        return s


def gather_all(what: str, items: Sequence[str]) -> list[list[str]] | None:
    """Every process's ``items`` (``None`` on one process): each writes its own and reads the
    others' (``world`` reads per process); the last to finish reading deletes the keys."""
    s = session()
    if s is None:
        return None
    channel, n = s.enter(what)
    key = f"{s.prefix}{channel}/{n}/all/"
    store = s.store
    try:
        store.set(f"{key}{s.rank}", json.dumps(list(items)))
        every = [json.loads(store.get(f"{key}{q}")) for q in range(s.world)]
        if store.add(key + "read", 1) == s.world:
            for q in range(s.world):
                store.delete_key(f"{key}{q}")
            store.delete_key(key + "read")
    except Exception as e:
        if is_comm_error(e):
            raise s.failed(channel, n, what, e) from None
        raise
    return every


def begin(
    what: str, items: Sequence[str], channel: str | None = None
) -> Callable[[], list[list[str]] | None]:
    """``exchange`` in two halves, so that work that runs no collective (DTensor's
    ``from_local``) overlaps the wait for the other processes: ``begin`` returns the end."""
    s = session()
    return _NOTHING if s is None else s.begin(what, items, channel)


def _NOTHING() -> None:
    return None


def exchange(what: str, items: Sequence[str], channel: str | None = None) -> list[list[str]] | None:
    """Every process's ``[what, *items]`` when some differ, ``None`` when all agree (and on one
    process), on ``channel`` (default: the calling thread's). Raises ``CollectiveError`` naming
    the ranks that did not answer in time, or the rank whose epoch ended (a named channel)."""
    return begin(what, items, channel)()


def open_channel(what: str) -> tuple[str, list[list[str]] | None] | None:
    """``_Session.open_channel`` (``None`` on one process); call it in program order."""
    s = session()
    return None if s is None else s.open_channel(what)


def close_channel(channel: str, *, finished: bool, taken: int) -> None:
    """Ends a named channel (``_Session.close_channel``)."""
    s = session()
    if s is not None:
        s.close_channel(channel, finished=finished, taken=taken)


@contextlib.contextmanager
def guarded(what: str) -> Iterator[None]:
    """Records this process's arrival at collective ``what``; a transport failure inside
    becomes a ``CollectiveError`` naming ``what`` and the ranks that did not answer."""
    s = session()
    if s is None:
        yield
        return
    channel, n = s.enter(what)
    try:
        yield
    except Exception as e:
        if is_comm_error(e):
            raise s.failed(channel, n, what, e) from e
        raise


def bound_timeouts(groups: Sequence[Any]) -> None:
    """Gives each of ``groups`` (a ``DeviceMesh``'s, other than the default group) the default
    group's timeout, which torch's ``new_group`` does not inherit."""
    s = session()
    if s is None:
        return
    for g in groups:
        if g is not None and g is not s.group:
            set_group_timeout(timedelta(seconds=s.timeout), g)
