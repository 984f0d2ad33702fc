# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine side of routes by reference (``RouteRefs``) with real
consumer processes on the real host transport: a consumer killed in the
middle of taking a payload loses nothing (the payload is still whole for
the next one), and the engine's side goes on handing out references."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import uuid

import msgspec
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


NOSPACE_CHILD = r"""
import json, os
import msgspec
import numpy as np
from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.route_refs import (
    RouteRefPublishError, RouteRefs)
from vllm_host_transport import routed_experts
from vllm_host_transport.routed_experts import RouteRefMissingError, fetch

def free_kib():
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize >> 10

refs = RouteRefs(ArtifactConfig(ref_scope="nospace", ref_max_bytes=1 << 30))
# Ten 96 KiB responses: frames of the (preallocated) 4 MiB ring.
rows = [np.full((256, 48, 8), i, np.uint8) for i in range(10)]
small = [refs.publish(r, 0) for r in rows]
# Another engine's files leave 1 MiB free.
with open("/dev/shm/other-engine", "wb") as f:
    f.write(bytes((free_kib() - 1024) << 10))
before = free_kib()
out = {}
try:
    refs.publish(np.zeros((10000, 48, 8), np.uint8), 0)  # 3.7 MiB, per-key
    out["big"] = "published"
except RouteRefPublishError as e:
    out["big"] = str(e)
out["space_evictions"] = refs.space_evictions
out["expired"] = refs.expired
out["freed_kib"] = free_kib() - before
os.unlink("/dev/shm/other-engine")
def exact(ref, want):
    try:
        return bool((fetch(ref) == want).all())
    except RouteRefMissingError:
        return False
out["exact"] = [exact(r, a) for r, a in zip(small, rows)]
refs.close()
routed_experts.close()
print(json.dumps(out))
"""


def test_a_full_dev_shm_retires_nothing_that_frees_nothing():
    """r5 M5: ``/dev/shm`` full and a payload that needs a segment: the
    waiting references live in the preallocated ring, so removing them
    frees nothing; none is removed, the publish fails with the typed error,
    and the full file system is logged once, without a traceback."""
    from utils.shm_ns import run_python_in_small_shm, skip_unless_private_shm

    skip_unless_private_shm()
    r = run_python_in_small_shm("24m", NOSPACE_CHILD)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "/dev/shm is full" in out["big"], out
    assert out["space_evictions"] == 0 and out["expired"] == 0, out
    assert out["exact"] == [True] * 10, out
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    assert r.stderr.count("/dev/shm is full") <= 1, r.stderr[-4000:]


def test_a_forged_mooncake_payload_with_a_matching_checksum_is_refused():
    """r5 L2: a reference over Mooncake carries a SHA-256 of its payload
    besides the xxh3-64 checksum. Someone who reaches the master replaces
    the object with other bytes whose xxh3 matches (a crafted collision;
    here the reference's checksum is made to match the forged bytes
    instead): ``fetch`` refuses them. Real ``mooncake_master``."""
    mooncake = pytest.importorskip(
        "mooncake.store", reason="Mooncake's client is installed by `make setup`"
    )
    from utils.mooncake import running_master

    from vllm_host_transport.routed_experts import (
        RouteRefCorruptError,
        checksum_hex,
    )

    rows = np.random.default_rng(2).integers(0, 128, (300, 48, 8), dtype=np.uint8)
    forged = rows.copy()
    forged[0, 0, 0] ^= 1
    with running_master("mooncake-master-ref-digest") as master:
        refs = RouteRefs(
            ArtifactConfig(
                ref_transport="mooncake",
                mooncake_master=master.address,
                mooncake_segment_bytes=16 << 20,
                mooncake_buffer_bytes=16 << 20,
            )
        )
        forger = mooncake.MooncakeDistributedStore()
        try:
            genuine, ref = refs.publish(rows, 0), refs.publish(rows, 0)
            assert len(ref.sha256) == 64
            np.testing.assert_array_equal(fetch(genuine), rows)
            assert forger.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20,
                                "tcp", "", master.address) == 0  # fmt: skip
            assert forger.remove(ref.key) == 0
            assert forger.put(ref.key, forged.reshape(-1).data) == 0
            colliding = msgspec.structs.replace(
                ref, checksum=checksum_hex(forged.reshape(-1))
            )
            with pytest.raises(RouteRefCorruptError, match="SHA-256"):
                fetch(colliding)
        finally:
            forger.close()
            refs.close()
            routed_experts.close()
