"""A process's node (torchshard._backend.exchange.node): one connection opened (to its
parent), the children's accepted; an all-reduce delivered to the children before the waiter;
floods reach a child that joined late; a survey names a child that never joined and what is
below it; a peer that speaks another protocol, or claims another rank, is dropped; closing
fails what waits."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from exchange_helpers import KV

from torchshard._backend.exchange import merge
from torchshard._backend.exchange.node import Node, TreeError, position_text
from torchshard._backend.exchange.tree import TreeShape


def _nodes(world, ranks, kv, fanout=2, timeout=3.0):
    out = {}

    def make(r):
        out[r] = Node(
            TreeShape(r, world, fanout),
            timeout=timeout,
            publish=lambda a, r=r: kv.set(f"tree/{r}", a),
            lookup=lambda q, t: kv.get(f"tree/{q}", t),
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_a_late_child_hears_the_floods_and_an_absent_one_is_surveyed():
    kv = KV()
    nodes = _nodes(4, [0, 1, 3], kv)  # 0 -> 1, 2; 1 -> 3; rank 2 has not joined yet
    try:
        nodes[0].flood("ended", {"channel": "c", "call": 3, "rank": 0, "taken": 2})
        time.sleep(0.2)
        assert nodes[3].ended["c"] == (3, 0, 2)  # through rank 1
        for r in (0, 1, 3):
            nodes[r].record("main", 1, "call A")
        answer = nodes[3].survey("main", 1, "call A", budget=1.0)
        assert answer is not None and len(answer) == 1
        position, ranks = answer[0]
        assert ranks[:2] == [2, 2]
        assert position_text(position) == (
            "has not joined torchshard's exchange tree (no torchshard collective yet)"
        )
        nodes.update(_nodes(4, [2], kv))  # it joins: the flood sent before reaches it
        time.sleep(0.2)
        assert nodes[2].ended["c"] == (3, 0, 2)
    finally:
        for n in nodes.values():
            n.close()


def test_a_result_reaches_the_children_before_the_waiter_and_one_connection_is_opened():
    kv = KV()
    nodes = _nodes(3, [0, 1, 2], kv)
    try:
        pendings = {
            r: nodes[r].begin(("c", 1, 0), merge.agree_value("w", "d", [r], r)) for r in range(3)
        }
        results = {r: p.wait(5) for r, p in pendings.items()}
        assert all(res["s"] == [3] for res in results.values())
        assert nodes[0].connections == 2 and nodes[1].connections == 1
        assert nodes[0].sent == 2 and nodes[0].received == 2  # down to 2, up from 2 (+ hellos)
    finally:
        for n in nodes.values():
            n.close()


def test_a_peer_that_is_not_a_child_is_dropped():
    kv = KV()
    nodes = _nodes(2, [0], kv)
    try:
        host, port = kv.get("tree/0", 1).rsplit(":", 1)
        for frame in (b"\x00\x00\x00\x03{{{", b"\x00\x00\x00\x0c" + b'["H",9,""]  '):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(frame)
                s.settimeout(3)
                assert s.recv(16) == b""  # closed by the node
        assert nodes[0].connections == 0 and not nodes[0].left
    finally:
        nodes[0].close()


def test_closing_fails_what_waits():
    kv = KV()
    nodes = _nodes(2, [0, 1], kv)
    pending = nodes[0].begin(("c", 1, 0), merge.agree_value("w", "d", [], 0))
    nodes[0].close()
    with pytest.raises(TreeError) as info:
        pending.wait(5)
    assert info.value.kind == "closed"
    nodes[1].close()
    assert struct.calcsize("!I") == 4
