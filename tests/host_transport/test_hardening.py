# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests of issue 11 ("Host transport, hardened"), one or more per item."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time

import torch

from vllm_host_transport import SCOPE_ENV, HostTransportConnector
from vllm_host_transport import connector as connmod
from vllm_host_transport import ring as ringmod
from vllm_host_transport import sender as sendmod

from . import helpers
from .conftest import TINY_RING, scope_path


# ------------------------------------------------- 1. memory ordering
def test_fences_order_publication_claim_and_reuse(make_conn, monkeypatch):
    """A fence sits between a frame's bytes and the head that publishes it,
    between the head a receiver reads and the bytes it copies, between that
    copy and DONE, and between reading DONE and reusing the slot."""
    prod, recv = make_conn(TINY_RING), make_conn(TINY_RING)
    prod.put("p", "c", "warm", 0)
    assert recv.get("p", "c", "warm")[0] == 0
    ring = prod._sender._edges[("p", "c")].ring
    pos = ring.head
    slot = ringmod.HEADER_SIZE + pos % ring.capacity + ringmod.STATE_OFF
    events: list[tuple[int, int, int]] = []

    def spy() -> None:  # what the shared memory holds when the fence runs
        q = ring._q
        events.append((q[ringmod.Q_HEAD], q[ringmod.Q_TAIL], ring._mv[slot]))

    monkeypatch.setattr(ringmod, "memory_fence", spy)
    prod.put("p", "c", "k", {"t": torch.arange(8)})
    # Producer: the frame is READY, the head does not show it yet.
    assert events == [(pos, ring.tail, ringmod.READY)]
    head = ring.head
    assert head > pos
    events.clear()
    r = recv.get("p", "c", "k")
    assert r is not None and torch.equal(r[0]["t"], torch.arange(8))
    # Receiver: after reading the head (before the record), and after the
    # copy (before DONE).
    assert events == [(head, ring.tail, ringmod.READY)] * 2
    assert ring._mv[slot] == ringmod.DONE
    events.clear()
    tail = ring.tail
    prod.health()  # reclaims
    assert events == [(head, tail, ringmod.DONE)]  # before the tail moves
    assert ring.tail == head


def test_fence_chosen_per_cpu_and_ring_off_without_one(make_conn, monkeypatch, caplog):
    assert ringmod.select_fence("x86_64") is ringmod._tso_fence
    try:
        ctypes.CDLL("libatomic.so.1")
        has_libatomic = True
    except OSError:
        has_libatomic = False
    arm = ringmod.select_fence("aarch64")
    if has_libatomic:
        assert arm is not None and arm is not ringmod._tso_fence
        arm()  # a real atomic_thread_fence(seq_cst)

    def no_lib(*a, **k):
        raise OSError("libatomic.so.1: cannot open shared object file")

    monkeypatch.setattr(ringmod.ctypes, "CDLL", no_lib)
    assert ringmod.select_fence("aarch64") is None
    assert ringmod.select_fence("x86_64") is ringmod._tso_fence
    # Without a fence the connector says so at start-up and keeps the ring off.
    monkeypatch.setattr(ringmod, "FENCE_AVAILABLE", False)
    with caplog.at_level(logging.WARNING):
        c = make_conn(TINY_RING)
    assert any("no memory fence" in r.getMessage() for r in caplog.records)
    assert c.put("p", "c", "k", "v")[2]["plane"] == "key"
    assert c.get("p", "c", "k")[0] == "v"
    assert c.health()["rings_owned"] == 0


# ------------------------------------- 2. a re-put never serves the old one
def test_reput_while_ring_lock_busy_never_serves_old_version(make_conn):
    prod, recv = make_conn(TINY_RING), make_conn(TINY_RING)
    _, _, desc = prod.put("p", "c", "k", "v1")  # ring
    _, _, desc_j = prod.put("p", "c", "j", "j1")  # ring
    assert desc["plane"] == "ring"
    held, release = helpers.CTX.Event(), helpers.CTX.Event()
    holder = helpers.CTX.Process(
        target=helpers.hold_lock_on,
        args=(os.path.join(prod.scope_dir, desc["ring"]), held, release),
    )
    holder.start()
    try:
        assert held.wait(30)
        # The retire of v1 cannot get the ring lock; v2 is too large for the
        # ring and goes per-key.
        ok, _, d2 = prod.put("p", "c", "k", "v2" * 1000)
        assert ok and d2["plane"] == "key"
        # Same for a small re-put that stays on the ring.
        ok, _, dj = prod.put("p", "c", "j", "j2")
        assert ok and dj["plane"] == "ring"
        # And a cleanup.
        prod.put("p", "c", "gone", "x")
        assert prod.cleanup("gone") is True
    finally:
        release.set()
        holder.join(30)
    assert recv.get("p", "c", "k", descriptor=desc)[0] == "v2" * 1000
    assert recv.get("p", "c", "k") is None
    assert recv.get("p", "c", "j", descriptor=desc_j)[0] == "j2"
    assert recv.get("p", "c", "j") is None
    assert recv.get("p", "c", "gone") is None
    h = prod.health()
    assert h["retire_deferred"] == 3 and h["pending_retires"] == 3
    # The deferred retires are retried by later puts; the ring space returns.
    prod.put("p", "c", "later", 1)
    h = prod.health()
    assert h["pending_retires"] == 0 and h["ring_bytes_in_use"] > 0
    assert recv.get("p", "c", "later")[0] == 1
    assert prod.health()["ring_bytes_in_use"] == 0


def test_receiver_attaching_late_skips_superseded_frame(make_conn):
    """A receiver that scans the ring from the start sees the old READY frame
    and then the later record of its key: it must not take the old one."""
    prod = make_conn(TINY_RING)
    _, _, desc = prod.put("p", "c", "k", "old")
    held, release = helpers.CTX.Event(), helpers.CTX.Event()
    holder = helpers.CTX.Process(
        target=helpers.hold_lock_on,
        args=(os.path.join(prod.scope_dir, desc["ring"]), held, release),
    )
    holder.start()
    try:
        assert held.wait(30)
        prod.put("p", "c", "k", "new" * 500)  # per-key; old not retired
    finally:
        release.set()
        holder.join(30)
    late = make_conn(0)
    assert late.get("p", "c", "k")[0] == "new" * 500
    assert late.get("p", "c", "k") is None


def test_superseded_frame_is_dropped_not_spilled(make_conn, monkeypatch):
    """A frame superseded while its retire was deferred is withdrawn, never
    moved to a segment, when the ring needs its space."""
    # The deferred retire is not retried (as if the lock were still busy
    # then), so the spill meets the superseded frame first.
    monkeypatch.setattr(sendmod.Sender, "_retry_pending", lambda self, edge: None)
    prod = make_conn(TINY_RING, ring_wait_s=0.0, ring_spill_age_s=0.0)
    recv = make_conn(TINY_RING)
    _, _, desc = prod.put("p", "c", "k", "old")
    held, release = helpers.CTX.Event(), helpers.CTX.Event()
    holder = helpers.CTX.Process(
        target=helpers.hold_lock_on,
        args=(os.path.join(prod.scope_dir, desc["ring"]), held, release),
    )
    holder.start()
    try:
        assert held.wait(30)
        prod.put("p", "c", "k", "new" * 500)  # per-key; the old retire deferred
    finally:
        release.set()
        holder.join(30)
    for i in range(12):  # fill the ring: its oldest frame is the old version
        prod.put("p", "c", f"f{i}", {"t": torch.full((40,), i)})
    assert prod.health()["ring_spilled"] > 0
    assert recv.get("p", "c", "k")[0] == "new" * 500
    assert recv.get("p", "c", "k") is None


# ------------------------------------------------------- 3. no wedged ring
def test_unclaimed_frame_does_not_wedge_ring(make_conn):
    prod = make_conn(TINY_RING, ring_wait_s=0.0, ring_spill_age_s=0.05)
    recv = make_conn(TINY_RING)
    prod.put("p", "c", "orphan", {"t": torch.full((40,), -1)})
    time.sleep(0.1)  # the orphan is now older than ring_spill_age_s
    h = prod.health()
    assert h["oldest_unclaimed_age_s"] >= 0.05
    for i in range(100):  # wraps the 4 KiB ring many times
        assert prod.put("p", "c", f"k{i}", {"t": torch.full((40,), i)})[0]
        r = recv.get("p", "c", f"k{i}")
        assert r is not None and int(r[0]["t"][0]) == i
    h = prod.health()
    assert h["fallback_ring_full"] == 0 and h["fallback_rate"] == 0.0
    assert h["ring_puts"] == 101 and h["ring_spilled"] == 1
    assert h["oldest_unclaimed_age_s"] == 0.0
    # The orphan was moved, not dropped.
    r = recv.get("p", "c", "orphan")
    assert r is not None and int(r[0]["t"][0]) == -1


def test_health_reports_fallback_rate_and_oldest_age(make_conn):
    prod = make_conn(TINY_RING, ring_wait_s=0.0, ring_spill_age_s=3600.0)
    for i in range(12):  # nobody receives: the ring fills, then falls back
        prod.put("p", "c", f"s{i}", {"t": torch.full((40,), i)})
    h = prod.health()
    assert 0 < h["fallbacks"] < 12
    assert h["fallback_rate"] == h["fallbacks"] / 12
    assert h["oldest_unclaimed_age_s"] > 0.0
    assert h["ring_spilled"] == 0


# --------------------------------------------------------- 4. fork safety
def test_forked_child_closing_inherited_connector_leaves_parent_alone(make_conn):
    prod, recv = make_conn(TINY_RING), make_conn(TINY_RING)
    prod.put("p", "c", "before", 1)
    out = helpers.CTX.Queue()
    child = helpers.CTX.Process(target=helpers.close_inherited, args=(prod, out))
    child.start()
    assert out.get(timeout=60) is False  # a child cannot publish through it
    child.join(30)
    assert child.exitcode == 0
    ok, _, desc = prod.put("p", "c", "after", 2)
    assert ok and desc["plane"] == "ring"
    assert recv.get("p", "c", "before")[0] == 1
    assert recv.get("p", "c", "after")[0] == 2
    assert recv.get("p", "c", "from-child") is None
    assert [n for n in os.listdir(prod.scope_dir) if n.startswith("ring-")]


def test_scope_reusable_while_a_forked_child_holds_inherited_descriptors(
    scope, make_conn
):
    """The last connector's teardown releases its directory lock explicitly:
    a child that inherited the descriptor must not keep the scope locked."""
    c = make_conn(TINY_RING)
    c.put("p", "c", "k", 1)
    # A name the transport does not own keeps the directory (and its inode).
    foreign = os.path.join(c.scope_dir, "not-ours")
    open(foreign, "w").close()
    release = helpers.CTX.Event()
    child = helpers.CTX.Process(target=helpers.linger, args=(release,))
    child.start()
    try:
        c.close()  # the last one: removes what it owns
        assert os.listdir(scope_path(scope)) == ["not-ours"]
        again = make_conn(TINY_RING)  # would wait for the child's copy
        again.put("p", "c", "k", 2)
        assert again.get("p", "c", "k")[0] == 2
    finally:
        release.set()
        child.join(30)
        os.unlink(foreign)


# ------------------------------------------ 5. two connectors, one process
def test_two_connectors_in_one_process_are_both_delivered(make_conn, ring_bytes):
    a, b, r = make_conn(TINY_RING), make_conn(TINY_RING), make_conn(ring_bytes)
    assert a.put("p", "c", "ka", "from-a")[2]["plane"] == "ring"
    assert b.put("p", "c", "kb", "from-b")[2]["plane"] == "ring"
    assert r.get("p", "c", "ka")[0] == "from-a"
    assert r.get("p", "c", "kb")[0] == "from-b"
    assert r.health()["rings_mapped"] == 2
    a.close()  # must not take b's ring with it
    assert b.put("p", "c", "kb2", "again")[2]["plane"] == "ring"
    assert r.get("p", "c", "kb2")[0] == "again"


# --------------------------------------- 6. the receive path never waits
def test_get_not_blocked_by_stamp_lock_while_pruning(scope, make_conn):
    recv = make_conn(TINY_RING)
    dead = helpers.CTX.Process(
        target=helpers.put_then_die, args=(scope, TINY_RING, "k", "stale")
    )
    dead.start()
    dead.join(30)
    held, release = helpers.CTX.Event(), helpers.CTX.Event()
    holder = helpers.CTX.Process(
        target=helpers.hold_lock_on,
        args=(os.path.join(recv.scope_dir, "stamp"), held, release),
    )
    holder.start()
    results: list[object] = []
    try:
        assert held.wait(30)
        # The first get discovers the dead producer's ring and prunes it,
        # which advances the stamp: that lock is held by another process.
        t = threading.Thread(
            target=lambda: results.append(recv.get("p", "c", "k")), daemon=True
        )
        t.start()
        t.join(30)
        assert not t.is_alive(), "get waited on the stamp lock"
    finally:
        release.set()
        holder.join(30)
        t.join(30)
    assert results == [None]
    assert recv.health()["dead_producers_pruned"] == 1


# --------------------------------------------- 7. trust boundaries
def test_struct_of_unlisted_type_is_refused_without_import(scope, make_conn):
    recv = make_conn(TINY_RING)
    done, exit_ev = helpers.CTX.Event(), helpers.CTX.Event()
    p = helpers.CTX.Process(target=helpers.put_canary, args=(scope, done, exit_ev))
    p.start()
    try:
        assert done.wait(30)
        assert recv.get("p", "c", "k") is None
        assert recv.health()["corrupt_frames"] == 1
        assert "tests.host_transport._canary" not in sys.modules
    finally:
        exit_ev.set()
        p.join(30)


def test_pickled_value_in_a_frame_is_refused(make_conn, monkeypatch):
    """Even with vLLM's insecure serialization switched on, a frame's pickled
    value is never unpickled by a receiver."""
    import pickle

    import msgspec

    from vllm_host_transport import serial as serialmod

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    c = make_conn(TINY_RING)
    pickled = msgspec.msgpack.Ext(1, pickle.dumps({"unpickled": True}))
    monkeypatch.setattr(
        serialmod._serial_classes()[0],  # the serializer's encoder class
        "encode",
        lambda self, obj: [msgspec.msgpack.encode(pickled)],
    )
    assert c.put("p", "c", "k", slice(1, 2))[0]  # forced onto the serializer
    assert c.get("p", "c", "k") is None
    assert c.health()["corrupt_frames"] == 1


def test_derived_scope_is_announced(monkeypatch, caplog):
    monkeypatch.delenv(SCOPE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger=connmod.logger.name):
        c = HostTransportConnector()
    try:
        derived = f"sid-{os.getsid(0)}"
        assert c.scope_name == derived
        msgs = [r.getMessage() for r in caplog.records]
        assert any(f"{SCOPE_ENV}={derived}" in m for m in msgs), msgs
    finally:
        c.close()


# ------------------------------------------------------ 8. housekeeping
def test_scope_directory_removed_when_last_connector_closes(scope, make_conn):
    prod, recv = make_conn(TINY_RING), make_conn(TINY_RING)
    prod.put("p", "c", "a", 1)
    prod.put("p", "c", "big", "x" * 4000)  # per-key, never claimed
    assert recv.get("p", "c", "a")[0] == 1
    prod.put("p", "c", "b", 2)  # never claimed
    prod.close()
    assert os.path.isdir(scope_path(scope))  # the receiver still uses it
    recv.close()
    assert not os.path.exists(scope_path(scope))
    # A new connector of the scope starts from scratch.
    again = make_conn(TINY_RING)
    again.put("p", "c", "x", 3)
    assert again.get("p", "c", "x")[0] == 3
    again.close()
    assert not os.path.exists(scope_path(scope))


# -------------------------------------------------------- 9. flood
def test_flood_stays_on_the_ring(scope, make_conn):
    n = 200
    prod = make_conn(64 << 10, ring_wait_s=30.0)
    ready, out = helpers.CTX.Event(), helpers.CTX.Queue()
    p = helpers.CTX.Process(
        target=helpers.drain_in_order, args=(scope, 64 << 10, n, ready, out)
    )
    p.start()
    assert ready.wait(30)
    for i in range(n):  # unbounded: no waiting for the receiver
        assert prod.put("p", "c", f"k{i}", {"t": torch.full((1024,), i)})[0]
    assert out.get(timeout=120) == list(range(n))
    p.join(30)
    h = prod.health()
    assert h["fallbacks"] == 0 and h["ring_puts"] == n
