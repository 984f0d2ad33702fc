# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The /dev/shm backend: contract, safety, multi-process behaviour."""

import hashlib
import json
import os
import stat
import subprocess

import numpy as np
import pytest

from vllm.distributed.artifact_connector.shm import (
    INDEX_FILE,
    WRITER_FILE,
    ShmObjectStore,
    WriterIdentity,
    collect_stale_stores,
    make_namespace,
    validate_root,
)
from vllm.distributed.artifact_connector.store import (
    ArtifactStoreError,
    ChecksumAlgorithm,
    ChecksumMismatchError,
    InMemoryObjectStore,
    InvalidKeyError,
    ObjectDivergenceError,
    ObjectMissingError,
    ObjectRef,
    ObjectSizeError,
    PutStatus,
    ReadOnlyStoreError,
    StoreCapacityError,
    StoreClosedError,
    UnsafeStoreError,
    compute_checksum,
)

NOBODY = 65534


def key(i: int) -> str:
    return hashlib.sha256(b"obj-%d" % i).hexdigest()


def payload(i: int, size: int) -> bytes:
    seed = hashlib.sha256(b"payload-%d" % i).digest()
    return (seed * (size // len(seed) + 1))[:size]


def ns_dir(root: str, w: ShmObjectStore) -> str:
    return os.path.join(root, w.namespace)


def arenas(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".arena"))


@pytest.fixture
def writer(shm_root):
    w = ShmObjectStore.create(shm_root, make_namespace("test"), capacity_bytes=1 << 20)
    yield w
    w.close()


# ----------------------------------------------------------------- contract
@pytest.mark.parametrize("backend", ["shm", "memory"])
def test_put_get_exists_close(shm_root, backend):
    if backend == "shm":
        st = ShmObjectStore.create(shm_root, make_namespace())
    else:
        st = InMemoryObjectStore()
    res = st.put_many([(key(i), payload(i, 100 + i)) for i in range(10)])
    assert res.statuses == (PutStatus.WRITTEN,) * 10
    assert all(st.exists(key(i)) for i in range(10))
    assert not st.exists(key(99))
    assert st.get_many([key(3), key(1)]) == [payload(3, 103), payload(1, 101)]
    batch = st.get_batch([key(5)] + [key(6)])
    assert batch.tobytes(1) == payload(6, 106)
    with pytest.raises(ObjectMissingError):
        st.get(key(99))
    again = st.put(key(1), payload(1, 101))
    assert again == res.refs[1]
    assert st.stats().puts_identical == 1
    st.close()
    st.close()  # idempotent
    for op in (lambda: st.get(key(1)), lambda: st.put(key(1), b"x")):
        with pytest.raises(StoreClosedError):
            op()


@pytest.mark.parametrize("backend", ["shm", "memory"])
def test_divergence_policy_versions_and_counts(shm_root, backend):
    if backend == "shm":
        st = ShmObjectStore.create(shm_root, make_namespace())
    else:
        st = InMemoryObjectStore()
    first = st.put(key(1), b"route-a", pin=True)
    res = st.put_many([(key(1), b"route-b")])
    assert res.statuses == (PutStatus.DIVERGED,)
    second = res.refs[0]
    assert st.stats().divergences == 1
    # Hits (by key) get the latest computation; the first writer still gets
    # exactly its own bytes by reference.
    assert st.get(key(1)) == b"route-b"
    assert st.get(first) == b"route-a"
    assert st.get(second) == b"route-b"
    # An identical re-put of the old version makes it current again.
    assert st.put_many([(key(1), b"route-a")]).statuses == (PutStatus.IDENTICAL,)
    assert st.get(key(1)) == b"route-a"
    with pytest.raises(ObjectMissingError):
        st.get(ObjectRef(key(1), 12345, 7))
    st.close()


def test_divergence_strict_mode(shm_root):
    st = ShmObjectStore.create(shm_root, make_namespace(), on_divergence="raise")
    st.put(key(1), b"a")
    with pytest.raises(ObjectDivergenceError):
        st.put(key(1), b"b")
    assert st.get(key(1)) == b"a"
    st.close()


def test_reader_is_read_only_and_sees_values_not_paths(writer, shm_root):
    writer.put(key(1), b"abc")
    r = ShmObjectStore.open_reader(shm_root, writer.namespace)
    value = r.get(key(1))
    assert isinstance(value, bytes) and value == b"abc"
    with pytest.raises(ReadOnlyStoreError):
        r.put(key(2), b"x")
    with pytest.raises(ReadOnlyStoreError):
        r.pin([key(1)])
    r.close()


def test_writer_close_removes_namespace(shm_root):
    w = ShmObjectStore.create(shm_root, make_namespace())
    w.put(key(1), b"x")
    path = ns_dir(shm_root, w)
    assert os.path.isdir(path)
    r = ShmObjectStore.open_reader(shm_root, w.namespace)
    w.close()
    assert not os.path.exists(path)
    with pytest.raises(StoreClosedError):
        r.get(key(1))
    r.close()


def test_permissions(writer, shm_root):
    writer.put(key(1), b"x")
    path = ns_dir(writer_root := shm_root, writer)
    assert stat.S_IMODE(os.stat(writer_root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for name in os.listdir(path):
        st = os.lstat(os.path.join(path, name))
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()


def test_index_log_compaction_keeps_readers_correct(shm_root):
    w = ShmObjectStore.create(shm_root, make_namespace(), capacity_bytes=64 << 10)
    w._log_compact_bytes = 4096
    r = ShmObjectStore.open_reader(shm_root, w.namespace)
    for i in range(200):
        w.put(key(i), payload(i, 1000))
        if i % 50 == 0:
            assert r.get(key(i)) == payload(i, 1000)
    assert w.stats().extra.get("log_compactions", 0) > 0
    assert r.get(key(199)) == payload(199, 1000)
    assert not r.exists(key(0))  # evicted long ago
    r.close()
    w.close()


# ----------------------------------------------------------------- capacity
def test_capacity_evicts_unpinned_and_relocates_pinned(shm_root):
    w = ShmObjectStore.create(
        shm_root, make_namespace(), capacity_bytes=64 << 10, arena_bytes=16 << 10
    )
    r = ShmObjectStore.open_reader(shm_root, w.namespace)
    pinned = [w.put(key(i), payload(i, 4000), pin=True) for i in range(3)]
    for i in range(3, 200):
        w.put(key(i), payload(i, 4000))
    s = w.stats()
    assert s.used_bytes <= 64 << 10
    assert s.evicted_objects > 0 and s.relocated_objects > 0
    for ref in pinned:  # a live request's objects survive, readable by others
        assert r.get(ref) == payload(int(pinned.index(ref)), 4000)
    assert not r.exists(key(3))
    assert r.get(key(199)) == payload(199, 4000)
    assert len(arenas(ns_dir(shm_root, w))) <= 5
    # Pinned data alone may not exceed the capacity: loud, typed error.
    w.unpin(pinned)
    big = [(key(1000 + i), payload(i, 4000)) for i in range(15)]
    w.put_many(big, pin=True)
    with pytest.raises(StoreCapacityError):
        w.put_many([(key(2000 + i), payload(i, 4000)) for i in range(2)], pin=True)
    w.unpin([k for k, _ in big])
    w.put_many([(key(2000 + i), payload(i, 4000)) for i in range(2)])
    with pytest.raises(StoreCapacityError):
        w.put(key(3000), b"x" * (65 << 10))
    r.close()
    w.close()


def test_in_memory_capacity(shm_root):
    st = InMemoryObjectStore(capacity_bytes=10_000)
    st.put(key(0), b"a" * 4000, pin=True)
    for i in range(1, 10):
        st.put(key(i), b"b" * 4000)
    assert st.exists(key(0)) and st.exists(key(9)) and not st.exists(key(1))
    with pytest.raises(StoreCapacityError):
        st.put(key(50), b"c" * 7000, pin=True)


# ----------------------------------------------------------------- safety
@pytest.mark.parametrize(
    "bad",
    [
        "../../etc/passwd",
        "a" * 63 + "/",
        "A" * 64,
        "a" * 63,
        "a" * 65,
        "..%2f" + "a" * 59,
        "a" * 32 + "\x00" + "a" * 31,
        "",
    ],
)
def test_path_traversal_through_keys(writer, bad):
    with pytest.raises(InvalidKeyError):
        writer.put(bad, b"x")
    with pytest.raises(InvalidKeyError):
        writer.get(bad)
    with pytest.raises(InvalidKeyError):
        writer.exists(bad)


@pytest.mark.parametrize("bad_ns", ["../x", "abc", "a" * 15, "A" * 32, "a/" * 10])
def test_bad_namespaces(shm_root, bad_ns):
    with pytest.raises(UnsafeStoreError):
        ShmObjectStore.create(shm_root, bad_ns)
    with pytest.raises(UnsafeStoreError):
        ShmObjectStore.open_reader(shm_root, bad_ns)


@pytest.mark.parametrize(
    "bad_root",
    ["/tmp/vart", "/dev/shm", "/dev/shm/../tmp/x", "relative/dir", "/dev/shmx/a"],
)
def test_root_outside_dev_shm_refused(bad_root):
    with pytest.raises(UnsafeStoreError, match="/dev/shm"):
        validate_root(bad_root)
    with pytest.raises(UnsafeStoreError):
        ShmObjectStore.create(bad_root, make_namespace())


def test_symlinked_root_refused(shm_root):
    os.makedirs(shm_root + "-target", mode=0o700)
    os.makedirs(shm_root, mode=0o700)
    link = os.path.join(shm_root, "link")
    os.symlink(shm_root + "-target", link)
    try:
        with pytest.raises(UnsafeStoreError):
            ShmObjectStore.create(link, make_namespace())
    finally:
        os.rmdir(shm_root + "-target")


def test_planted_symlinks(writer, shm_root):
    writer.put(key(1), b"x" * 100)
    path = ns_dir(shm_root, writer)
    victim = os.path.join(shm_root, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    # 1. An arena replaced by a symlink is refused, not followed.
    (arena,) = arenas(path)
    os.rename(os.path.join(path, arena), os.path.join(path, "moved"))
    os.symlink(victim, os.path.join(path, arena))
    r = ShmObjectStore.open_reader(shm_root, writer.namespace)
    with pytest.raises(UnsafeStoreError, match="symlink"):
        r.get(key(1))
    r.close()
    # 2. A symlink with a namespace name in the root is refused and kept.
    fake_ns = "f" * 32
    os.symlink(path, os.path.join(shm_root, fake_ns))
    with pytest.raises(UnsafeStoreError):
        ShmObjectStore.open_reader(shm_root, fake_ns)
    rep = collect_stale_stores(shm_root, 0.0)
    assert fake_ns in rep.refused
    assert os.path.islink(os.path.join(shm_root, fake_ns))
    # 3. Collection of a dead store never follows or deletes planted links.
    os.unlink(os.path.join(path, arena))
    os.rename(os.path.join(path, "moved"), os.path.join(path, arena))
    os.symlink(victim, os.path.join(path, "0000000000000099.arena"))
    writer._remove_on_close = False
    writer.close()
    _make_dead(path)
    rep = collect_stale_stores(shm_root, 0.0)
    assert os.path.islink(os.path.join(path, "0000000000000099.arena"))
    with open(victim, "rb") as f:
        assert f.read() == b"precious"
    assert any("0000000000000099.arena" in e for e in rep.refused)


def _make_dead(path: str) -> None:
    """Rewrite a store's writer record so that it names a process that is
    gone (a pid that cannot exist)."""
    fn = os.path.join(path, WRITER_FILE)
    with open(fn, "rb") as f:
        d = json.loads(f.read())
    d["pid"] = 2**22 + 12345  # above pid_max
    with open(fn, "wb") as f:
        f.write(json.dumps(d).encode())


def test_foreign_owned_entries_refused_and_kept(shm_root, writer):
    writer.put(key(1), b"x" * 100)
    path = ns_dir(shm_root, writer)
    # A namespace directory owned by another user, writer long gone.
    foreign = os.path.join(shm_root, "e" * 32)
    os.mkdir(foreign, 0o700)
    with open(os.path.join(foreign, INDEX_FILE), "wb") as f:
        f.write(b"junk")
    os.chown(os.path.join(foreign, INDEX_FILE), NOBODY, NOBODY)
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.raises(UnsafeStoreError, match="owned by uid"):
        ShmObjectStore.open_reader(shm_root, "e" * 32)
    rep = collect_stale_stores(shm_root, 0.0)
    assert "e" * 32 in rep.refused
    assert os.path.exists(os.path.join(foreign, INDEX_FILE))
    # A foreign-owned arena inside our store: reads refuse it.
    (arena,) = arenas(path)
    os.chown(os.path.join(path, arena), NOBODY, NOBODY)
    r = ShmObjectStore.open_reader(shm_root, writer.namespace)
    with pytest.raises(UnsafeStoreError, match="owned by uid"):
        r.get(key(1))
    r.close()
    # ... and collection of that (dead) store leaves it in place.
    writer._remove_on_close = False
    writer.close()
    _make_dead(path)
    collect_stale_stores(shm_root, 0.0)
    assert os.path.exists(os.path.join(path, arena))
    # A file with group/other access is refused too.
    os.chown(os.path.join(path, arena), os.geteuid(), os.getegid())
    os.chmod(os.path.join(path, arena), 0o644)


def test_loose_mode_refused(shm_root, writer):
    writer.put(key(1), b"x")
    os.chmod(os.path.join(ns_dir(shm_root, writer), INDEX_FILE), 0o644)
    with pytest.raises(UnsafeStoreError, match="mode"):
        ShmObjectStore.open_reader(shm_root, writer.namespace)


def test_corruption_detected_by_checksum(shm_root, writer):
    writer.put_many([(key(i), payload(i, 3000)) for i in range(4)])
    path = ns_dir(shm_root, writer)
    (arena,) = arenas(path)
    with open(os.path.join(path, arena), "r+b") as f:
        f.seek(3000 * 2 + 17)
        b = f.read(1)
        f.seek(3000 * 2 + 17)
        f.write(bytes([b[0] ^ 0x01]))
    r = ShmObjectStore.open_reader(shm_root, writer.namespace)
    assert r.get(key(1)) == payload(1, 3000)
    with pytest.raises(ChecksumMismatchError):
        r.get(key(2))
    with pytest.raises(ChecksumMismatchError):
        r.get_batch([key(0), key(1), key(2), key(3)])
    assert r.stats().checksum_failures == 2
    with pytest.raises(ChecksumMismatchError):
        writer.get(key(2))
    r.close()


def test_identity_liveness():
    me = WriterIdentity.current()
    assert me.is_alive() is True
    gone = WriterIdentity(**{**me.__dict__, "pid": 2**22 + 7})
    assert gone.is_alive() is False
    reused = WriterIdentity(**{**me.__dict__, "start_ticks": me.start_ticks + 1})
    assert reused.is_alive() is False
    other_boot = WriterIdentity(**{**me.__dict__, "boot_id": "x"})
    assert other_boot.is_alive() is False
    other_ns = WriterIdentity(**{**me.__dict__, "pid_ns": me.pid_ns + 1})
    assert other_ns.is_alive() is None


# ----------------------------------------------------------------- processes
def _run_writer(child_cmd, root, ns, nb, bs, size, fault=-1, stage="-", hold=False):
    return subprocess.Popen(
        child_cmd
        + ["writer", root, ns, str(nb), str(bs), str(size), str(fault), stage]
        + ["1" if hold else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _run_reader(child_cmd, root, ns, total, size, wait_all):
    out = subprocess.run(
        child_cmd
        + ["reader", root, ns, str(total), str(size), "1" if wait_all else "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reader_process_while_writer_publishes(shm_root, child_cmd):
    ns = make_namespace("concurrent")
    w = _run_writer(child_cmd, shm_root, ns, 40, 25, 2000, hold=True)
    assert w.stdout is not None
    assert w.stdout.readline().startswith("published 0")  # store exists now
    res = _run_reader(child_cmd, shm_root, ns, 1000, 2000, wait_all=True)
    assert res["mismatches"] == 0
    assert len(res["seen"]) == 1000
    w.communicate("")
    assert w.returncode == 0
    rep = collect_stale_stores(shm_root, 0.0)
    assert ns in rep.removed  # writer exited without removing it


@pytest.mark.parametrize("stage", ["after_data", "mid_index"])
def test_sigkill_mid_publish_is_all_or_nothing(shm_root, child_cmd, stage):
    ns = make_namespace("kill", stage)
    w = _run_writer(child_cmd, shm_root, ns, 6, 10, 3000, fault=3, stage=stage)
    out, _ = w.communicate()
    assert w.returncode == -9
    assert out.splitlines()[-1] == "published 2"
    res = _run_reader(child_cmd, shm_root, ns, 60, 3000, wait_all=False)
    assert res["mismatches"] == 0
    assert res["seen"] == list(range(30))  # batches 0-2, none of batch 3
    # A dead writer's store: kept within the TTL, collected after it.
    rep = collect_stale_stores(shm_root, 3600.0)
    assert ns in rep.kept_recent
    rep = collect_stale_stores(shm_root, 0.0)
    assert ns in rep.removed
    assert not os.path.exists(os.path.join(shm_root, ns))


def test_sigkill_at_arbitrary_point(shm_root, child_cmd):
    ns = make_namespace("kill-any")
    w = _run_writer(child_cmd, shm_root, ns, 400, 8, 5000, hold=True)
    assert w.stdout is not None
    for _ in range(5):
        w.stdout.readline()
    w.kill()
    w.wait()
    res = _run_reader(child_cmd, shm_root, ns, 3200, 5000, wait_all=False)
    assert res["mismatches"] == 0
    n = len(res["seen"])
    assert n >= 40 and n % 8 == 0  # whole batches only
    assert res["seen"] == list(range(n))


def test_ttl_collection_spares_live_writers(shm_root, child_cmd):
    ns = make_namespace("live")
    w = _run_writer(child_cmd, shm_root, ns, 1, 1, 10, hold=True)
    assert w.stdout is not None
    w.stdout.readline()
    rep = collect_stale_stores(shm_root, 0.0)
    assert ns in rep.kept_alive
    w.kill()
    w.wait()
    # The next writer on the node collects it at start-up.
    mine = ShmObjectStore.create(shm_root, make_namespace(), inactive_ttl_s=0.0)
    assert not os.path.exists(os.path.join(shm_root, ns))
    mine.close()
    assert os.listdir(shm_root) == []


# ----------------------------------------------------------------- fast paths
def _fill_with(values):
    def fill(buf):
        o = 0
        for v in values:
            buf[o : o + len(v)] = np.frombuffer(v, np.uint8)
            o += len(v)

    return fill


@pytest.mark.parametrize("backend", ["shm", "memory"])
def test_put_packed_and_get_split(shm_root, backend):
    if backend == "shm":
        st = ShmObjectStore.create(shm_root, make_namespace())
    else:
        st = InMemoryObjectStore()
    assert st.checksum_algorithm == ChecksumAlgorithm.XXH3_64
    vals = [payload(i, 100 + 10 * i) for i in range(5)]
    keys = [key(i) for i in range(5)]
    res = st.put_packed(keys, [len(v) for v in vals], _fill_with(vals))
    assert res.statuses == (PutStatus.WRITTEN,) * 5
    assert [r.checksum for r in res.refs] == [
        compute_checksum(ChecksumAlgorithm.XXH3_64, v) for v in vals
    ]
    assert st.get_many(keys) == vals
    order = [3, 0, 4]
    out = np.zeros(sum(len(vals[i]) - 8 for i in order), np.uint8)
    got = st.get_split([keys[i] for i in order], 8, out)
    assert out.tobytes() == b"".join(vals[i][:-8] for i in order)
    assert [bytes(t) for t in got.trailers] == [vals[i][-8:] for i in order]
    assert got.lengths.tolist() == [len(vals[i]) for i in order]
    # Wrong expected sizes: typed error, nothing copied.
    out[:] = 7
    with pytest.raises(ObjectSizeError) as ei:
        st.get_split([keys[i] for i in order], 8, out, body_nbytes=[122, 93, 132])
    assert ei.value.index == 1 and (out == 7).all()
    with pytest.raises(ObjectSizeError):
        st.get_split([keys[0]], 8, np.zeros(1, np.uint8))
    with pytest.raises(ValueError):
        st.get_split([keys[0]], 8, np.zeros(92, np.uint16))
    with pytest.raises(ObjectMissingError):
        st.get_split([key(99)], 8, np.zeros(92, np.uint8))
    st.close()


def test_put_packed_trusts_fill_checksums_but_fails_closed(shm_root):
    st = ShmObjectStore.create(shm_root, make_namespace())
    vals = [payload(1, 300), payload(2, 300)]

    def fill(buf):
        _fill_with(vals)(buf)
        return [1, 2]  # wrong

    st.put_packed([key(1), key(2)], [300, 300], fill)
    r = ShmObjectStore.open_reader(shm_root, st.namespace)
    for handle in (st, r):
        with pytest.raises(ChecksumMismatchError):
            handle.get(key(1))
        with pytest.raises(ChecksumMismatchError):
            handle.get_split([key(2)], 0, np.zeros(300, np.uint8))
    r.close()
    st.close()
    mem = InMemoryObjectStore()
    with pytest.raises(ArtifactStoreError):
        mem.put_packed([key(1), key(2)], [300, 300], fill)


def test_crc32_store_is_readable_by_a_reader(shm_root):
    st = ShmObjectStore.create(
        shm_root, make_namespace(), checksum=ChecksumAlgorithm.CRC32
    )
    ref = st.put(key(1), b"abc" * 100)
    assert ref.checksum == compute_checksum(ChecksumAlgorithm.CRC32, b"abc" * 100)
    r = ShmObjectStore.open_reader(shm_root, st.namespace)
    assert r.checksum_algorithm == ChecksumAlgorithm.CRC32
    assert r.get(key(1)) == b"abc" * 100
    r.close()
    st.close()


def test_get_split_scattered_mixed_sizes_and_corruption(shm_root):
    w = ShmObjectStore.create(
        shm_root, make_namespace(), capacity_bytes=1 << 20, arena_bytes=64 << 10
    )
    mine = []
    for i in range(40):
        size = 640 if i % 7 else 200 + i  # mostly equal sizes, some odd ones
        w.put_many([(key(i), payload(i, size))] + [(key(1000 + i), b"z" * 333)])
        mine.append(i)
    # One batch of equal-size adjacent objects (a strided run).
    w.put_many([(key(2000 + i), payload(2000 + i, 640)) for i in range(10)])
    mine += [2000 + i for i in range(10)]
    r = ShmObjectStore.open_reader(shm_root, w.namespace)
    vals = [payload(i, 640 if (i >= 2000 or i % 7) else 200 + i) for i in mine]
    out = np.zeros(sum(len(v) - 64 for v in vals), np.uint8)
    got = r.get_split([key(i) for i in mine], 64, out)
    assert out.tobytes() == b"".join(v[:-64] for v in vals)
    assert [bytes(t) for t in got.trailers] == [v[-64:] for v in vals]
    # A flipped byte in a run or in an isolated object is caught.
    path = ns_dir(shm_root, w)
    for victim in (2005, 3):
        slot = r._index.cur[key(victim)]
        aid, off = int(r._index.arena[slot]), int(r._index.off[slot])
        with open(os.path.join(path, f"{aid:016x}.arena"), "r+b") as f:
            f.seek(off + 5)
            b = f.read(1)
            f.seek(off + 5)
            f.write(bytes([b[0] ^ 0x40]))
        with pytest.raises(ChecksumMismatchError, match=key(victim)):
            r.get_split([key(i) for i in mine], 64, out)
        with open(os.path.join(path, f"{aid:016x}.arena"), "r+b") as f:
            f.seek(off + 5)
            f.write(b)
    r.close()
    w.close()


def test_readers_unmap_evicted_arenas(shm_root):
    w = ShmObjectStore.create(
        shm_root, make_namespace(), capacity_bytes=64 << 10, arena_bytes=16 << 10
    )
    r = ShmObjectStore.open_reader(shm_root, w.namespace)
    w.put(key(0), payload(0, 4000))
    assert r.get(key(0)) == payload(0, 4000)
    first = set(r._arenas)
    assert first
    for i in range(1, 60):
        w.put(key(i), payload(i, 4000))
    assert r.get(key(59)) == payload(59, 4000)
    assert not first & set(r._arenas)  # evicted arenas are no longer mapped
    on_disk = {int(n[:16], 16) for n in arenas(ns_dir(shm_root, w))}
    assert set(r._arenas) <= on_disk
    # Arena files are allocated in full when started.
    for n in arenas(ns_dir(shm_root, w)):
        assert os.path.getsize(os.path.join(ns_dir(shm_root, w), n)) == 16 << 10
    r.close()
    w.close()
