"""One process's place in the exchange tree: its connections, its I/O thread, the exchanges
under way, and what it has heard of the others.

**Connections.** A node listens on a port of its own and publishes ``host:port`` once through
the job's key-value store (the bootstrap: one ``set`` and, for its parent's address, one
``get``; nothing else ever goes through the store). It opens one connection, to its parent,
and accepts one from each child: a process holds at most ``fanout + local_size`` connections,
of which it opened one.

**An exchange** (``begin``/``Pending.wait``) is an all-reduce keyed by ``(channel, call,
round)``: a node merges its own value with its children's (``merge.py``) and sends the merge
up; the root's merge is the result, sent down, each node forwarding it to its children before
it hands it to its own waiter. A node handles ``1 + children`` messages up and as many down
per exchange, and the exchange takes ``2 x depth`` one-way hops: O(log N) for the process, no
process on the path of all.

**The I/O thread** (one per node, a daemon, ``torchshard-exchange``) reads every connection
and forwards; callers send from their own thread (a lock per connection). It never runs user
code, so a process busy elsewhere (a step, a blocked source) still forwards, floods and answers
surveys: the tree's progress never waits on a slow main thread, only on missing values.

**Floods** carry what every process must know at once, sent to every neighbour but the one it
came from: a rank that *left* (its connection closed: every exchange under way or to come
fails naming it), a loader epoch *ended* early by a rank (the channel's exchanges from that call
on fail naming the rank and the batches it took), a *switch* of a check by a rank (the
exchanges on its stream past that point fail naming the rank and the switch, when this process
has it the other way).

**Surveys** name the processes that are not where an exchange expects them: a waiter whose
deadline passed asks the root (requests merge on the way), the root asks every node (each
answers for itself, from its record of the calls it entered, and merges its children's answers
within a budget that shrinks down the tree), and the merged answer goes down to every process.
A survey costs O(N) messages in all, O(fanout) per process, and what it carries is the
*distinct* positions with their ranks: no process reads N records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from torchshard._backend.exchange import merge
from torchshard._backend.exchange.tree import TreeShape
from torchshard._backend.exchange.wire import ProtocolError, Reader, encode
from torchshard._core.ranks import RankSet

# frame kinds
_HELLO = "H"  # child -> parent, first: [H, rank, tag]
_UP = "U"  # [U, channel, call, round, value]
_DOWN = "D"  # [D, channel, call, round, result]
_FLOOD = "F"  # [F, kind, data]
_ASK = "Q"  # survey request, towards the root: [Q, sid, channel, call, what, budget]
_SURVEY = "S"  # survey, towards the leaves: [S, sid, channel, call, what, budget]
_ANSWER = "A"  # survey answer, towards the root: [A, sid, positions]
_RESULT = "R"  # survey result, towards the leaves: [R, sid, positions]

Key = tuple[str, int, int]  # (channel, call, round)


class TreeError(RuntimeError):
    """An exchange that cannot complete. ``kind``: ``"timeout"``, ``"left"`` (a process left:
    ``rank``), ``"ended"`` (a loader epoch ended early: ``rank``, ``taken``), ``"switch"``
    (a check switched on another rank), ``"closed"`` (this node was closed), ``"joined"``
    (the tree could not be joined)."""

    def __init__(self, kind: str, text: str, **info: Any) -> None:
        super().__init__(text)
        self.kind = kind
        self.info = info


class _Done:
    """A one-shot flag one thread waits for (cheaper than an ``Event``, whose ``Condition``
    costs a lock and a list per exchange)."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=max(0.0, timeout)):
            self._lock.release()
            return True
        return self._set


@dataclasses.dataclass
class _Op:
    key: Key
    own: dict[str, Any] | None = None
    got: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    result: dict[str, Any] | None = None
    error: TreeError | None = None
    done: _Done = dataclasses.field(default_factory=_Done)
    stream: str = ""  # the caller's stream (switch announcements are compared on it)
    sent: bool = False
    # Called with the result before the waiter wakes, on the thread that delivers it (the I/O
    # thread, or the caller's at the root): a deferred check's second round starts there.
    then: Callable[[dict[str, Any]], None] | None = None


@dataclasses.dataclass
class _Survey:
    sid: str
    channel: str
    call: int
    what: str
    deadline: float = 0.0
    own: list[Any] | None = None
    got: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    waiting: set[int] = dataclasses.field(default_factory=set)
    asked: bool = False
    answered: bool = False
    result: list[Any] | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class _Conn:
    __slots__ = ("lock", "peer", "reader", "sock")

    def __init__(self, sock: socket.socket, peer: int | None) -> None:
        self.sock = sock
        self.peer = peer  # the rank at the other end (a child's, once its hello is read)
        self.reader = Reader()
        self.lock = threading.Lock()


def position_text(position: list[Any] | None) -> str:
    """How a survey answer describes where a process is on a channel."""
    if position is None:
        return "no answer"
    kind = position[0]
    if kind == "at":
        return f"its last torchshard call: #{position[1]} {position[2]}"
    if kind == "none":
        return "no torchshard call yet on this stream"
    if kind == "ended":
        return f"it ended this epoch after taking {position[1]} batch(es)"
    if kind == "left":
        return position[1]
    return str(position)


class Node:
    """This process's node of the exchange tree (see the module's docstring).

    ``publish(address)`` writes this node's address where the others find it, and
    ``lookup(rank, timeout)`` reads another's (both through the job's key-value store), once
    each. ``timeout``: the user's bound on every wait (the process group's). ``host``: the
    address the others reach this process at (``bind`` is where it listens)."""

    def __init__(
        self,
        shape: TreeShape,
        *,
        timeout: float,
        publish: Callable[[str], None],
        lookup: Callable[[int, float], str],
        host: str = "127.0.0.1",
        bind: str | None = None,
        tag: str = "",
    ) -> None:
        self.shape = shape
        self.rank = shape.rank
        self.timeout = float(timeout)
        self.tag = tag  # which tree: a hello from another one is refused
        self.lock = threading.Lock()
        self._ops: dict[Key, _Op] = {}
        self._surveys: dict[str, _Survey] = {}
        self._children = set(shape.children)
        self._conns: dict[int, _Conn] = {}  # rank -> connection (parent and children)
        self._parent = shape.parent
        self.left: dict[int, str] = {}  # ranks known to have left, and how
        self.ended: dict[str, tuple[int, int, int]] = {}  # channel -> (from call, rank, taken)
        self.switches: dict[int, dict[str, tuple[Any, str, int]]] = {}
        self._positions: dict[str, tuple[int, str]] = {}  # channel -> (call, what) entered
        self._closed_channels: dict[str, int] = {}  # channel -> batches taken (recent ones)
        self._failure: TreeError | None = None  # the tree is broken: every exchange fails
        self._closed = False
        self._joined = threading.Event()
        self.mine: dict[str, Any] = {}  # this process's switches (the session keeps them current)
        self.mine_at: dict[str, tuple[str, int]] = {}  # where it last switched each (stream, call)
        self._floods: list[list[Any]] = []  # the floods so far (a child that joins late hears them)
        self._sids = itertools.count()
        self.sent = 0  # frames sent (the scale benchmark reads these)
        self.received = 0
        self._listener = socket.create_server((bind or host, 0), backlog=1024)
        port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._lookup = lookup
        publish(f"{host}:{port}")
        self._thread = threading.Thread(target=self._run, name="torchshard-exchange", daemon=True)
        self._thread.start()

    # -- the caller's side --------------------------------------------------------------------

    def record(self, channel: str, call: int, what: str) -> None:
        """This process entered call ``call`` (``what``) of ``channel``: what it answers in a
        survey. Local: no message."""
        self._positions[channel] = (call, what)

    def begin(
        self,
        key: Key,
        value: dict[str, Any],
        *,
        stream: str = "",
        then: Callable[[dict[str, Any]], None] | None = None,
    ) -> _Pending:
        """Contributes this process's ``value`` to the exchange ``key`` and returns its
        pending result. Sends at most one message (up, or the result down at the root).
        ``then(result)``: called once the result is in, before any waiter wakes (it must not
        raise or wait)."""
        with self.lock:
            self._check(key, stream)
            op = self._ops.get(key)
            if op is None:
                op = self._ops[key] = _Op(key)
            op.own = value
            op.stream = stream
            op.then = then
            sends = self._progress(op)
        self._send_all(sends)
        return _Pending(self, op)

    def flood(self, kind: str, data: dict[str, Any]) -> None:
        """Tells every process ``kind``/``data`` (a channel ended, a switch), applying it here
        first."""
        message = [_FLOOD, kind, data]
        with self.lock:
            self._apply(kind, data)
            self._log(message)
        self._send_all([(peer, message) for peer in list(self._conns)])

    def forget_channel(self, channel: str, taken: int | None = None) -> None:
        """This process is done with ``channel``: its state goes (``taken``: the batches its
        epoch took, what a survey answers for the channel from now on)."""
        with self.lock:
            self._positions.pop(channel, None)
            self.ended.pop(channel, None)
            for key in [k for k in self._ops if k[0] == channel]:
                op = self._ops.pop(key)
                if not op.done.is_set():
                    op.error = TreeError("closed", f"the channel {channel!r} was closed")
                    op.done.set()
            if taken is not None:
                self._closed_channels[channel] = taken
                while len(self._closed_channels) > 64:
                    del self._closed_channels[next(iter(self._closed_channels))]

    def survey(self, channel: str, call: int, what: str, budget: float) -> list[Any] | None:
        """Where every process is relative to call ``call`` (``what``) of ``channel``: a list of
        ``[position, RankSet wire]`` for the processes not in that call (an empty list: every
        process is in it), or ``None`` when no answer came within ``budget`` seconds."""
        sid = f"{channel}\x1f{call}\x1f{what}"
        with self.lock:
            s = self._surveys.get(sid)
            if s is None:
                s = self._surveys[sid] = _Survey(sid, channel, call, what)
            first = not s.asked
            s.asked = True
        parent = self._parent
        if first:
            if parent is None:
                self._start_survey(s, budget)
            else:
                self._send_all([(parent, [_ASK, sid, channel, call, what, budget])])
        s.done.wait(budget + 0.5)
        return s.result

    def close(self) -> None:
        """Closes the connections and ends the I/O thread (exchanges under way fail)."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self._fail_all(TreeError("closed", "torchshard's exchange tree was closed"))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    @property
    def connections(self) -> int:
        """Open connections (parent and children)."""
        return len(self._conns)

    # -- under the lock -----------------------------------------------------------------------

    def _log(self, message: list[Any]) -> None:
        """Keeps a flood for the children that have not joined yet (none: nothing kept)."""
        if any(c not in self._conns for c in self._children):
            self._floods.append(message)
        else:
            self._floods.clear()

    def _check(self, key: Key, stream: str) -> None:
        """Raises at once what makes exchange ``key`` impossible (before contributing)."""
        if self._failure is not None:
            raise self._failure
        ended = self.ended.get(key[0])
        if ended is not None and key[1] >= ended[0]:
            raise _ended_error(ended)
        switched = self._switched(stream, key[1])
        if switched is not None:
            raise switched

    def _switched(self, stream: str, call: int) -> TreeError | None:
        """A switch another rank announced on ``stream`` before call ``call`` that this
        process has the other way, made *after* this process last switched it there (a rank
        whose announcement is older than this process's own switch may just not have reached
        that point yet: that is judged by the exchange's timeout, not here)."""
        mine = self.mine
        for rank, names in sorted(self.switches.items()):
            for name, (value, on, at) in names.items():
                own = self.mine_at.get(name)
                newer = own is None or own[0] != stream or at > own[1]
                if on == stream and at < call and mine.get(name) != value and newer:
                    return TreeError(
                        "switch",
                        f"rank {rank} called {name}({value!r}) after its call #{at} on stream "
                        f"{stream!r}, and this process has {name} {mine.get(name)!r}",
                        rank=rank,
                    )
        return None

    def _progress(self, op: _Op) -> list[tuple[int, Any]]:
        """Sends ``op``'s merge up (or, at the root, its result down) once every value is in."""
        if op.sent or op.own is None or len(op.got) < len(self._children):
            return []
        op.sent = True
        values = [op.own] + [op.got[c] for c in sorted(op.got)]
        merged = merge.merge(values) if len(values) > 1 else op.own
        channel, call, rnd = op.key
        if self._parent is not None:
            return [(self._parent, [_UP, channel, call, rnd, merged])]
        return self._deliver(op, merged)

    def _deliver(self, op: _Op, result: dict[str, Any]) -> list[tuple[int, Any]]:
        """The result of ``op``: forwarded to the children, then handed to the waiter."""
        channel, call, rnd = op.key
        down = [_DOWN, channel, call, rnd, result]
        sends: list[tuple[int, Any]] = [(c, down) for c in sorted(self._children)]
        op.result = result
        self._ops.pop(op.key, None)
        return [*sends, (-1, op)]  # -1: set the waiter's event once the sends are out

    def _apply(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "ended":
            channel, call = data["channel"], int(data["call"])
            entry = (call, int(data["rank"]), int(data["taken"]))
            if channel not in self.ended or self.ended[channel][0] > call:
                self.ended[channel] = entry
            for key, op in list(self._ops.items()):
                if key[0] == channel and key[1] >= call and not op.done.is_set():
                    op.error = _ended_error(entry)
                    op.done.set()
        elif kind == "switch":
            rank = int(data["rank"])
            self.switches.setdefault(rank, {})[data["name"]] = (
                data["value"],
                data["stream"],
                int(data["call"]),
            )
            for op in list(self._ops.values()):
                if op.own is not None and not op.done.is_set():
                    err = self._switched(op.stream, op.key[1])
                    if err is not None:
                        op.error = err
                        op.done.set()
        elif kind == "left":
            rank = int(data["rank"])
            if rank not in self.left:
                self.left[rank] = data["why"]
                self._fail_all(TreeError("left", data["why"], rank=rank, why=data["why"]))

    def _fail_all(self, error: TreeError) -> None:
        if self._failure is None:
            self._failure = error
        for op in self._ops.values():
            if not op.done.is_set():
                op.error = error
                op.done.set()
        for s in self._surveys.values():
            s.done.set()

    # -- sending ------------------------------------------------------------------------------

    def _send_all(self, sends: list[tuple[int, Any]]) -> None:
        frames: dict[int, bytes] = {}  # a message sent to several children is encoded once
        for peer, message in sends:
            if peer == -1:
                if message.then is not None and message.result is not None:
                    message.then(message.result)
                message.done.set()
                continue
            conn = self._conns.get(peer)
            if conn is None:
                if peer == self._parent and not self._joined.is_set():
                    self._joined.wait(self.timeout)  # the I/O thread is still connecting
                    conn = self._conns.get(peer)
                if conn is None:
                    continue  # a peer that left: its flood fails what waits on it
            frame = frames.get(id(message))
            if frame is None:
                frame = frames[id(message)] = encode(message)
            try:
                with conn.lock:
                    conn.sock.sendall(frame)
                self.sent += 1
            except OSError:  # the I/O thread reads the end of this connection: _lost
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)

    # -- the I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._join()
        except Exception as e:  # noqa: BLE001 -- every exchange reports it
            with self.lock:
                self._fail_all(TreeError("joined", str(e)))
            self._joined.set()
        try:
            while not self._closed:
                timeout = self._timers()
                for key, _ in self._sel.select(timeout):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._read(key.data)
        finally:
            for key in list(self._sel.get_map().values()):
                if isinstance(key.data, _Conn):
                    with contextlib.suppress(OSError):
                        key.data.sock.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    sock.close()
            self._sel.close()

    def _join(self) -> None:
        """Connects to the parent (its address from the store, within the timeout)."""
        if self._parent is None:
            self._joined.set()
            return
        deadline = time.monotonic() + self.timeout
        address = self._lookup(self._parent, self.timeout)
        host, _, port = address.rpartition(":")
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=self.timeout)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TreeError(
                        "joined",
                        f"rank {self.rank} could not connect to rank {self._parent} at "
                        f"{address} ({e})",
                    ) from None
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        conn = _Conn(sock, self._parent)
        sock.sendall(encode([_HELLO, self.rank, self.tag]))
        self._conns[self._parent] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)
        self._joined.set()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        self._sel.register(sock, selectors.EVENT_READ, _Conn(sock, None))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._lost(conn)
            return
        try:
            messages = conn.reader.feed(data)
        except ProtocolError:
            self._lost(conn)
            return
        for message in messages:
            self._handle(conn, message)

    def _lost(self, conn: _Conn) -> None:
        """A connection closed: the rank at its end (and what hangs below it) has left."""
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        peer = conn.peer
        if peer is None or self._conns.get(peer) is not conn:
            return
        del self._conns[peer]
        if self._closed:
            return
        below = self.shape.subtree_size(peer) - 1 if peer in self._children else 0
        why = "it left: its connection to torchshard's exchange tree closed (the process exited"
        why += " or closed its process group)"
        if below:
            why += f"; the {below} process(es) below it in the tree are cut off with it"
        self.flood("left", {"rank": peer, "why": why})

    def _handle(self, conn: _Conn, message: list[Any]) -> None:
        kind = message[0]
        if kind == _HELLO:
            rank, tag = int(message[1]), message[2]
            if rank not in self._children or tag != self.tag or rank in self._conns:
                self._lost(conn)
                return
            conn.peer = rank
            self._conns[rank] = conn
            with self.lock:  # what was flooded before it joined
                floods = list(self._floods)
            self._send_all([(rank, m) for m in floods])
            return
        peer = conn.peer
        if peer is None:
            self._lost(conn)
            return
        self.received += 1
        sends: list[tuple[int, Any]] = []
        with self.lock:
            if kind == _UP:
                key = (message[1], int(message[2]), int(message[3]))
                op = self._ops.get(key)
                if op is None:
                    op = self._ops[key] = _Op(key)
                op.got[peer] = message[4]
                sends = self._progress(op)
            elif kind == _DOWN:
                key = (message[1], int(message[2]), int(message[3]))
                op = self._ops.get(key)
                if op is not None:
                    sends = self._deliver(op, message[4])
                else:  # nobody here waits any more (closed): still forward it
                    sends = [(c, message) for c in sorted(self._children)]
            elif kind == _FLOOD:
                self._apply(message[1], message[2])
                self._log(message)
                sends = [(p, message) for p in self._conns if p != peer]
            elif kind == _ASK:
                sid = message[1]
                s = self._surveys.get(sid)
                if s is None:
                    s = self._surveys[sid] = _Survey(sid, message[2], int(message[3]), message[4])
                if not s.asked:
                    s.asked = True
                    if self._parent is None:
                        sends = self._survey_start(s, float(message[5]))
                    else:
                        sends = [(self._parent, message)]
            elif kind == _SURVEY:
                sid = message[1]
                s = self._surveys.get(sid)
                if s is None:
                    s = self._surveys[sid] = _Survey(sid, message[2], int(message[3]), message[4])
                s.asked = True
                sends = self._survey_start(s, float(message[5]))
            elif kind == _ANSWER:
                s = self._surveys.get(message[1])
                if s is not None and s.own is not None:
                    s.got[peer] = message[2]
                    s.waiting.discard(peer)
                    sends = self._survey_progress(s, force=False)
            elif kind == _RESULT:
                s = self._surveys.get(message[1])
                if s is None:
                    s = self._surveys[message[1]] = _Survey(message[1], "", 0, "")
                sends = [(c, message) for c in sorted(self._children)]
                self._survey_done(s, message[2])
        self._send_all(sends)

    # -- surveys --------------------------------------------------------------------------------

    def _start_survey(self, s: _Survey, budget: float) -> None:
        with self.lock:
            sends = self._survey_start(s, budget)
        self._send_all(sends)

    def _survey_start(self, s: _Survey, budget: float) -> list[tuple[int, Any]]:
        if s.own is not None:
            return []
        s.own = self._position(s)
        child_budget = budget * 0.7
        s.deadline = time.monotonic() + budget
        s.waiting = {c for c in self._children if c in self._conns}
        s.got = {
            c: [[self._absent(c), RankSet.span(c, c).to_wire()]]
            for c in self._children
            if c not in self._conns
        }
        survey = [_SURVEY, s.sid, s.channel, s.call, s.what, child_budget]
        sends: list[tuple[int, Any]] = [(c, survey) for c in sorted(s.waiting)]
        with contextlib.suppress(OSError):
            self._wake_w.send(b"t")  # the I/O thread picks up the new deadline
        return sends + self._survey_progress(s, force=False)

    def _position(self, s: _Survey) -> list[Any]:
        """This process's answer: where it is on ``s``'s channel, if not at ``s``'s call."""
        at = self._positions.get(s.channel)
        me = RankSet.of([self.rank]).to_wire()
        if at == (s.call, s.what):
            return []
        if at is not None:
            return [[["at", at[0], at[1]], me]]
        taken = self._closed_channels.get(s.channel)
        if taken is not None:
            return [[["ended", taken], me]]
        return [[["none"], me]]

    def _absent(self, child: int) -> list[Any]:
        why = self.left.get(child)
        below = self.shape.subtree_size(child) - 1
        if why is None:
            why = "has not joined torchshard's exchange tree (no torchshard collective yet)"
        if below:
            why += f" (and the {below} process(es) below it in the tree, which report through it)"
        return ["left", why]

    def _survey_progress(self, s: _Survey, *, force: bool) -> list[tuple[int, Any]]:
        if s.own is None or s.answered or (s.waiting and not force):
            return []
        for c in s.waiting:
            below = self.shape.subtree_size(c) - 1
            why = f"did not answer the survey within its budget (nor the {below} below it)"
            s.got[c] = [[["left", why], RankSet.span(c, c).to_wire()]]
        s.waiting = set()
        s.answered = True
        merged = _merge_positions([s.own] + [s.got[c] for c in sorted(s.got)])
        if self._parent is not None:  # nothing more to do here until the result comes down
            return [(self._parent, [_ANSWER, s.sid, merged])]
        sends = [(c, [_RESULT, s.sid, merged]) for c in sorted(self._children) if c in self._conns]
        self._survey_done(s, merged)
        return sends

    def _survey_done(self, s: _Survey, result: list[Any]) -> None:
        s.result = result
        s.done.set()
        # finished surveys are kept (a late waiter reads them), a bounded number
        while len(self._surveys) > 256:
            del self._surveys[next(iter(self._surveys))]

    def _timers(self) -> float | None:
        """Runs surveys whose budget ran out; returns the time to the next deadline."""
        now = time.monotonic()
        sends: list[tuple[int, Any]] = []
        nearest: float | None = None
        with self.lock:
            for s in list(self._surveys.values()):
                if s.own is None or s.answered:
                    continue
                if s.deadline <= now:
                    sends += self._survey_progress(s, force=True)
                else:
                    left = s.deadline - now
                    nearest = left if nearest is None else min(nearest, left)
        self._send_all(sends)
        return nearest


def _merge_positions(answers: list[list[Any]]) -> list[Any]:
    """Survey answers merged: one ``[position, ranks]`` per distinct position."""
    out: dict[str, list[Any]] = {}
    for answer in answers:
        for position, ranks in answer:
            key = repr(position)
            if key in out:
                out[key][1] = (RankSet.from_wire(out[key][1]) | RankSet.from_wire(ranks)).to_wire()
            elif len(out) < merge.MAX_GROUPS:
                out[key] = [position, ranks]
    return sorted(out.values(), key=lambda pr: pr[1][0] if len(pr[1]) > 1 else 1 << 62)


def _ended_error(entry: tuple[int, int, int]) -> TreeError:
    call, rank, taken = entry
    return TreeError("ended", f"rank {rank} ended the epoch", rank=rank, taken=taken, call=call)


class _Pending:
    """An exchange this process contributed to; ``wait`` returns its result."""

    __slots__ = ("_node", "_op")

    def __init__(self, node: Node, op: _Op) -> None:
        self._node = node
        self._op = op

    def wait(self, timeout: float) -> dict[str, Any]:
        """The exchange's result; ``TreeError`` when it cannot complete (``"timeout"`` after
        ``timeout`` seconds)."""
        op = self._op
        if not op.done.wait(timeout):
            with self._node.lock:
                if not op.done.is_set():
                    op.error = TreeError("timeout", f"no result within {timeout:g} s")
                    op.done.set()
                    self._node._ops.pop(op.key, None)
        if op.error is not None:
            raise op.error
        assert op.result is not None
        return op.result
