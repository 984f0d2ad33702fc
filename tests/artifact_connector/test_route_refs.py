# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine side of routes by reference (``RouteRefs``) with real
consumer processes on the real host transport: payloads are read-many (any
number of fetches until released), a consumer killed while it holds a
payload's lock (mid-release) loses nothing, the engine learns releases in its expiry
pass (``waiting_bytes`` counts what really waits; released is not
expired), references of retired weight versions go, and the engine's side
goes on handing out references."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import uuid

import msgspec
import numpy as np
import pytest

from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.route_refs import RouteRefs
from vllm_host_transport import routed_experts
from vllm_host_transport.discovery import ScopeDir
from vllm_host_transport.readmany import readable_name
from vllm_host_transport.routed_experts import RouteRefMissingError, fetch
from vllm_host_transport.routes_format import encode
from vllm_host_transport.routes_reader import release


def _stored_nbytes(rows: np.ndarray, digest: str = "xxh3_64") -> int:
    """Bytes a payload of ``rows`` takes (header and body): what
    ``waiting_bytes`` counts."""
    return encode(rows, digest).nbytes


def _missing_at_once(ref) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    with pytest.raises(RouteRefMissingError):
        fetch(ref)
    assert time.monotonic() - t0 < 0.5


def _lock_and_freeze(path: str, held) -> None:
    """Open an object and take its lock as a release does (after reading
    it), then wait to be killed: the kill lands mid-release."""
    import fcntl

    fd = os.open(path, os.O_RDWR)
    os.pread(fd, 4096, 0)
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
    routed_experts.close()


def test_a_consumer_killed_mid_release_loses_nothing(refs):
    ctx = mp.get_context("spawn")
    rows = np.random.default_rng(1).integers(0, 128, (5461, 48, 8), dtype=np.uint8)
    ref = refs.publish(rows, 0)
    scope = os.path.join("/dev/shm", ScopeDir.dir_name(ref.location))
    path = os.path.join(scope, readable_name(ref.key))
    assert os.path.exists(path), "the payload is not a read-many object"
    held = ctx.Event()
    victim = ctx.Process(target=_lock_and_freeze, args=(path, held))
    victim.start()
    assert held.wait(60)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    # Another consumer and this process read the whole, verified array.
    out = ctx.Queue()
    reader = ctx.Process(target=_fetch_in_child, args=(ref.to_json(), out))
    reader.start()
    got = out.get(timeout=60)
    reader.join(30)
    assert got == rows.tobytes()
    np.testing.assert_array_equal(fetch(ref), rows)
    # The dead one's lock went with it: the release of the set completes.
    assert release([ref], reader=0, readers=2) == 0
    assert release([ref], reader=1, readers=2) == 1
    _missing_at_once(ref)
    # The engine side keeps going.
    again = refs.publish(rows[:10], 3)
    np.testing.assert_array_equal(fetch(again), rows[:10])
    assert refs.counters()["published"] == 2


def test_waiting_bytes_count_only_what_was_not_released(refs):
    """Fetching removes nothing; the expiry pass (every second on the
    hand-off thread) learns which payloads the driver or the last of their
    readers released (``readables_gone``) and stops counting them, as
    released, not expired."""
    rows = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    nbytes = _stored_nbytes(rows)
    a, b, c = (refs.publish(rows, 0) for _ in range(3))
    assert refs.counters()["waiting_bytes"] == 3 * nbytes
    for _ in range(2):
        np.testing.assert_array_equal(fetch(a), rows)
    refs.expire()
    assert refs.counters()["waiting_bytes"] == 3 * nbytes  # read, not released
    assert release([a]) == 1  # the driver
    assert refs.counters()["waiting_bytes"] == 3 * nbytes  # not learnt yet
    refs.expire()
    assert refs.counters() == {
        "waiting_bytes": 2 * nbytes,
        "published": 3,
        "expired": 0,
    }
    assert release([b], reader=0, readers=2) == 0
    refs.expire()
    assert refs.counters()["waiting_bytes"] == 2 * nbytes  # one reader left
    assert release([b], reader=1, readers=2) == 1
    refs.expire()
    assert refs.counters()["waiting_bytes"] == nbytes
    # Retiring a released payload is a no-op; the one left still reads.
    refs.retire(a.key)
    assert refs.counters()["waiting_bytes"] == nbytes
    np.testing.assert_array_equal(fetch(c), rows)
    assert refs.counters()["expired"] == 0


def test_the_ttl_expires_only_what_was_not_released():
    refs = RouteRefs(
        ArtifactConfig(ref_scope=f"refs-{uuid.uuid4().hex[:10]}", ref_ttl_s=0.2)
    )
    try:
        rows = np.ones((3, 2, 2), np.uint8)
        released, waiting = refs.publish(rows, 0), refs.publish(rows, 0)
        assert release([released]) == 1
        time.sleep(0.3)
        refs.expire()
        assert refs.counters() == {"waiting_bytes": 0, "published": 2, "expired": 1}
        _missing_at_once(waiting)
    finally:
        refs.close()


def test_references_of_retired_weight_versions_go(refs):
    """``retire_versions(kept)`` (the engine's weight version moved on):
    every payload whose rows' newest version is not kept is removed and
    misses at once; a reference whose rows span versions lives as long as
    its newest; one released already is not counted again."""
    rows = np.arange(30, dtype=np.uint8).reshape(5, 3, 2)
    nbytes = _stored_nbytes(rows)
    old = [refs.publish(rows, 0, "v1") for _ in range(2)]
    released = refs.publish(rows, 0, "v1")
    spans = refs.publish(rows, 1, "v1,v2")
    current = refs.publish(rows, 0, "v2")
    assert spans.weight_version == "v1,v2" and current.weight_version == "v2"
    assert release([released]) == 1
    refs.retire_versions(("v2", "v3"))
    for ref in [*old, released]:
        _missing_at_once(ref)
    for ref in (spans, current):
        np.testing.assert_array_equal(fetch(ref), rows)
    assert refs.version_retired == 2
    assert refs.counters() == {
        "waiting_bytes": 2 * nbytes,
        "published": 5,
        "expired": 0,
    }
    refs.retire_versions(("v2", "v3"))  # again: nothing more goes
    assert refs.version_retired == 2
    refs.retire_versions(("v3",))
    assert refs.version_retired == 4
    assert refs.counters()["waiting_bytes"] == 0
    for ref in (spans, current):
        _missing_at_once(ref)


def test_the_waiting_references_are_bounded_in_number(refs, monkeypatch):
    from vllm.distributed.artifact_connector import route_refs

    # The bound (65,536 by default) made small enough to reach here.
    assert route_refs.MAX_WAITING_REFS == 65536
    monkeypatch.setattr(route_refs, "MAX_WAITING_REFS", 3)
    rows = np.zeros((1, 3, 4), dtype=np.uint8)
    made = [refs.publish(rows, 0) for _ in range(5)]
    assert refs.counters()["expired"] == 2
    assert refs.counters()["waiting_bytes"] == 3 * _stored_nbytes(rows)
    for ref in made[:2]:  # the oldest went
        _missing_at_once(ref)
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
import numpy as np
from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.route_refs import (
    RouteRefPublishError, RouteRefs)
from vllm_host_transport import routed_experts
from vllm_host_transport.readmany import open_readable
from vllm_host_transport.routed_experts import RouteRefMissingError, fetch

def free_kib():
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize >> 10

refs = RouteRefs(ArtifactConfig(ref_scope="nospace", ref_max_bytes=1 << 30))
# Ten 96 KiB responses, each a file of its own, every one held open by a
# trainer rank in the middle of reading it.
rows = [np.full((256, 48, 8), i, np.uint8) for i in range(10)]
small = [refs.publish(r, 0) for r in rows]
readers = [open_readable(r.location, r.key) for r in small]
# Another engine's files leave 1 MiB free.
with open("/dev/shm/other-engine", "wb") as f:
    f.write(bytes((free_kib() - 1024) << 10))
before = free_kib()
out = {}
try:
    refs.publish(np.zeros((10000, 48, 8), np.uint8), 0)  # 3.7 MiB
    out["big"] = "published"
except RouteRefPublishError as e:
    out["big"] = str(e)
out["space_evictions"] = refs.space_evictions
out["expired"] = refs.expired
out["freed_kib"] = free_kib() - before
# The removed one's open reader still reads it whole (POSIX).
got = np.empty(small[0].header_nbytes + small[0].nbytes, np.uint8)
readers[0].read_into(0, got)
out["held_reads"] = bool((got[small[0].header_nbytes:] == 0).all())
while readers:
    readers.pop().close()
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


def test_a_full_dev_shm_stops_at_a_removal_that_frees_nothing():
    """r5 M5: ``/dev/shm`` full and every waiting payload held open by a
    reader, so removing one frees nothing (tmpfs keeps an open file's
    pages): the first such removal ends the attempt (one payload gone, its
    reader reading on), the publish fails with the typed error, and the
    full file system is logged once, without a traceback."""
    from utils.shm_ns import run_python_in_small_shm, skip_unless_private_shm

    skip_unless_private_shm()
    r = run_python_in_small_shm("24m", NOSPACE_CHILD)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "/dev/shm is full" in out["big"], out
    assert "cannot make room" in out["big"], out
    assert out["space_evictions"] == 1 and out["expired"] == 1, out
    assert out["freed_kib"] <= 0, out
    assert out["held_reads"] is True, out
    assert out["exact"] == [False] + [True] * 9, out
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    assert r.stderr.count("/dev/shm is full") <= 1, r.stderr[-4000:]


def test_a_forged_mooncake_payload_with_a_matching_checksum_is_refused():
    """r5 L2: a reference over Mooncake carries a SHA-256 of its stored
    header besides the xxh3-64 checksum, and the header's chunk digests are
    SHA-256. Someone who reaches the master replaces an object: with a
    whole forged payload whose header's xxh3 matches (a crafted collision;
    here the reference's checksum is made to match the forged header
    instead), or with a forged body under the genuine header. ``fetch``
    refuses both. Real ``mooncake_master``."""
    mooncake = pytest.importorskip(
        "mooncake.store", reason="Mooncake's client is installed by `make setup`"
    )
    from utils.mooncake import running_master

    from vllm_host_transport.routed_experts import RouteRefCorruptError
    from vllm_host_transport.routes_format import digest_hex

    rows = np.random.default_rng(2).integers(0, 128, (300, 48, 8), dtype=np.uint8)
    forged_rows = rows.copy()
    forged_rows[0, 0, 0] ^= 1
    forged = encode(forged_rows, "sha256")
    genuine_header = encode(rows, "sha256").header
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
            genuine = refs.publish(rows, 0)
            whole, body = refs.publish(rows, 0), refs.publish(rows, 0)
            assert len(whole.sha256) == 64
            for _ in range(2):  # read-many over Mooncake too
                np.testing.assert_array_equal(fetch(genuine), rows)
            assert forger.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20,
                                "tcp", "", master.address) == 0  # fmt: skip
            for ref, parts in (
                (whole, forged.parts),
                (body, [genuine_header, forged.parts[1]]),
            ):
                assert forger.remove(ref.key, True) == 0
                assert forger.put(ref.key, b"".join(bytes(p) for p in parts)) == 0
            colliding = msgspec.structs.replace(
                whole, checksum=digest_hex("xxh3_64", forged.header)
            )
            with pytest.raises(RouteRefCorruptError, match="SHA-256"):
                fetch(colliding)
            with pytest.raises(RouteRefCorruptError, match="digest mismatch"):
                fetch(body)
            np.testing.assert_array_equal(fetch(genuine), rows)
        finally:
            forger.close()
            refs.close()
            routed_experts.close()
