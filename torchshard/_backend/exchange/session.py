"""torchshard's exchanges on one job: calls numbered per stream, exchanges over the tree
(``node.py``), and the errors that name the call, the batch and the ranks.

A backend that has several processes (DTensor: the default process group; torchax: JAX's
processes) makes one ``Session`` per job, bootstrapped through the job's key-value store (the
node's address, once), and calls it:

- ``enter(what)`` before each cross-process step torchshard issues (an exchange, or a
  collective of the runtime's that ``guarded`` wraps): the call's number on its stream, which
  is what a survey answers when it names the ranks that are elsewhere. Local: no message.
- ``begin(what, items, counts)`` / its end: every process's ``[what, *items]`` compared (a
  digest goes up the tree; the descriptions only in a second round when digests differ) and
  ``counts`` summed, min'ed and max'ed. Returns a ``Verdict``.
- ``open_channel``/``close_channel``: a loader epoch's own sequence of exchanges, which its
  thread runs one batch ahead; an epoch closed early tells every process at once.
- ``replicas(what, blocks)``: the value check, merged per block (``merge.py``).
- ``failed(...)``: the ``CollectiveError`` of a call that timed out or lost a peer, naming the
  ranks that are not in it (a survey through the tree).

**Streams.** The calls meet in program order on a *stream*: ``"main"`` for every thread, or the
name given by ``torchshard.call_stream(name)``; a loader's epoch gets ``<stream>.loader<n>``.
A thread that begins an exchange on a stream while another thread of the process has one
outstanding there raises at once: its calls could pair with the other processes' in either
order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torchshard._backend.exchange import merge
from torchshard._backend.exchange.node import Node, TreeError, position_text
from torchshard._backend.exchange.tree import TreeShape
from torchshard._core.agreement import current_stream, digest, switches
from torchshard._core.errors import CollectiveError
from torchshard._core.ranks import RankSet
from torchshard._core.verdict import Group, Verdict, ranks_text

FANOUT = 8  # children per host leader (docs/design.md: chosen from benchmarks/exchange.py's model)
JOIN = "torchshard.join"  # the channel of the one exchange every session makes first


class Session:
    """torchshard's exchanges on one job of ``world`` processes (this one ``rank``).

    ``kv_set(key, value)`` and ``kv_get(key, timeout)`` are the job's key-value store (the
    bootstrap: this process's address, its parent's; the tree's shape from rank 0). ``host``:
    the address the other processes reach this one at. ``timeout``: the user's bound on every
    wait, in seconds. ``store_host``: which rank hosts the key-value store (named when it
    leaves)."""

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        timeout: float,
        kv_set: Callable[[str, str], None],
        kv_get: Callable[[str, float], str],
        host: str,
        bind: str | None = None,
        local_size: int = 1,
        fanout: int = FANOUT,
        tag: str = "",
    ) -> None:
        self.rank = rank
        self.world = world
        self.timeout = float(timeout)
        if rank == 0:
            kv_set("tree/shape", f"{fanout} {local_size}")
        else:
            fanout, local_size = (int(v) for v in kv_get("tree/shape", self.timeout).split())
        self.shape = TreeShape(rank, world, fanout, local_size)
        self.seq: dict[str, int] = {}  # per stream or channel: calls entered
        self.active: dict[str, int] = {}  # stream -> the thread with an exchange outstanding
        self.deferred: dict[str, Callable[[str], None]] = {}  # stream -> its check, not judged
        self.lock = threading.Lock()

        def lookup(r: int, timeout: float) -> str:
            try:
                return kv_get(f"tree/{r}", timeout)
            except Exception as e:  # noqa: BLE001 -- the store's own timeout or loss
                raise TreeError(
                    "joined",
                    f"rank {r}, this process's parent in torchshard's exchange tree, did not "
                    f"publish its address within {timeout:g} s ({str(e).strip()[:120]}): it has "
                    "made no torchshard collective (it did not enter the mesh)",
                ) from None

        self.node = Node(
            self.shape,
            timeout=self.timeout,
            publish=lambda address: kv_set(f"tree/{rank}", address),
            lookup=lookup,
            host=host,
            bind=bind,
            tag=tag,
        )
        mine = self.node.mine = switches()
        # The first exchange: every process's switches (an environment variable set on some
        # processes only), which no call waits for; exchanges compare against it once in.
        state = " ".join(f"{k}({v!r})" for k, v in sorted(mine.items()))
        self._join = self.node.begin(
            (JOIN, 1, 0), merge.agree_value(state, "", [], rank), stream=JOIN
        )
        self._join_checked = False

    # -- calls ---------------------------------------------------------------------------------

    def stream(self, channel: str | None) -> str:
        return current_stream() if channel is None else channel

    def enter(self, what: str, channel: str | None = None) -> tuple[str, int]:
        """Numbers this process's next call on ``channel`` (default: the caller's stream) and
        records it (what a survey answers)."""
        channel = self.stream(channel)
        if self.deferred:
            self.settle(channel, f"at the next torchshard call on its stream ({what})")
        with self.lock:
            n = self.seq[channel] = self.seq.get(channel, 0) + 1
        self.node.record(channel, n, what)
        return channel, n

    def calls(self, channel: str | None = None) -> int:
        """The number of the last call entered on ``channel`` (default: the caller's stream)."""
        with self.lock:
            return self.seq.get(self.stream(channel), 0)

    def defer(self, channel: str, judge: Callable[[str], None]) -> None:
        """Keeps ``judge`` (a call's deferred check, begun on ``channel``) until the next call
        on ``channel`` enters, or ``settle``: it is then called with where it is judged
        (``"at ..."``, for its error) and raises what the check found. At most one per
        channel: a new one settles the last first."""
        self.settle(channel, "at the next torchshard call on its stream")
        with self.lock:
            self.deferred[channel] = judge

    def settle(self, channel: str | None, where: str) -> None:
        """Judges the deferred check of ``channel`` (every channel's: ``None``) now, raising
        what it found (the first error; every check is judged)."""
        with self.lock:
            if channel is None:
                judges = list(self.deferred.values())
                self.deferred.clear()
            else:
                judge = self.deferred.pop(channel, None)
                judges = [] if judge is None else [judge]
        first: BaseException | None = None
        for judge in judges:
            try:
                judge(where)
            except BaseException as e:  # noqa: BLE001 -- the first is raised, all are judged
                first = first or e
        if first is not None:
            raise first

    def switched(self, name: str, value: Any) -> None:
        """This process changed a check (``set_agreement_check``...): every process hears of
        it, with the point of the caller's stream where it happened."""
        stream = current_stream()
        with self.lock:
            at = self.seq.get(stream, 0)
        self.node.mine = switches()
        self.node.mine_at[name] = (stream, at)
        self.node.flood(
            "switch",
            {"rank": self.rank, "name": name, "value": value, "stream": stream, "call": at},
        )

    def begin(
        self,
        what: str,
        items: Sequence[str],
        channel: str | None = None,
        counts: Sequence[int] = (),
        *,
        eager: bool = False,
    ) -> Callable[[], Verdict]:
        """Starts the exchange of ``[what, *items]`` and ``counts`` (at most one message, no
        waiting) and returns its end, the ``Verdict``. The end must be called on every process,
        on the thread that began it, also when the caller's own work in between failed.
        ``eager``: the end may come late (a deferred check, judged at the result's first use),
        so the second round (the descriptions, when the digests differ) starts as soon as the
        first round's result is in, not at the end: a process that is elsewhere (in a
        collective of the step) never keeps the others waiting for its descriptions."""
        channel = self.stream(channel)
        if self.deferred:  # the last call's check first: it holds the stream until judged
            self.settle(channel, f"at the next torchshard call on its stream ({what})")
        me = threading.get_ident()
        with self.lock:  # refused before it takes a call number: the others never see it
            other = self.active.get(channel)
            if other is not None and other != me:
                raise self._two_threads(what, channel, self.seq.get(channel, 0) + 1, other)
            self.active[channel] = me
        channel, n = self.enter(what, channel)
        mine = (what, *items)
        code = str(digest(list(mine)))
        value = merge.agree_value(what, code, [int(c) for c in counts], self.rank)
        second: list[Any] = []  # eager: round 2's pending (or its error), begun early

        def then(result: dict[str, Any]) -> None:  # on the thread that delivers round 1
            if len(result["g"]) > 1 and result["K"] != "mixed":
                try:
                    second.append(self._round_two(channel, n, what, mine))
                except Exception as e:  # noqa: BLE001 -- the end raises it, never this thread
                    second.append(e)

        try:
            self._check_join(what, channel, n)
            pending = self.node.begin(
                (channel, n, 0), value, stream=channel, then=then if eager else None
            )
        except TreeError as e:
            self._release(channel, me)
            raise self._error(e, channel, n, what) from None
        except BaseException:
            self._release(channel, me)
            raise

        def end() -> Verdict:
            try:
                result = pending.wait(self.timeout)
                if len(result["g"]) > 1 or result["K"] == "mixed":
                    result = self._items(channel, n, what, mine, result, *second)
            except TreeError as e:
                raise self._error(e, channel, n, what) from None
            finally:
                self._release(channel, me)
            return _verdict(result, mine, self.world)

        return end

    def _round_two(self, channel: str, n: int, what: str, mine: tuple[str, ...]) -> Any:
        value = merge.items_value(what, str(digest(list(mine))), list(mine), self.rank)
        return self.node.begin((channel, n, 1), value, stream=channel)

    def _items(
        self,
        channel: str,
        n: int,
        what: str,
        mine: tuple[str, ...],
        first: dict[str, Any],
        begun: Any = None,
    ) -> dict[str, Any]:
        """The second round: the descriptions of the distinct digests (for the error);
        ``begun``: its pending (or the error that stopped it) when already begun."""
        if first["K"] == "mixed":  # processes in different calls: their names are the items
            return {"K": "items", "g": [[g[0], g[1], g[2], [g[0]]] for g in first["g"]]}
        if isinstance(begun, Exception):
            raise begun
        pending = begun if begun is not None else self._round_two(channel, n, what, mine)
        result = dict(pending.wait(self.timeout))
        result.update({k: first[k] for k in ("s", "lo", "hi")})
        return result

    def _release(self, channel: str, me: int) -> None:
        with self.lock:
            if self.active.get(channel) == me:
                del self.active[channel]

    def exchange(
        self,
        what: str,
        items: Sequence[str],
        channel: str | None = None,
        counts: Sequence[int] = (),
    ) -> Verdict:
        """``begin`` and its end at once."""
        return self.begin(what, items, channel, counts)()

    def open_channel(self, what: str) -> tuple[str, Verdict]:
        """An exchange of ``what`` on the caller's stream, and the name of a new channel made
        by it (``<stream>.loader<n>``, ``n`` that exchange's call number: alike on every
        process whose exchange paired with this one)."""
        stream = current_stream()
        end = self.begin(what, ["a new channel"], stream)
        with self.lock:
            n = self.seq[stream]
        return f"{stream}.loader{n}", end()

    def close_channel(self, channel: str, *, finished: bool, taken: int) -> None:
        """The end of a named channel once no thread of this process runs its calls. Unless
        ``finished`` (its last exchange ended it everywhere), every process hears that this
        rank ended it after taking ``taken`` batches: its exchanges from the next call on fail
        at once, naming this rank."""
        with self.lock:
            n = self.seq.pop(channel, 0)
            self.active.pop(channel, None)
        if not finished:
            with contextlib.suppress(OSError):
                self.node.flood(
                    "ended", {"channel": channel, "call": n + 1, "rank": self.rank, "taken": taken}
                )
        self.node.forget_channel(channel, taken)

    def replicas(self, what: str, blocks: dict[str, tuple[str, int]]) -> list[tuple[str, Any]]:
        """The value check: ``blocks`` maps a block key to ``(checksum, holders)``; returns the
        blocks whose holders passed different checksums: ``(key, [[checksum, RankSet]...])``."""
        channel, n = self.enter(what)
        try:
            self._check_join(what, channel, n)
            pending = self.node.begin(
                (channel, n, 0), merge.replicas_value(what, blocks, self.rank), stream=channel
            )
            result = pending.wait(self.timeout)
        except TreeError as e:
            raise self._error(e, channel, n, what) from None
        if result["K"] == "mixed":
            return [("", [[w, RankSet.from_wire(r)] for w, _, r in result["g"]])]
        out = []
        for key, (checksum, _seen, _need, holders, others) in result["b"].items():
            if others:
                rows = [[checksum, RankSet.from_wire(holders)]]
                rows += [[c, RankSet.from_wire(r)] for c, r in others.items()]
                out.append((key, rows))
        return out

    # -- errors ----------------------------------------------------------------------------------

    def _check_join(self, what: str, channel: str, n: int) -> None:
        """Raises when the processes started with different switches (seen once the first
        exchange is in; never waited for)."""
        if self._join_checked:
            return
        try:
            result = self._join.wait(0)
        except TreeError as e:
            if e.kind == "timeout":
                return
            raise
        self._join_checked = True
        if result["K"] != "mixed":
            return
        seen = "; ".join(f"{w} on {ranks_text(RankSet.from_wire(r))}" for w, _, r in result["g"])
        raise CollectiveError(
            f"{what}: the processes started with different checks ({seen}): a check must be "
            "on or off alike on every process. The environment variables "
            "TORCHSHARD_AGREEMENT_CHECK and TORCHSHARD_VALUE_CHECK set them at start: set them "
            "alike for every process (or on none)."
        )

    def _two_threads(self, what: str, channel: str, n: int, other: int) -> CollectiveError:
        names = {t.ident: t.name for t in threading.enumerate()}
        return CollectiveError(
            f"{what}: thread {threading.current_thread().name!r} began torchshard call #{n} on "
            f"stream {channel!r} while thread {names.get(other, other)!r} has one under way "
            "there: calls on a stream are matched with the other processes' in program order, "
            "so two threads making them at the same time would pair in either order. Give one "
            "thread a stream of its own, named alike on every process: with "
            "torchshard.call_stream('eval'): ..."
        )

    def _error(self, e: TreeError, channel: str, n: int, what: str) -> Exception:
        if e.kind == "timeout":
            return self.failed(channel, n, what, e)
        if e.kind == "ended":
            return ended(what, e.info["rank"], e.info["taken"])
        head = (
            f"{what}: torchshard's collective (call #{n} of stream {channel!r} on rank {self.rank})"
        )
        if e.kind == "switch":
            return CollectiveError(
                f"{head} cannot be matched: {e}. A check must be switched alike on every "
                "process, at the same point of the program (or by the environment variables "
                "TORCHSHARD_AGREEMENT_CHECK / TORCHSHARD_VALUE_CHECK on every process)."
            )
        if e.kind == "left":
            rank = e.info.get("rank")
            return CollectiveError(
                f"{head} failed; ranks that did not answer: rank {rank} ({e}{_store_note(rank)})."
                " Every process must make the same torchshard calls in the same order; the "
                "processes are now out of step: end the run."
            )
        return CollectiveError(f"{head} failed: {e}.")

    def failed(self, channel: str, n: int, what: str, error: BaseException) -> CollectiveError:
        """The error of call ``n`` (``what``) that ``error`` ended (a timeout, a lost peer):
        names the ranks that are not in the call, from a survey of every process."""
        cause = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        timed_out = isinstance(error, TreeError) and error.kind == "timeout"
        timed_out = timed_out or "timeout" in cause.lower() or "timed out" in cause.lower()
        head = (
            f"{what}: torchshard's collective (call #{n} of stream {channel!r} on rank "
            f"{self.rank}) "
            + (f"timed out after {self.timeout:g} s" if timed_out else f"failed ({cause})")
        )
        tail = (
            "Every process must make the same torchshard calls in the same order: a process "
            "that skips a call, leaves a loader loop early or exits leaves the others waiting "
            "(for at most the timeout, e.g. init_process_group(timeout=...)). The processes are "
            "now out of step: end the run."
        )
        left = dict(self.node.left)
        budget = min(2.0, max(0.5, self.timeout / 4))
        answer = None if left else self.node.survey(channel, n, what, budget)
        parts: list[str] = []
        for rank, why in sorted(left.items()):
            parts.append(f"rank {rank} ({why}{_store_note(rank)})")
        if answer is not None:
            for position, ranks in answer:
                parts.append(f"{ranks_text(RankSet.from_wire(ranks))} ({position_text(position)})")
        switched = self._other_switches()
        if answer is None and not left:
            who = (
                "no answer came from torchshard's exchange tree within "
                f"{budget:g} s (the processes between this one and rank 0 are stuck or gone)"
            )
        elif parts:
            who = "ranks that did not answer: " + ", ".join(parts)
        else:
            who = "every rank entered this call"
        return CollectiveError(f"{head}; {who}.{switched} {tail}")

    def _other_switches(self) -> str:
        mine = switches()
        rows = [
            f" Rank {rank} called {name}({value!r}) after its call #{at} on stream {stream!r} "
            f"(this process: {mine.get(name)!r})."
            for rank, names in sorted(self.node.switches.items())
            for name, (value, stream, at) in names.items()
            if mine.get(name) != value
        ]
        return "".join(rows[:4])

    @contextlib.contextmanager
    def guarded(self, what: str, is_comm_error: Callable[[BaseException], bool]) -> Iterator[None]:
        """Records the call; a transport failure inside becomes ``failed``'s error."""
        channel, n = self.enter(what)
        try:
            yield
        except Exception as e:
            if is_comm_error(e):
                raise self.failed(channel, n, what, e) from e
            raise

    def close(self) -> None:
        """Closes the tree, once the deferred checks are judged (raising the first error)."""
        try:
            self.settle(None, "when a new default process group replaced its own")
        finally:
            self.node.close()


def ended(what: str, rank: int, taken: int) -> CollectiveError:
    """The error of an exchange on a channel whose epoch rank ``rank`` ended early."""
    return CollectiveError(
        f"{what}: rank {rank} ended this GlobalBatchLoader epoch after taking {taken} "
        "batch(es) (it left the loop, closed the loader or started another iter()), so it "
        "makes no more of its batches. Every process must take the same batches of an "
        "epoch: stop every process's loop at the same batch (e.g. the same number of "
        "steps), or give every process a source of the same length."
    )


def _store_note(rank: Any) -> str:
    return (
        "; rank 0 also hosts the job's store (MASTER_ADDR): the job cannot go on"
        if rank == 0
        else ""
    )


def _verdict(result: dict[str, Any], mine: tuple[str, ...], world: int) -> Verdict:
    sums, lo, hi = (tuple(result.get(k, ())) for k in ("s", "lo", "hi"))
    if result["K"] == "agree":  # one group: every process passed ``mine``
        (g,) = result["g"]
        return Verdict((Group(RankSet.from_wire(g[2]), mine),), world, sums, lo, hi)
    groups = tuple(
        Group(RankSet.from_wire(g[2]), tuple(g[3]) if len(g) > 3 else (g[0],)) for g in result["g"]
    )
    return Verdict(groups, world, sums, lo, hi)
