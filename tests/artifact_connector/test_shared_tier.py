# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shared tier of ``backend: mooncake`` (``SharedTierWriter``) on a
real ``mooncake_master`` (127.0.0.1, TCP) and real ``/dev/shm`` stores, two
"engines" in one process with their own Mooncake clients: what one
publishes the other pulls, verified, into its local store, where it stays
whatever Mooncake does later; a pull after the engine whose segment held
part of the objects went takes what survives; the first put of a key is the
one kept (as the KV pool keeps its first writer's KV); an object that fails
authentication (planted with a valid checksum, altered, or written under
another secret) is never taken, is counted, and is removed, so that the
recomputed block's genuine object takes its place (healed);
the master going away costs the publisher nothing but the mirror; a frozen
master (SIGSTOP) holds no caller, and the tier is called again after it
resumes; and the key space's terms are recorded once and enforced."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest

from vllm.config.artifact import ArtifactConfig
from vllm.config.artifact_transfer import SHARED_SECRET_ENV
from vllm.distributed.artifact_connector.mooncake import client as mc
from vllm.distributed.artifact_connector.mooncake.key_space import (
    KeySpaceMismatchError,
    KeySpaceTerms,
    agree,
    record,
    terms_key,
)
from vllm.distributed.artifact_connector.mooncake.objects import (
    HEADER,
    PREFIX,
    MooncakeObjects,
)
from vllm.distributed.artifact_connector.mooncake.tiered import SharedTierWriter
from vllm.distributed.artifact_connector.shm import ShmStoreWriter
from vllm.distributed.artifact_connector.store import (
    PutStatus,
    checksum,
)

from .helpers import key, payload, put

pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)
from utils.mooncake import running_master  # noqa: E402

LARGEST = 6208  # the largest object the tests put
PULL_S = 1.0  # shared_pull_timeout_s's default
SECRET = b"the unit tests' key space secret"


@pytest.fixture(autouse=True)
def deployment_secret(monkeypatch):
    """Every engine of the key space is given the same secret."""
    monkeypatch.setenv(SHARED_SECRET_ENV, SECRET.decode())


def mirrored(writer: SharedTierWriter, n: int) -> tuple[int, int]:
    """(puts, failures) once ``n`` objects' mirrors have ended: the mirror
    runs on the shared tier's thread, after ``put_batch`` returned."""
    deadline = time.monotonic() + 30
    while True:
        st = writer.stats()
        if st.shared_puts + st.shared_failures >= n or time.monotonic() > deadline:
            return st.shared_puts, st.shared_failures
        time.sleep(0.01)


@pytest.fixture
def master():
    with running_master("mooncake-master-shared-tier") as m:
        yield m


def _cfg(master) -> ArtifactConfig:
    return ArtifactConfig(
        backend="mooncake",
        key_space="unit",
        mooncake_master=master.address,
        mooncake_segment_bytes=32 << 20,
        mooncake_buffer_bytes=8 << 20,
    )


@pytest.fixture
def engines(master, shm_root):
    """Two writers, each with its own local store and Mooncake client
    (different segment sizes: separate clients, as in two processes)."""
    cfg = _cfg(master)
    out = []
    for seg in (32 << 20, 16 << 20):
        client = mc.acquire(cfg, segment_bytes=seg)
        local = ShmStoreWriter(shm_root, uuid.uuid4().hex)
        out.append(
            SharedTierWriter(local, cfg, max_object_nbytes=LARGEST, client=client)
        )
    yield out
    for w in out:
        w.close()


def _raw(master):
    """A plain client of the master (the test's hand behind the engines)."""
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    assert (
        c.setup("127.0.0.1", "P2PHANDSHAKE", 0, 8 << 20, "tcp", "", master.address) == 0
    )
    return c


def pull(writer: SharedTierWriter, keys: list[str], tag: str = "req") -> bool:
    """Pull ``keys`` as the publication thread does before a hit on KV
    another engine computed is taken; returns whether it ran on the tier's
    thread (False: it ended at once, nothing to do or the tier paused)."""
    ended = threading.Event()
    if writer.pull(tag, keys, ended.set):
        assert writer.pulled() == []
        return False
    assert ended.wait(60), "the pull never ended"
    assert writer.pulled() == [tag]
    return True


def test_what_one_engine_publishes_the_other_pulls(engines):
    a, b = engines
    items = [(key(i), payload(i, 6208)) for i in range(40)]
    res = put(a, items)
    assert set(res.statuses) == {PutStatus.WRITTEN}
    assert mirrored(a, 40) == (40, 0)
    keys = [k for k, _ in items]
    assert b.lookup(keys) == [None] * 40  # b never had them
    assert pull(b, keys + [key(99)])
    # Pulled into b's own store, where retention and the reader find them.
    assert b.lookup(keys + [key(99)]) == list(res.refs) + [None]
    assert b.stats().shared_pulls == 40
    assert not pull(b, keys)  # local now: nothing to ask the tier
    assert b.stats().shared_pulls == 40


def test_pulled_objects_stay_whatever_mooncake_does_later(engines, master):
    a, b = engines
    items = [(key(i), payload(i, 1000)) for i in range(8)]
    put(a, items)
    assert mirrored(a, 8) == (8, 0)
    keys = [k for k, _ in items]
    assert pull(b, keys)
    b.retain("req#1", keys)
    raw = _raw(master)
    try:
        assert raw.remove_by_regex("^" + PREFIX, True) == 8  # gone from Mooncake
    finally:
        raw.close()
    assert [r.key for r in b.lookup(keys)] == keys  # still here, retained
    assert b.stats().retained_keys == 8
    assert b.release("req#1") == 8


def test_a_pull_after_an_engine_goes_takes_what_survives(engines, master):
    """Mooncake places each object in one of the clients' segments and drops
    it with that segment: when an engine goes, a pull takes what is left,
    each object verified and equal to what was published, and the rest
    stays missing (the scheduler recomputes those blocks)."""
    a, b = engines
    items = [(key(i), payload(i, 3000)) for i in range(40)]
    refs = put(a, items).refs
    assert mirrored(a, 40) == (40, 0)
    keys = [k for k, _ in items]
    a.close()  # its client and segment go
    assert pull(b, keys)
    got = b.lookup(keys)
    assert all(g == r for g, r in zip(got, refs) if g is not None)


def _shared_view(master, keys: list[str], secret: bytes = SECRET):
    """What a reader holding ``secret`` gets for ``keys`` from the tier:
    (objects, bytes, rejected keys)."""
    client = mc.acquire(_cfg(master), segment_bytes=0)
    try:
        shared = MooncakeObjects(
            client, master.address, secret=secret, max_object_nbytes=LARGEST
        )
        try:
            return shared.fetch(keys)
        finally:
            shared.close()
    finally:
        mc.release(client)


def test_the_first_put_of_a_key_is_kept(engines, master):
    """Two engines computed one block with different routes (a near-tie
    routed the other way in another batch): the tier keeps the first one,
    as the KV pool keeps the first KV stored, so a hit that loads the pool's
    KV gets the routes of the engine that computed it."""
    a, b = engines
    k = key(7)
    (ra,) = put(a, [(k, b"A" * 500)]).refs
    assert mirrored(a, 1) == (1, 0)
    (rb,) = put(b, [(k, b"B" * 500)]).refs  # b computed the block otherwise
    assert mirrored(b, 1) == (1, 0)
    assert ra.checksum != rb.checksum
    (current,), data, rejected = _shared_view(master, [k])
    assert rejected == []
    assert current == ra  # the first put stays
    assert bytes(data) == b"A" * 500
    # Each engine's own store keeps its own version for its own requests.
    assert a._local.lookup([k]) == [ra] and b._local.lookup([k]) == [rb]


def _plant(master, k: str, header: np.ndarray, body: bytes) -> None:
    """Write ``vllm-artifact/<k>`` as anyone who reaches the master can."""
    bad = np.zeros(HEADER.itemsize + len(body), np.uint8)
    bad[: HEADER.itemsize].view(HEADER)[0] = header
    bad[HEADER.itemsize :] = np.frombuffer(body, np.uint8)
    raw = _raw(master)
    try:
        assert raw.register_buffer(bad.ctypes.data, bad.nbytes) == 0
        ptr, n = bad.ctypes.data, bad.nbytes
        assert raw.batch_upsert_from([PREFIX + k], [ptr], [n]) == [0]
        raw.unregister_buffer(bad.ctypes.data)
    finally:
        raw.close()


@pytest.mark.parametrize("planted", ["forged", "altered"])
def test_an_object_without_a_valid_mac_is_refused(engines, master, planted):
    """Objects planted by someone who reaches the master, with a checksum
    that matches their bytes (what the fork's own encoder would write), are
    treated as missing: nothing is taken, the block is recomputed, and the
    refusal is counted."""
    a, b = engines
    k, body = key(3), payload(4, 2000)
    header = np.zeros((), HEADER)
    header["checksum"], header["nbytes"] = checksum(memoryview(body)), len(body)
    if planted == "altered":
        # A's genuine object, its MAC kept, its bytes replaced.
        put(a, [(k, payload(3, 2000))])
        assert mirrored(a, 1) == (1, 0)
        client = mc.acquire(_cfg(master), segment_bytes=0)
        try:
            slot = np.zeros(HEADER.itemsize + LARGEST, np.uint8)
            assert client.register_buffer(slot.ctypes.data, slot.nbytes) == 0
            assert client.batch_get_into(
                [PREFIX + k], [slot.ctypes.data], [slot.nbytes]
            ) == [HEADER.itemsize + 2000]
            header["mac"] = slot[: HEADER.itemsize].view(HEADER)[0]["mac"]
            client.unregister_buffer(slot.ctypes.data)
        finally:
            mc.release(client)
    _plant(master, k, header, body)
    assert pull(b, [k])
    assert b.lookup([k]) == [None]  # nothing taken: the block is recomputed
    st = b.stats()
    assert (st.shared_pulls, st.shared_rejected) == (0, 1)
    # Removed from the tier: b's recomputation of the block puts a genuine
    # object in its place, which every engine then takes (healed).
    refs, _, rejected = _shared_view(master, [k])
    assert (refs, rejected) == ([], [])
    (genuine,) = put(b, [(k, payload(3, 2000))]).refs
    assert mirrored(b, 1) == (1, 0)
    (now,), data, rejected = _shared_view(master, [k])
    assert (now, rejected) == (genuine, [])
    assert bytes(data) == payload(3, 2000)


def test_objects_of_another_secret_are_refused(engines, master):
    """Objects written under one secret fail authentication under another
    (an engine given another secret cannot join the key space at all: see
    the terms test)."""
    a, _ = engines
    items = [(key(i), payload(i, 6208)) for i in range(4)]
    put(a, items)
    assert mirrored(a, 4) == (4, 0)
    keys = [k for k, _ in items]
    refs, _, rejected = _shared_view(master, keys, secret=b"another secret 123")
    assert (refs, rejected) == ([], keys)
    refs, _, rejected = _shared_view(master, keys)  # a reader removes nothing
    assert (len(refs), rejected) == (4, [])


def test_master_down_costs_the_publisher_only_the_mirror(engines, master):
    a, b = engines
    put(a, [(key(0), payload(0, 3000))])
    assert mirrored(a, 1) == (1, 0)
    master.stop()
    res = put(a, [(key(1), payload(1, 3000))])  # stored locally all the same
    assert res.statuses == (PutStatus.WRITTEN,)
    assert a._local.lookup([key(1)]) == list(res.refs)
    assert mirrored(a, 2) == (1, 1)
    # Within the back-off the next put does not call the master.
    put(a, [(key(2), payload(2, 3000))])
    assert mirrored(a, 3) == (1, 2)
    pull(b, [key(1)])  # fails on the tier's thread, or is skipped
    assert b.lookup([key(1)]) == [None]


def test_a_frozen_master_holds_no_caller_past_its_deadline(engines, master):
    """SIGSTOP: Mooncake's calls would wait up to its own 30 s RPC timeout.
    A put returns at once (its mirror is skipped), a pull returns at once
    and does not end while the master is frozen, and once the call in the
    tier has overrun its deadline later pulls end at once (the scheduler
    stops waiting for them); after SIGCONT the tier is used again."""
    a, b = engines
    put(a, [(key(1), payload(1, 3000))])
    assert mirrored(a, 1) == (1, 0)
    ended = threading.Event()
    os.kill(master.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        res = put(a, [(key(i), payload(i, 3000)) for i in range(2, 6)])
        assert res.statuses == (PutStatus.WRITTEN,) * 4
        put_s = time.monotonic() - t0
        t0 = time.monotonic()
        assert not b.pull("frozen", [key(1)], ended.set)
        pull_s = time.monotonic() - t0
        assert not ended.wait(PULL_S + 0.5)  # the call hangs in Mooncake
        t0 = time.monotonic()
        assert b.pull("later", [key(1)], threading.Event().set)  # paused
        again_s = time.monotonic() - t0
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    assert put_s < PULL_S  # the put never waited for the mirror
    assert pull_s < 0.1 and again_s < 0.1  # the caller never waits
    # Resumed: the pull in flight ends, and pulls work after the pause.
    assert ended.wait(60) and b.pulled() == ["frozen"]
    deadline = time.monotonic() + 30
    while b.lookup([key(1)]) == [None]:
        assert time.monotonic() < deadline, "the tier never came back"
        pull(b, [key(1)], tag=f"retry-{time.monotonic()}")
        time.sleep(0.2)
    assert b.stats().shared_pulls >= 1


def test_key_space_terms_are_recorded_once_and_enforced(master):
    cfg = _cfg(master)
    terms = KeySpaceTerms("m", "sha256", "00" * 32, 32, "2x2 uint8", "5e")
    client = mc.acquire(cfg, segment_bytes=32 << 20)
    other = mc.acquire(cfg, segment_bytes=16 << 20)
    try:
        agree(client, master.address, "ks", terms, SECRET)  # records
        agree(other, master.address, "ks", terms, SECRET)  # agrees
        elsewhere = KeySpaceTerms("x", "xxhash", "11", 16, "r", "5e")
        agree(other, master.address, "ks2", elsewhere, SECRET)
        wrong = KeySpaceTerms("m", "sha256", "ff" * 32, 64, "2x2 uint8", "0f")
        with pytest.raises(KeySpaceMismatchError) as exc:
            agree(other, master.address, "ks", wrong, SECRET)
        msg = str(exc.value)
        assert "none_hash" in msg and "PYTHONHASHSEED" in msg
        assert "block_size: this engine 64, the key space 32" in msg
        assert "secret_id: this engine '0f', the key space '5e'" in msg
        assert "give every engine the same deployment secret" in msg
        assert "model:" not in msg  # what agrees is not named
    finally:
        mc.release(other)
        mc.release(client)


def test_terms_that_disagree_after_a_master_restart_stop_sharing(master, shm_root):
    """After a master restart another engine recorded other terms first: the
    engine stops sharing (pulls end at once, so the hits are recomputed;
    mirrors are skipped and counted) until the terms agree again."""
    cfg = _cfg(master)
    mine = KeySpaceTerms("m", "sha256", "00" * 32, 32, "2x2 uint8", "5e")
    theirs = KeySpaceTerms("m", "sha256", "ff" * 32, 32, "2x2 uint8", "5e")
    client = mc.acquire(cfg, segment_bytes=32 << 20)
    other = mc.acquire(cfg, segment_bytes=16 << 20)
    w = SharedTierWriter(
        ShmStoreWriter(shm_root, uuid.uuid4().hex),
        cfg,
        max_object_nbytes=LARGEST,
        client=client,
        rejoin=lambda: agree(client, master.address, "restart", mine, SECRET),
    )

    def check_terms() -> None:
        w._next_terms = 0.0  # the check is due (every TERMS_INTERVAL_S)
        w.maintain()

    try:
        agree(other, master.address, "restart", theirs, SECRET)  # recorded first
        deadline = time.monotonic() + 30
        while pull(w, [key(50)]):  # a pull that runs: still sharing
            assert time.monotonic() < deadline, "sharing never stopped"
            check_terms()
            time.sleep(0.05)
        failures = w.stats().shared_failures
        put(w, [(key(51), payload(51, 100))])
        assert w.stats().shared_failures == failures + 1  # not mirrored
        # The terms agree again (here: the conflicting record goes).
        assert (
            other.remove(terms_key("restart", SECRET), True) == 0
        )  # forced: read leases
        deadline = time.monotonic() + 30
        while not pull(w, [key(52)]):
            assert time.monotonic() < deadline, "sharing never resumed"
            check_terms()
            time.sleep(0.05)
    finally:
        w.close()
        mc.release(other)


def test_an_acknowledgement_waits_for_its_own_mirrors_only(engines, master, shm_root):
    """r5 M2: with the master frozen, mirrors stay in flight; what an
    acknowledgement naming some keys waits for is the mirror holding those
    keys, not the mirrors queued before it; keys with no mirror in flight
    (and every key of an engine no other engine is sent to, a
    ``kv_consumer``) wait for nothing. Once the master answers, nothing is
    left to wait for."""
    a, _ = engines
    cfg = _cfg(master)
    consumer = SharedTierWriter(
        ShmStoreWriter(shm_root, uuid.uuid4().hex),
        cfg,
        max_object_nbytes=LARGEST,
        client=mc.acquire(cfg, segment_bytes=24 << 20),
        settles=False,
    )
    try:
        put(a, [(key(0), payload(0, 3000))])
        assert mirrored(a, 1) == (1, 0)
        assert a.mirroring([key(0)]) == []  # mirrored: nothing to wait for
        master.freeze(resume_after_s=60.0)
        put(a, [(key(1), payload(1, 3000))])
        put(a, [(key(2), payload(2, 3000)), (key(3), payload(3, 3000))])
        first, second = a.mirroring([key(1)]), a.mirroring([key(2), key(3)])
        assert len(first) == 1 and len(second) == 1 and first[0] is not second[0]
        assert not first[0].is_set() and not second[0].is_set()
        assert a.mirroring([key(0), key(9)]) == []
        put(consumer, [(key(4), payload(4, 3000))])
        assert consumer.mirroring([key(4)]) == []
        master.thaw()
        assert first[0].wait(60) and second[0].wait(60)
        assert a.mirroring([key(1), key(2), key(3)]) == []
    finally:
        master.thaw()
        consumer.close()


def test_planted_terms_are_replaced_and_the_engine_joins(master):
    """r5 M3: someone who reaches the master (without the secret) writes a
    terms record for the key space before the first engine: at the name
    the old code used (public), and, stronger, at the engine's own name (as
    if it leaked). The engine treats the unauthenticated record as absent:
    it joins, and the record is its own, authenticated."""
    cfg = _cfg(master)
    mine = KeySpaceTerms("Qwen/Qwen3-30B-A3B", "sha256", "ab" * 32, 16,
                         "48x8 uint8", "5e")  # fmt: skip
    raw = _raw(master)
    engine = mc.acquire(cfg, segment_bytes=32 << 20)
    try:
        planted = b'{"model": "attacker"}'
        public = "vllm-artifact-key-space/" + hashlib.sha256(b"rollout-7").hexdigest()
        assert raw.put(public, planted) == 0
        assert raw.put(terms_key("rollout-7", SECRET), b"\0" * 32 + planted) == 0
        agree(engine, master.address, "rollout-7", mine, SECRET)  # joins
        assert raw.get(terms_key("rollout-7", SECRET)) == record(
            "rollout-7", mine, SECRET
        )
        # Another engine of the same secret agrees with what was recorded.
        agree(engine, master.address, "rollout-7", mine, SECRET)
        # A genuine difference is still a mismatch, named as one.
        other = dataclasses.replace(mine, block_size=32)
        with pytest.raises(KeySpaceMismatchError, match="block_size"):
            agree(engine, master.address, "rollout-7", other, SECRET)
    finally:
        mc.release(engine)
        raw.close()


def test_a_genuine_put_replaces_an_object_planted_before_it(engines, master):
    """r5 item 12: an object planted at a key before the engine that computes
    the block writes it would have kept the key (Mooncake's put leaves an
    existing object and reports success), the genuine write vanishing while
    counted as published. The engine's mirror finds the key taken by an
    object that fails authentication, removes it and writes its own: a
    fetch then takes the genuine object."""
    a, _ = engines
    k, body = key(11), payload(11, 2000)
    forged = payload(12, 2000)
    header = np.zeros((), HEADER)
    header["checksum"], header["nbytes"] = checksum(memoryview(forged)), len(forged)
    _plant(master, k, header, forged)
    (genuine,) = put(a, [(k, body)]).refs
    assert mirrored(a, 1) == (1, 0)
    (now,), data, rejected = _shared_view(master, [k])
    assert (now, rejected) == (genuine, [])
    assert bytes(data) == body


@pytest.mark.parametrize(
    "rc, named, unnamed",
    [
        (-707, "lease expired", "mooncake_master running"),
        (-800, "transfer", "mooncake_master running"),
        (-101, "segment", "mooncake_master running"),
        (-900, "mooncake_master running", "lease"),
    ],
)
def test_mooncake_errors_are_named_as_what_they_are(engines, rc, named, unnamed):
    """r5 item 12: a read that fails with Mooncake's "lease expired" (the
    master up, a transfer too slow) is not reported as a master that is
    down; each of Mooncake's error codes is named (mooncake/types.h)."""
    a, _ = engines
    with pytest.raises(mc.MooncakeUnavailableError) as exc:
        a._shared._raise_for(np.array([rc]), [key(1)])
    msg = str(exc.value)
    assert named in msg.lower() and unnamed not in msg.lower(), msg
    assert str(rc) in msg
