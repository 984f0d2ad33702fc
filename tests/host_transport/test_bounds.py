# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Issue 27, the host transport's side: a squatted scope falls back to a
fresh private one, nothing a producer published outlives it (a clean close
withdraws it, a SIGKILLed producer's leftovers go with the next connector
or receive in the scope), the tracked keys are a bound that is enforced,
and a fetch of a released or missing reference answers at once. Real processes, the
real /dev/shm."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import threading
import time
import uuid

import numpy as np
import pytest

from vllm_host_transport import HostTransportConfig, HostTransportConnector
from vllm_host_transport import connector as connmod
from vllm_host_transport import sender as sendmod
from vllm_host_transport.discovery import ScopeDir, ScopeSquattedError
from vllm_host_transport.routed_experts import (
    EDGE,
    RoutedExpertsRef,
    RouteRefMissingError,
    RouteRefTransportError,
    fetch,
)
from vllm_host_transport.routed_experts import close as close_fetch
from vllm_host_transport.routes_format import encode
from vllm_host_transport.routes_reader import release
from vllm_host_transport.shared import edge_hex, key_hash, seg_name

from . import helpers
from .conftest import TINY_RING, scope_path

NOBODY = 65534
BIG = 8192  # bytes: above a quarter of the 4 KiB test ring, so per-key


def _conn(scope: str, ring: int = TINY_RING, **kw) -> HostTransportConnector:
    return HostTransportConnector(
        HostTransportConfig(host_ring_bytes=ring, scope=scope, **kw)
    )


def _leftovers(path: str, pid: int | None = None) -> list[str]:
    """Payload files (rings, segments, registrations) in a scope directory,
    of producer ``pid`` if given (segments name no pid: all of them)."""
    names = os.listdir(path) if os.path.isdir(path) else []
    return sorted(
        n
        for n in names
        if n.endswith(".seg")
        or (n.startswith(("ring-", "member-")) and (pid is None or f"-{pid}-" in n))
    )


def _fallback_dirs(scope: str) -> list[str]:
    base = ScopeDir.dir_name(scope)
    return [n for n in os.listdir("/dev/shm") if n.startswith(base + "-")]


@pytest.fixture
def squatted(scope):
    """Yields a function making the scope's directory a squatter's: another
    user's directory (``nobody``; needs root, as in CI), our directory with
    group/other access, a symlink, a file. Everything is removed after."""
    path = scope_path(scope)
    made: list[str] = []

    def make(kind: str) -> str:
        if kind == "other-owner":
            os.mkdir(path, 0o700)
            made.append(path)
            try:
                os.chown(path, NOBODY, NOBODY)
            except PermissionError:
                pytest.skip("making a directory of another user needs root")
        elif kind == "open-mode":
            os.mkdir(path, 0o700)
            os.chmod(path, 0o755)
            made.append(path)
        elif kind == "symlink":
            target = f"/dev/shm/vht-target-{uuid.uuid4().hex}"
            os.mkdir(target, 0o700)
            made.append(target)
            os.symlink(target, path)
            made.append(path)
        else:
            with open(path, "w"):
                pass
            made.append(path)
        return path

    yield make
    for p in made:
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        else:
            shutil.rmtree(p, ignore_errors=True)
    for n in _fallback_dirs(scope):  # only if a test failed half-way
        shutil.rmtree(os.path.join("/dev/shm", n), ignore_errors=True)


def _ref(location: str, key: str, rows: np.ndarray) -> dict:
    """The reference to ``rows`` stored under ``key`` at ``location`` (as
    JSON: what a trainer gets)."""
    return RoutedExpertsRef.for_payload(
        encode(rows), transport="host", location=location, key=key
    ).to_json()


def _publish(conn: HostTransportConnector, key: str, rows: np.ndarray) -> dict:
    assert conn.put_readable(key, encode(rows).parts)
    return _ref(conn.scope_name, key, rows)


# ------------------------------------------------------ squatted scope
@pytest.mark.parametrize("kind", ["other-owner", "open-mode", "symlink", "file"])
def test_a_squatted_scope_falls_back_to_a_fresh_private_one(
    scope, squatted, caplog, kind
):
    path = squatted(kind)
    # Without the option the squatted directory is refused, typed.
    with pytest.raises(ScopeSquattedError):
        _conn(scope)
    with caplog.at_level(logging.WARNING, logger=connmod.logger.name):
        prod = _conn(scope, scope_fallback=True)
    try:
        new = prod.scope_name
        assert new.startswith(scope + "~") and len(new) == len(scope) + 17
        st = os.stat(prod.scope_dir, follow_symlinks=False)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid()
        assert prod.scope_dir == os.path.join("/dev/shm", ScopeDir.dir_name(new))
        (warning,) = [
            r.getMessage() for r in caplog.records if r.name == connmod.logger.name
        ]
        assert path in warning and repr(new) in warning
        if kind == "other-owner":
            assert "nobody" in warning or str(NOBODY) in warning
        # The consumer needs the scope name only (what a reference carries),
        # as often as it reads.
        rows = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
        big = np.ones((BIG // 12, 3, 4), dtype=np.uint8)
        small_ref = _publish(prod, "a" * 32, rows)
        big_ref = _publish(prod, "b" * 32, big)
        assert small_ref["location"] == new
        for _ in range(2):
            np.testing.assert_array_equal(fetch(small_ref), rows)
            np.testing.assert_array_equal(fetch(big_ref), big)
    finally:
        close_fetch()
        prod.close()
    assert not os.path.exists(_scope_dir(new))
    assert os.path.lexists(path)  # the squatter's is left alone


def _scope_dir(scope: str) -> str:
    return os.path.join("/dev/shm", ScopeDir.dir_name(scope))


def test_fetch_from_a_squatted_scope_is_a_route_ref_error(scope, squatted):
    squatted("other-owner")
    ref = _ref(scope, "c" * 32, np.zeros((1, 1, 1), np.uint8))
    with pytest.raises(RouteRefTransportError, match="owned by uid"):
        fetch(ref)
    for how in ({}, {"reader": 0, "readers": 2}):  # the driver's, a rank's
        with pytest.raises(RouteRefTransportError, match="owned by uid"):
            release([ref], **how)
    close_fetch()


def _put_in_fallback_then_wait(scope: str, out, release) -> None:
    c = _conn(scope, scope_fallback=True)
    c.put(*EDGE, "d" * 32, np.ones(BIG, np.uint8))
    c.put(*EDGE, "e" * 32, np.ones(8, np.uint8))
    out.put(c.scope_name)
    release.wait(60)  # SIGKILLed here


def test_a_killed_producers_fallback_scope_goes_with_the_next_fallback(scope, squatted):
    squatted("other-owner")
    out, release = helpers.CTX.Queue(), helpers.CTX.Event()
    child = helpers.CTX.Process(
        target=_put_in_fallback_then_wait, args=(scope, out, release)
    )
    child.start()
    dead_scope = out.get(timeout=60)
    assert _leftovers(_scope_dir(dead_scope))
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    # No later engine ever uses that random scope: the next one that falls
    # back removes it.
    nxt = _conn(scope, scope_fallback=True)
    try:
        assert nxt.scope_name != dead_scope
        assert not os.path.exists(_scope_dir(dead_scope))
    finally:
        nxt.close()
    assert _fallback_dirs(scope) == []


# ------------------------------------------------ a clean close, a kill
def test_a_clean_close_withdraws_everything_while_a_receiver_holds_the_scope(
    scope, make_conn
):
    prod, recv = make_conn(TINY_RING), make_conn(TINY_RING)
    prod.put("p", "c", "small", 1)
    prod.put("p", "c", "big", np.ones(BIG, np.uint8))
    assert {d for d in _leftovers(prod.scope_dir) if d.endswith(".seg")}
    prod.close()
    assert _leftovers(recv.scope_dir) == []
    assert recv.get("p", "c", "small") is None
    assert recv.get("p", "c", "big") is None


def _put_then_hang(scope: str, ring: int, done, release) -> None:
    c = _conn(scope, ring)
    for i in range(3):
        assert c.put("p", "c", f"small{i}", i)[0]
        assert c.put("p", "c", f"big{i}", np.full(BIG, i, np.uint8))[0]
    done.set()
    release.wait(60)  # SIGKILLed here


def _killed_producer(scope: str, ring: int) -> int:
    done, release = helpers.CTX.Event(), helpers.CTX.Event()
    child = helpers.CTX.Process(
        target=_put_then_hang, args=(scope, ring, done, release)
    )
    child.start()
    assert done.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    return child.pid


@pytest.mark.parametrize("ring", [TINY_RING, 0], ids=["ring4k", "perkey"])
def test_a_killed_producers_payloads_go_with_the_next_producer(scope, ring):
    recv = _conn(scope)  # holds the scope open all along
    try:
        _killed_producer(scope, ring)
        assert len([n for n in _leftovers(recv.scope_dir) if n.endswith(".seg")]) >= 3
        nxt = _conn(scope)
        try:
            assert _leftovers(nxt.scope_dir) == []
            assert nxt.health()["dead_producers_swept"] == 1
            assert nxt.health()["dead_segments_removed"] >= 3
        finally:
            nxt.close()
    finally:
        recv.close()
    assert not os.path.exists(scope_path(scope))


def test_a_killed_producers_payloads_go_with_the_next_receive(scope):
    recv = _conn(scope)  # joined before the kill: nothing to sweep then
    try:
        pid = _killed_producer(scope, TINY_RING)
        assert _leftovers(recv.scope_dir, pid)
        # Any miss looks (here: a key nobody put).
        assert recv.get("p", "c", "unrelated") is None
        assert _leftovers(recv.scope_dir) == []
        assert recv.health()["dead_producers_swept"] == 1
        assert recv.get("p", "c", "big0") is None
    finally:
        recv.close()
    assert not os.path.exists(scope_path(scope))


def _hang_in(root: str, scope: str, done, release) -> None:
    c = HostTransportConnector(HostTransportConfig(scope=scope, shm_root=root))
    assert c.put("p", "c", "big", np.ones(BIG, np.uint8))[0]
    done.set()
    release.wait(60)  # SIGKILLed here


def test_scopes_whose_producers_were_all_killed_are_collected(tmp_path):
    """An engine's default scope derives from its session id, which a
    restarted engine does not share: a killed engine's scope is collected
    by any later start on the node, not only by a join of that scope."""
    from vllm_host_transport.discovery import collect_abandoned_scopes

    root = f"/dev/shm/test-root-{uuid.uuid4().hex[:8]}"
    os.mkdir(root, 0o700)
    try:
        done, release = helpers.CTX.Event(), helpers.CTX.Event()
        child = helpers.CTX.Process(
            target=_hang_in, args=(root, "killed", done, release)
        )
        child.start()
        assert done.wait(60)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        killed = ScopeDir.dir_name("killed")
        live = HostTransportConnector(HostTransportConfig(scope="live", shm_root=root))
        try:
            # A directory being created (no stamp yet) and one not ours by
            # name are left alone.
            os.mkdir(os.path.join(root, ScopeDir.dir_name("creating")), 0o700)
            os.mkdir(os.path.join(root, "vllm-ht-other"), 0o700)
            assert killed in os.listdir(root)
            assert collect_abandoned_scopes(root) == [killed]
            assert sorted(os.listdir(root)) == sorted(
                [
                    os.path.basename(live.scope_dir),
                    ScopeDir.dir_name("creating"),
                    "vllm-ht-other",
                ]
            )
            assert collect_abandoned_scopes(root) == []
        finally:
            live.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_producer_looks_for_dead_peers_when_asked(scope):
    prod = _conn(scope)
    try:
        prod.put("p", "c", "mine", 1)
        _killed_producer(scope, 0)
        assert prod.remove_dead() == 1
        left = _leftovers(prod.scope_dir)  # its own ring and registration
        assert len(left) == 2 and all(f"-{os.getpid()}-" in n for n in left)
        assert prod.remove_dead() == 0
    finally:
        prod.close()


# ------------------------------------------------------- tracked bound
def test_the_tracked_keys_are_a_bound_the_oldest_is_withdrawn(make_conn):
    n = sendmod.MAX_TRACKED_KEYS
    assert n == 65536
    # A 32 MiB ring holds every one of them: no file per payload.
    prod, recv = make_conn(32 << 20), make_conn(TINY_RING)
    for i in range(n + 1):
        assert prod.put("p", "c", f"k{i}", i)[2]["plane"] == "ring"
    h = prod.health()
    assert h["evicted"] == 1 and h["fallbacks"] == 0
    assert recv.get("p", "c", "k0") is None  # withdrawn
    assert recv.get("p", "c", "k1")[0] == 1
    assert recv.get("p", "c", f"k{n}")[0] == n
    # Taken keys leave the tracking: the next put evicts nothing that waits.
    assert sorted(prod.taken()) == ["k1", f"k{n}"]
    prod.put("p", "c", "one-more", 0)
    assert prod.health()["evicted"] == 1
    assert recv.get("p", "c", "k2")[0] == 2


def test_taken_reports_what_receivers_took(make_conn, ring_bytes):
    prod, recv = make_conn(ring_bytes), make_conn(TINY_RING)
    prod.put("p", "c", "a", 1)
    prod.put("p", "c", "b", np.ones(BIG, np.uint8))
    prod.put("p", "c", "c", 3)
    assert prod.taken() == []
    assert recv.get("p", "c", "a")[0] == 1
    assert recv.get("p", "c", "b") is not None
    assert sorted(prod.taken()) == ["a", "b"]
    assert prod.taken() == []
    assert prod.cleanup("c")  # still tracked: withdrawn


# ------------------------------------------------- missing: at once
def _missing_at_once(ref: dict) -> None:
    t0 = time.monotonic()
    with pytest.raises(RouteRefMissingError):
        fetch(ref, timeout_s=1.0)
    assert time.monotonic() - t0 < 0.5


def test_a_released_or_missing_reference_answers_at_once(scope):
    """Fetches read a payload as often as asked until it is released: by
    the driver, or by the last of its readers; then a fetch raises
    ``RouteRefMissingError`` at once, as it does for a key never there.
    Releasing a payload that is gone already is not an error."""
    prod = _conn(scope)
    rows = np.arange(12, dtype=np.uint8).reshape(1, 3, 4)
    try:
        by_driver = _publish(prod, "f" * 32, rows)
        by_ranks = _publish(prod, "e" * 32, rows)
        for _ in range(3):
            np.testing.assert_array_equal(fetch(by_driver), rows)
        assert release([by_driver]) == 1
        _missing_at_once(by_driver)
        assert release([by_driver]) == 0

        assert release([by_ranks], reader=1, readers=2) == 0
        np.testing.assert_array_equal(fetch(by_ranks), rows)  # rank 0 reads on
        assert release([by_ranks], reader=1, readers=2) == 0  # again: no effect
        np.testing.assert_array_equal(fetch(by_ranks), rows)
        assert release([by_ranks], reader=0, readers=2) == 1  # the last one
        _missing_at_once(by_ranks)
        assert release([by_ranks], reader=0, readers=2) == 0

        _missing_at_once(_ref(scope, "0" * 32, rows))  # never there
        assert not [n for n in os.listdir(prod.scope_dir) if n.endswith(".rdm")]
    finally:
        close_fetch()
        prod.close()


def test_a_frame_being_spilled_is_waited_for_not_missed(make_conn):
    """A frame moving from the ring to a segment is in neither place for a
    moment: a receive that knows the key was published waits for it."""
    prod, recv = make_conn(TINY_RING), make_conn(TINY_RING)
    prod.put("p", "c", "k", "v")
    ring = prod._sender._edges[("p", "c")].ring
    pos, key, kh, raw = ring.take_oldest(wait_s=0.0)  # what a spill does first
    assert key == "k" and kh == key_hash("k")
    got: list = []
    t = threading.Thread(
        target=lambda: got.append(
            recv.get_with_deadline(
                "p", "c", "k", deadline=time.monotonic() + 10, published=True
            )
        )
    )
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # "try again", not "gone"
    # ... then the segment is written and the frame marked moved.
    scope = prod._shared.scope
    prod._sender._write_segment(scope, seg_name(edge_hex("p", "c"), "k"), kh, raw)
    ring.end_spill(pos, moved=True)
    t.join(10)
    assert got and got[0] is not None and got[0][0] == "v"
    assert (
        recv.get_with_deadline(
            "p", "c", "k", deadline=time.monotonic() + 10, published=True
        )
        is None
    )


def test_a_spill_that_fails_leaves_the_frame_on_the_ring(make_conn, monkeypatch):
    prod = make_conn(TINY_RING, ring_spill_age_s=0.0, ring_wait_s=0.0)
    recv = make_conn(TINY_RING)
    for i in range(40):  # fill the ring; the spills that make room fail
        prod.put("p", "c", f"k{i}", i)
        if i == 0:

            def no_segment(*a, **k):
                raise OSError(28, "No space left on device")

            monkeypatch.setattr(sendmod.perkey, "write_segment", no_segment)
    monkeypatch.undo()
    assert prod.health()["put_failures"] > 0  # the spills were tried
    assert recv.get("p", "c", "k0")[0] == 0  # READY again, still on the ring
