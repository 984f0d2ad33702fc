# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine side of routes by reference (``RouteRefs``) with real
consumer processes on the real host transport: a consumer killed in the
middle of taking a payload loses nothing (the payload is still whole for
the next one), and the engine's side goes on handing out references."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid

import numpy as np
import pytest

from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.route_refs import RouteRefs
from vllm_host_transport import routed_experts
from vllm_host_transport.discovery import ScopeDir
from vllm_host_transport.routed_experts import EDGE, RouteRefMissingError, fetch
from vllm_host_transport.shared import edge_hex, seg_name


def _claim_and_freeze(path: str, held) -> None:
    """Take a segment's lock as a claim does first, then wait to be killed
    (the kill lands mid-fetch: locked, nothing copied or unlinked yet)."""
    import fcntl
    import time

    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.set()
    time.sleep(120)


def _fetch_in_child(ref: dict, out) -> None:
    try:
        routes = fetch(ref, timeout_s=5.0)
    except Exception as e:  # reported to the parent, which asserts on it
        out.put(type(e).__name__)
    else:
        out.put(routes.tobytes())


@pytest.fixture
def refs():
    r = RouteRefs(ArtifactConfig(ref_scope=f"refs-{uuid.uuid4().hex[:10]}"))
    yield r
    r.close()
    routed_experts.close()  # this process fetched too: let go of the scope


def test_a_consumer_killed_mid_fetch_loses_nothing(refs):
    ctx = mp.get_context("spawn")
    # 2 MiB: above a quarter of the ring, so a per-key segment.
    rows = np.random.default_rng(1).integers(0, 128, (5461, 48, 8), dtype=np.uint8)
    ref = refs.publish(rows, 0)
    scope = os.path.join("/dev/shm", ScopeDir.dir_name(ref.location))
    lock = os.path.join(scope, seg_name(edge_hex(*EDGE), ref.key) + ".lock")
    assert os.path.exists(lock), "the payload is not in a per-key segment"
    held = ctx.Event()
    victim = ctx.Process(target=_claim_and_freeze, args=(lock, held))
    victim.start()
    assert held.wait(60)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    # The next consumer takes the whole, verified array.
    out = ctx.Queue()
    taker = ctx.Process(target=_fetch_in_child, args=(ref.to_json(), out))
    taker.start()
    got = out.get(timeout=60)
    taker.join(30)
    assert got == rows.tobytes()
    # Taken: a later fetch finds it gone; the engine side keeps going.
    with pytest.raises(RouteRefMissingError):
        fetch(ref)
    again = refs.publish(rows[:10], 3)
    np.testing.assert_array_equal(fetch(again), rows[:10])
    assert refs.counters()["published"] == 2


def test_waiting_bytes_count_only_what_was_not_fetched(refs):
    rows = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    a, b = refs.publish(rows, 0), refs.publish(rows, 0)
    assert refs.counters()["waiting_bytes"] == 2 * rows.nbytes
    np.testing.assert_array_equal(fetch(a), rows)
    refs.expire()  # the hand-off thread's pass, every second
    assert refs.counters() == {
        "waiting_bytes": rows.nbytes,
        "published": 2,
        "expired": 0,
    }
    np.testing.assert_array_equal(fetch(b), rows)
    refs.expire()
    assert refs.counters()["waiting_bytes"] == 0


def test_the_waiting_references_are_bounded_in_number(refs, monkeypatch):
    from vllm.distributed.artifact_connector import route_refs

    # The bound (65,536 by default) made small enough to reach here.
    assert route_refs.MAX_WAITING_REFS == 65536
    monkeypatch.setattr(route_refs, "MAX_WAITING_REFS", 3)
    rows = np.zeros((1, 3, 4), dtype=np.uint8)
    made = [refs.publish(rows, 0) for _ in range(5)]
    assert refs.counters()["expired"] == 2
    assert refs.counters()["waiting_bytes"] == 3 * rows.nbytes
    for ref in made[:2]:  # the oldest went
        with pytest.raises(RouteRefMissingError):
            fetch(ref)
    for ref in made[2:]:
        np.testing.assert_array_equal(fetch(ref), rows)


def test_a_squatted_ref_scope_falls_back_and_references_name_it():
    scope = f"refs-{uuid.uuid4().hex[:10]}"
    path = os.path.join("/dev/shm", ScopeDir.dir_name(scope))
    os.mkdir(path, 0o700)
    try:
        try:
            os.chown(path, 65534, 65534)  # another user's (CI runs as root)
        except PermissionError:
            pytest.skip("making a directory of another user needs root")
        refs = RouteRefs(ArtifactConfig(ref_scope=scope))
        try:
            rows = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
            ref = refs.publish(rows, 1)
            assert ref.location.startswith(scope + "~")
            np.testing.assert_array_equal(fetch(ref.to_json()), rows)
        finally:
            refs.close()
            routed_experts.close()
        assert not os.path.exists(
            os.path.join("/dev/shm", ScopeDir.dir_name(ref.location))
        )
    finally:
        os.rmdir(path)


def test_a_zero_row_reference_fetches_over_the_host_transport(refs):
    """No rows (``routed_experts_prompt_start`` at the end of the request):
    the reference fetches an empty array of the routes' shape."""
    ref = refs.publish(np.zeros((0, 48, 8), np.uint8), 0)
    got = fetch(ref.to_json())
    assert got.shape == (0, 48, 8) and got.dtype == np.uint8
