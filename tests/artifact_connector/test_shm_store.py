# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The /dev/shm store: contract, retention and capacity, safety, and
behaviour across real processes."""

import contextlib
import json
import mmap
import os
import shutil
import stat
import subprocess
import time

import numpy as np
import pytest
from utils.shm import small_tmpfs

from vllm.config import artifact_sizing as limits_mod
from vllm.distributed.artifact_connector.shm import (
    ShmStoreReader,
    ShmStoreWriter,
    WriterIdentity,
    collect_stale_stores,
    make_namespace,
)
from vllm.distributed.artifact_connector.shm import files as files_mod
from vllm.distributed.artifact_connector.shm import writer as writer_mod
from vllm.distributed.artifact_connector.store import (
    ChecksumMismatchError,
    InvalidKeyError,
    ObjectMissingError,
    ObjectRef,
    ObjectSizeError,
    PutStatus,
    StoreCapacityError,
    StoreClosedError,
    StoreIOError,
    UnsafeStoreError,
    checksum,
)

from .helpers import key, make_dead, payload, put, read, read_refs

NOBODY = 65534


def ns_dir(w: ShmStoreWriter) -> str:
    return os.path.join(w.root, w.namespace)


def arenas(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".arena"))


def files_bytes(path: str) -> int:
    """What a store's files take: their sizes, and for the index log the
    pages allocated (it keeps some reserved beyond its end)."""
    total = 0
    for n in os.listdir(path):
        st = os.stat(os.path.join(path, n))
        total += max(st.st_size, st.st_blocks * 512 if n == "index.log" else 0)
    return total


@pytest.fixture
def writer(shm_root):
    w = ShmStoreWriter(shm_root, make_namespace("test"), capacity_bytes=1 << 20)
    yield w
    w.close()


# ----------------------------------------------------------------- contract
def test_put_read_close(writer, shm_root):
    res = put(writer, [(key(i), payload(i, 100 + i)) for i in range(10)])
    assert res.statuses == (PutStatus.WRITTEN,) * 10
    assert [r.checksum for r in res.refs] == [
        checksum(payload(i, 100 + i)) for i in range(10)
    ]
    r = ShmStoreReader(shm_root, writer.namespace)
    assert read(r, [res.refs[3], res.refs[1]]) == [payload(3, 103), payload(1, 101)]
    with pytest.raises(ObjectMissingError):
        read(r, [ObjectRef(key(99), 1, 10)])
    with pytest.raises(ObjectMissingError):  # a version that never existed
        read(r, [ObjectRef(key(1), 12345, 101)])
    again = put(writer, [(key(1), payload(1, 101))])
    assert again.statuses == (PutStatus.IDENTICAL,) and again.refs[0] == res.refs[1]
    assert writer.lookup([key(1), key(99)]) == [res.refs[1], None]
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(StoreClosedError):
        put(writer, [(key(1), b"x")])
    with pytest.raises(StoreClosedError):
        read(r, [res.refs[1]])
    r.close()


def test_read_spans_and_untouched_output_on_error(writer, shm_root):
    vals = [payload(i, 200) for i in range(4)]
    refs = put(writer, [(key(i), v) for i, v in enumerate(vals)]).refs
    r = ShmStoreReader(shm_root, writer.namespace)
    out = np.zeros(300, np.uint8)
    seen = []
    read_refs(
        r,
        [refs[2], refs[0]],
        out,
        np.array([[10, 100, 0], [150, 50, 100]]),
        trailer_nbytes=8,
        check=lambda t, lens: seen.append((t.copy(), lens.tolist())),
    )
    assert out[:100].tobytes() == vals[2][10:110]
    assert out[100:150].tobytes() == vals[0][150:200]
    assert seen[0][0].tobytes() == vals[2][-8:] + vals[0][-8:]
    assert seen[0][1] == [200, 200]

    def refuse(t, lens):
        raise ValueError("caller refuses")

    out[:] = 7
    with pytest.raises(ValueError, match="refuses"):
        read_refs(r, [refs[1]], out, [[0, 200, 0]], trailer_nbytes=8, check=refuse)
    with pytest.raises(ObjectSizeError):
        read_refs(r, [refs[1]], out, [[150, 100, 0]])
    with pytest.raises(ObjectSizeError):  # past the end of the output
        read_refs(r, [refs[1]], out, [[0, 200, 250]])
    with pytest.raises(ValueError):
        read_refs(r, [refs[1]], np.zeros(300, np.uint16), [[0, 10, 0]])
    assert (out == 7).all()
    r.close()


def test_divergence_keeps_both_versions_and_counts(writer, shm_root):
    first = put(writer, [(key(1), b"route-a")], owner="req-1").refs[0]
    res = put(writer, [(key(1), b"route-b")])
    assert res.statuses == (PutStatus.DIVERGED,)
    second = res.refs[0]
    assert writer.stats().divergences == 1
    assert writer.lookup([key(1)]) == [second]  # hits get the newest
    r = ShmStoreReader(shm_root, writer.namespace)
    # The first writer still reads exactly its own bytes by reference.
    assert read(r, [first, second]) == [b"route-a", b"route-b"]
    # An identical re-put of the old version makes it current again.
    assert put(writer, [(key(1), b"route-a")]).statuses == (PutStatus.IDENTICAL,)
    assert writer.lookup([key(1)]) == [first]
    # Within one batch: a repeat is identical, a different value diverges.
    res = put(writer, [(key(2), b"x"), (key(2), b"x"), (key(2), b"y")])
    assert res.statuses == (PutStatus.WRITTEN, PutStatus.IDENTICAL, PutStatus.DIVERGED)
    assert read(r, list(res.refs)) == [b"x", b"x", b"y"]
    r.close()


def test_writer_close_removes_the_store(shm_root):
    w = ShmStoreWriter(shm_root, make_namespace())
    put(w, [(key(1), b"x")])
    path = ns_dir(w)
    assert os.path.isdir(path)
    w.close()
    assert not os.path.exists(path)
    with pytest.raises(StoreClosedError):
        ShmStoreReader(shm_root, w.namespace)


def test_min_capacity_is_the_smallest_store_the_writer_accepts(shm_root):
    """The configuration's minimum (ArtifactConfig rejects less) is a store
    that keeps serving puts once its first arena is full, evicting; two
    arenas' worth is not (the full active arena cannot go before the next
    one exists)."""
    from vllm.config.artifact import MIN_CAPACITY_BYTES

    def fill(capacity: int, root: str) -> None:
        w = ShmStoreWriter(root, make_namespace(), capacity_bytes=capacity)
        try:
            for i in range(8):
                put(w, [(key(i), payload(i, 40 << 10))])
            assert w.stats().used_bytes <= capacity
            assert w.stats().evicted_objects > 0
        finally:
            w.close()

    assert MIN_CAPACITY_BYTES == limits_mod.MIN_CAPACITY_BYTES
    fill(MIN_CAPACITY_BYTES, shm_root)
    with pytest.raises(StoreCapacityError):
        fill(2 * limits_mod.MIN_ARENA_BYTES, shm_root)


def test_every_entry_is_private(writer, shm_root):
    put(writer, [(key(1), b"x")])
    writer.maintain()  # a spare arena too
    for p in (shm_root, ns_dir(writer)):
        st = os.lstat(p)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    names = os.listdir(ns_dir(writer))
    assert len(arenas(ns_dir(writer))) == 2
    for name in names:
        st = os.lstat(os.path.join(ns_dir(writer), name))
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()


# ----------------------------------------------------------------- retention
def test_eviction_spares_retained_objects_and_moves_them(shm_root):
    w = ShmStoreWriter(
        shm_root, make_namespace(), capacity_bytes=64 << 10, arena_bytes=16 << 10
    )
    r = ShmStoreReader(shm_root, w.namespace)
    kept = [
        put(w, [(key(i), payload(i, 3000))], owner="live").refs[0] for i in range(3)
    ]
    dropped = put(w, [(key(3), payload(3, 3000))]).refs[0]
    for i in range(4, 200):
        put(w, [(key(i), payload(i, 3000))])
        w.maintain()  # as the publication thread does when idle
        assert w.stats().used_bytes <= 64 << 10
        assert files_bytes(ns_dir(w)) <= 64 << 10
    s = w.stats()
    assert s.evicted_objects > 0 and s.relocated_objects >= 3
    assert read(r, kept) == [payload(i, 3000) for i in range(3)]
    with pytest.raises(ObjectMissingError):
        read(r, [dropped])
    assert w.release("live") == 3
    assert w.stats().retained_keys == 0
    for i in range(200, 260):
        put(w, [(key(i), payload(i, 3000))])
    with pytest.raises(ObjectMissingError):  # released: evictable again
        read(r, [kept[0]])
    r.close()
    w.close()


def test_retain_before_publication_protects_a_sibling_key(shm_root):
    w = ShmStoreWriter(
        shm_root, make_namespace(), capacity_bytes=64 << 10, arena_bytes=16 << 10
    )
    w.retain("hit", [key(7)])  # the sibling has not published it yet
    ref = put(w, [(key(7), payload(7, 3000))]).refs[0]
    for i in range(100):
        put(w, [(key(1000 + i), payload(i, 3000))])
    r = ShmStoreReader(shm_root, w.namespace)
    assert read(r, [ref]) == [payload(7, 3000)]
    assert w.release("hit") == 1 and w.release("hit") == 0
    r.close()
    w.close()


def test_retained_bytes_over_capacity_is_a_typed_error(shm_root):
    w = ShmStoreWriter(
        shm_root, make_namespace(), capacity_bytes=64 << 10, arena_bytes=16 << 10
    )
    for i in range(12):
        put(w, [(key(i), payload(i, 4000))], owner="big")
    with pytest.raises(StoreCapacityError, match="live request attempts"):
        for i in range(12, 40):
            put(w, [(key(i), payload(i, 4000))], owner="big")
    assert files_bytes(ns_dir(w)) <= 64 << 10
    w.release("big")
    put(w, [(key(99), payload(99, 4000))])  # room again
    with pytest.raises(StoreCapacityError):  # one object larger than capacity
        put(w, [(key(98), b"x" * (65 << 10))])
    w.close()


def test_capacity_is_a_hard_bound_counting_the_log(shm_root):
    """Arenas (the spare included) plus the index log (its reserved pages
    included) never exceed the capacity, checked on disk after every
    operation."""
    cap = 96 << 10
    w = ShmStoreWriter(
        shm_root, make_namespace(), capacity_bytes=cap, arena_bytes=16 << 10
    )
    for i in range(600):
        put(w, [(key(i), payload(i, 100)), (key(10_000 + i), payload(i, 900))])
        if i % 7 == 0:
            w.maintain()
        used = files_bytes(ns_dir(w))
        assert used <= cap, f"step {i}: {used} bytes on disk"
        assert w.stats().used_bytes == used
    w.close()


def test_log_compaction_keeps_readers_correct(shm_root, monkeypatch):
    monkeypatch.setattr(writer_mod, "_COMPACT_MIN_BYTES", 8 << 10)
    w = ShmStoreWriter(
        shm_root, make_namespace(), capacity_bytes=128 << 10, arena_bytes=16 << 10
    )
    r = ShmStoreReader(shm_root, w.namespace)
    refs = []
    for i in range(400):
        refs.append(put(w, [(key(i), payload(i, 700))]).refs[0])
        if i % 50 == 0:
            w.maintain()
            assert read(r, [refs[-1]]) == [payload(i, 700)]
    assert w.stats().log_compactions > 0
    assert read(r, [refs[-1]]) == [payload(399, 700)]
    fresh = ShmStoreReader(shm_root, w.namespace)  # rebuilt from the snapshot
    assert read(fresh, refs[-5:]) == [payload(i, 700) for i in range(395, 400)]
    fresh.close()
    r.close()
    w.close()


def test_spare_arena_is_prepared_ahead(shm_root):
    w = ShmStoreWriter(
        shm_root, make_namespace(), capacity_bytes=1 << 20, arena_bytes=16 << 10
    )
    put(w, [(key(0), payload(0, 1000))])
    assert w.stats().arenas_started_on_demand == 1  # nothing was ready yet
    for i in range(1, 100):
        w.maintain()
        put(w, [(key(i), payload(i, 1000))])
    s = w.stats()
    assert s.arenas_started >= 6 and s.arenas_started_on_demand == 1
    w.close()


# ----------------------------------------------------------------- full /dev/shm
@pytest.fixture
def tiny_tmpfs():
    """A real 256 KiB tmpfs mounted under /dev/shm (needs CAP_SYS_ADMIN)."""
    with small_tmpfs("256k") as mnt:
        yield mnt


def test_full_dev_shm_evicts_the_stores_own_oldest_and_retries(tiny_tmpfs):
    """A capacity far above what the file system holds: a full /dev/shm is a
    second capacity. Puts keep succeeding, the oldest unretained arenas go
    (counted), and what stays is intact."""
    w = ShmStoreWriter(
        tiny_tmpfs, make_namespace(), capacity_bytes=8 << 20, arena_bytes=64 << 10
    )
    r = ShmStoreReader(tiny_tmpfs, w.namespace)
    refs = []
    try:
        for i in range(200):  # 1 MB of objects through a 256 KiB tmpfs
            refs.append(put(w, [(key(i), payload(i, 5000))]).refs[0])
            w.maintain()
        s = w.stats()
        assert s.space_evictions > 0 and s.evicted_objects > 0, s
        assert s.used_bytes < 256 << 10
        # The newest survive (the active arena's, at least).
        assert read(r, refs[-5:]) == [payload(i, 5000) for i in range(195, 200)]
        assert w.lookup([key(0)]) == [None]  # the oldest went
    finally:
        r.close()
        w.close()


def test_full_dev_shm_with_only_retained_objects_is_a_typed_capacity_error(
    tiny_tmpfs,
):
    """When everything the store holds is retained by running requests, a
    full /dev/shm fails the put with the typed error naming the fix; what
    was acknowledged before stays intact and readable."""
    w = ShmStoreWriter(
        tiny_tmpfs, make_namespace(), capacity_bytes=8 << 20, arena_bytes=64 << 10
    )
    r = ShmStoreReader(tiny_tmpfs, w.namespace)
    refs = []
    try:
        with pytest.raises(StoreCapacityError, match="full.*engines_per_node"):
            for i in range(200):
                refs.append(put(w, [(key(i), payload(i, 5000))]).refs[0])
                w.retain("running", [key(i)])
                w.maintain()
        assert read(r, refs) == [payload(i, 5000) for i in range(len(refs))]
        # Released, the next put evicts and succeeds.
        w.release("running")
        refs.append(put(w, [(key(999), payload(999, 5000))]).refs[0])
        assert read(r, refs[-1:]) == [payload(999, 5000)]
        assert w.stats().space_evictions > 0
    finally:
        r.close()
        w.close()


def test_full_dev_shm_on_the_index_log_leaves_log_and_index_agreeing(tiny_tmpfs):
    w = ShmStoreWriter(
        tiny_tmpfs, make_namespace(), capacity_bytes=8 << 20, arena_bytes=100 << 10
    )
    refs = [put(w, [(key(0), payload(0, 100))]).refs[0]]
    # Fill the rest of the file system so that the next log append fails.
    filler = os.path.join(tiny_tmpfs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    failures = 0
    for i in range(1, 300):
        try:
            refs.append(put(w, [(key(i), payload(i, 100))]).refs[0])
        except StoreCapacityError:
            failures += 1
            break
    assert failures == 1
    os.unlink(filler)
    r = ShmStoreReader(tiny_tmpfs, w.namespace)
    # The reader's index (from the log) and the writer's agree exactly.
    assert read(r, refs) == [payload(i, 100) for i in range(len(refs))]
    assert w.lookup([key(len(refs))]) == [None]
    assert w.stats().objects == len(refs)
    refs.append(put(w, [(key(999), b"after")]).refs[0])  # usable again
    assert read(r, refs[-1:]) == [b"after"]
    r.close()
    w.close()


# ----------------------------------------------------------------- safety
@pytest.mark.parametrize(
    "bad",
    [
        "../../etc/passwd",
        "a" * 63 + "/",
        "A" * 64,
        "a" * 63,
        "a" * 65,
        "a" * 32 + "\x00" + "a" * 31,
        "",
    ],
)
def test_keys_cannot_smuggle_paths(writer, bad):
    with pytest.raises(InvalidKeyError):
        put(writer, [(bad, b"x")])


@pytest.mark.parametrize("bad_ns", ["../x", "abc", "a" * 31, "A" * 32, "a/" * 16])
def test_bad_namespaces(shm_root, bad_ns):
    with pytest.raises(UnsafeStoreError):
        ShmStoreWriter(shm_root, bad_ns)
    with pytest.raises(UnsafeStoreError):
        ShmStoreReader(shm_root, bad_ns)


@pytest.mark.parametrize(
    "bad_root",
    ["/tmp/vart", "/dev/shm", "/dev/shm/../tmp/x", "relative/dir", "/dev/shmx/a"],
)
def test_root_outside_dev_shm_refused(bad_root):
    with pytest.raises(UnsafeStoreError, match="/dev/shm"):
        ShmStoreWriter(bad_root, make_namespace())


def test_every_component_of_the_root_is_checked(shm_root):
    # A parent directory that another user could write into is refused,
    # whether ensure_private_shm_dir created it or found it.
    os.mkdir(shm_root, 0o755)
    os.chmod(shm_root, 0o755)
    with pytest.raises(UnsafeStoreError, match="mode 755"):
        ShmStoreWriter(os.path.join(shm_root, "store"), make_namespace())
    os.chmod(shm_root, 0o700)
    os.chown(shm_root, NOBODY, NOBODY)
    with pytest.raises(UnsafeStoreError, match="owned by uid"):
        ShmStoreWriter(os.path.join(shm_root, "store"), make_namespace())
    os.chown(shm_root, os.geteuid(), os.getegid())
    w = ShmStoreWriter(os.path.join(shm_root, "a", "b"), make_namespace())
    for p in (shm_root, shm_root + "/a", shm_root + "/a/b"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700
    w.close()


def test_symlinked_root_refused(shm_root):
    os.makedirs(shm_root + "-target", mode=0o700)
    os.makedirs(shm_root, mode=0o700)
    link = os.path.join(shm_root, "link")
    os.symlink(shm_root + "-target", link)
    try:
        with pytest.raises(UnsafeStoreError):
            ShmStoreWriter(link, make_namespace())
    finally:
        os.rmdir(shm_root + "-target")


def test_planted_symlinks_are_refused_and_never_followed(writer, shm_root):
    ref = put(writer, [(key(1), b"x" * 100)]).refs[0]
    path = ns_dir(writer)
    victim = os.path.join(shm_root, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    (arena,) = arenas(path)
    os.rename(os.path.join(path, arena), os.path.join(path, "moved"))
    os.symlink(victim, os.path.join(path, arena))
    r = ShmStoreReader(shm_root, writer.namespace)
    with pytest.raises(UnsafeStoreError, match="symlink"):
        read(r, [ref])
    r.close()
    fake_ns = "f" * 32
    os.symlink(path, os.path.join(shm_root, fake_ns))
    with pytest.raises(UnsafeStoreError):
        ShmStoreReader(shm_root, fake_ns)
    rep = collect_stale_stores(shm_root, 0.0)
    assert fake_ns in rep.refused
    assert os.path.islink(os.path.join(shm_root, fake_ns))
    os.unlink(os.path.join(shm_root, fake_ns))
    # Collection of a dead store never follows or deletes a planted link.
    os.unlink(os.path.join(path, arena))
    os.rename(os.path.join(path, "moved"), os.path.join(path, arena))
    os.symlink(victim, os.path.join(path, "0000000000000099.arena"))
    make_dead(path)
    rep = collect_stale_stores(shm_root, 3600.0, exclude=())
    assert any("0000000000000099.arena" in e for e in rep.refused)
    assert os.path.islink(os.path.join(path, "0000000000000099.arena"))
    with open(victim, "rb") as f:
        assert f.read() == b"precious"


def test_foreign_owned_and_loose_entries_refused(shm_root, writer):
    ref = put(writer, [(key(1), b"x" * 100)]).refs[0]
    path = ns_dir(writer)
    foreign = os.path.join(shm_root, "e" * 32)
    os.mkdir(foreign, 0o700)
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.raises(UnsafeStoreError, match="owned by uid"):
        ShmStoreReader(shm_root, "e" * 32)
    assert "e" * 32 in collect_stale_stores(shm_root, 0.0).refused
    assert os.path.exists(foreign)
    (arena,) = arenas(path)
    os.chown(os.path.join(path, arena), NOBODY, NOBODY)
    r = ShmStoreReader(shm_root, writer.namespace)
    with pytest.raises(UnsafeStoreError, match="owned by uid"):
        read(r, [ref])
    r.close()
    os.chown(os.path.join(path, arena), os.geteuid(), os.getegid())
    os.chmod(os.path.join(path, arena), 0o640)
    r = ShmStoreReader(shm_root, writer.namespace)
    with pytest.raises(UnsafeStoreError, match="mode 640"):
        read(r, [ref])
    r.close()
    os.chmod(os.path.join(path, arena), 0o600)
    os.chmod(os.path.join(path, "index.log"), 0o644)
    with pytest.raises(UnsafeStoreError, match="mode 644"):
        ShmStoreReader(shm_root, writer.namespace)


def test_corruption_is_caught_by_the_checksum(shm_root, writer):
    refs = put(writer, [(key(i), payload(i, 3000)) for i in range(4)]).refs
    path = ns_dir(writer)
    (arena,) = arenas(path)
    with open(os.path.join(path, arena), "r+b") as f:
        f.seek(3000 * 2 + 64 * 2 + 17)  # inside object 2 (64-byte aligned)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    r = ShmStoreReader(shm_root, writer.namespace)
    assert read(r, [refs[1]]) == [payload(1, 3000)]
    out = np.full(12000, 7, np.uint8)
    with pytest.raises(ChecksumMismatchError, match=key(2)):
        read_refs(r, refs, out, [[0, 3000, 3000 * i] for i in range(4)])
    assert (out == 7).all()
    assert r.checksum_failures == 1
    r.close()


def test_identity_liveness():
    me = WriterIdentity.current()
    assert me.is_alive() is True
    assert WriterIdentity(**{**me.__dict__, "pid": 2**22 + 7}).is_alive() is False
    later = WriterIdentity(**{**me.__dict__, "start_ticks": me.start_ticks + 1})
    assert later.is_alive() is False
    assert WriterIdentity(**{**me.__dict__, "boot_id": "x"}).is_alive() is False
    assert WriterIdentity(**{**me.__dict__, "pid_ns": me.pid_ns + 1}).is_alive() is None


# ----------------------------------------------------------------- processes
def _writer(
    child_cmd, root, ns, nb, bs, size, fault=-1, stage="-", hold=False, status=""
):
    args = [str(a) for a in (nb, bs, size, fault, stage, "1" if hold else "0")]
    return subprocess.Popen(
        [*child_cmd, "writer", root, ns, *args] + ([status] if status else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _reader(child_cmd, root, ns, total, size, wait_all):
    out = subprocess.run(
        [
            *child_cmd,
            "reader",
            root,
            ns,
            str(total),
            str(size),
            "1" if wait_all else "0",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reader_process_while_writer_publishes(shm_root, child_cmd):
    ns = make_namespace("concurrent")
    w = _writer(child_cmd, shm_root, ns, 40, 25, 2000, hold=True)
    assert w.stdout is not None
    assert w.stdout.readline().startswith("published 0")
    res = _reader(child_cmd, shm_root, ns, 1000, 2000, wait_all=True)
    assert res["mismatches"] == 0 and len(res["seen"]) == 1000
    w.communicate("")
    assert w.returncode == 0
    # Its writer exited without closing it: proven dead, collected at once.
    assert ns in collect_stale_stores(shm_root, 3600.0).removed


@pytest.mark.parametrize("stage", ["after_data", "mid_index"])
def test_sigkill_mid_publish_is_all_or_nothing(shm_root, child_cmd, stage):
    ns = make_namespace("kill", stage)
    w = _writer(child_cmd, shm_root, ns, 6, 10, 3000, fault=3, stage=stage)
    out, _ = w.communicate()
    assert w.returncode == -9
    assert out.splitlines()[-1] == "published 2"
    res = _reader(child_cmd, shm_root, ns, 60, 3000, wait_all=False)
    assert res["mismatches"] == 0
    assert res["seen"] == list(range(30))  # batches 0-2, nothing of batch 3


def test_sigkill_landing_inside_a_put(shm_root, child_cmd):
    """Kill the writer while it is inside ``put_batch`` (proven by a status
    word it sets in ``fill`` and clears after the put returns), then check
    that readers see whole batches only."""
    status = os.path.join(os.environ["TMPDIR"], f"kill-status-{os.getpid()}")
    landed = 0
    try:
        for attempt in range(20):
            with open(status, "wb") as f:
                f.write(b"\0" * 4096)
            fd = os.open(status, os.O_RDWR)
            st = np.frombuffer(mmap.mmap(fd, 4096), np.int64)
            os.close(fd)
            ns = make_namespace("kill-any", attempt)
            w = _writer(child_cmd, shm_root, ns, 400, 64, 20000, status=status)
            deadline = time.monotonic() + 60
            while st[0] < 3 and time.monotonic() < deadline:
                pass
            while st[1] != 1 and time.monotonic() < deadline:
                pass
            w.kill()
            w.communicate()
            inside = int(st[1]) == 1
            done = int(st[0])
            res = _reader(child_cmd, shm_root, ns, 400 * 64, 20000, wait_all=False)
            n = len(res["seen"])
            assert res["mismatches"] == 0
            assert res["seen"] == list(range(n)) and n % 64 == 0  # whole batches
            assert n // 64 in (done, done + 1)
            if inside:
                landed += 1
                if landed >= 3:
                    break
    finally:
        os.unlink(status)
    assert landed >= 3, "the kill never landed inside a put"


def test_live_writers_are_never_collected_dead_ones_at_once(shm_root, child_cmd):
    ns = make_namespace("live")
    w = _writer(child_cmd, shm_root, ns, 1, 1, 10, hold=True)
    assert w.stdout is not None
    w.stdout.readline()
    path = os.path.join(shm_root, ns)
    os.utime(path, (0, 0))
    for name in os.listdir(path):
        os.utime(os.path.join(path, name), (0, 0))  # idle since 1970
    assert ns in collect_stale_stores(shm_root, 0.0).kept_alive
    w.kill()
    w.wait()
    # Proven dead: the next writer on the node collects it at start-up,
    # although the TTL is an hour.
    mine = ShmStoreWriter(shm_root, make_namespace(), inactive_ttl_s=3600.0)
    assert not os.path.exists(path)
    assert mine.stats().stores_collected == 1
    mine.close()
    # The last store to close takes the empty root with it.
    assert not os.path.exists(shm_root)


def test_a_dead_writers_store_of_the_same_namespace_is_taken_over(shm_root, child_cmd):
    # Namespaces are fresh per engine instance; an earlier writer of the same
    # one, SIGKILLed inside a put, left its store. Proven dead: collected,
    # and the new writer starts empty (nothing of the old store is served).
    ns = make_namespace("same")
    w = _writer(child_cmd, shm_root, ns, 3, 10, 3000, fault=2, stage="after_data")
    w.communicate()
    assert w.returncode == -9
    mine = ShmStoreWriter(shm_root, ns, capacity_bytes=1 << 20)
    assert mine.stats().stores_collected == 1
    assert mine.lookup([key(0)]) == [None]
    r = ShmStoreReader(shm_root, ns)
    with pytest.raises(ObjectMissingError):
        read(r, [ObjectRef(key(0), checksum(payload(0, 3000)), 3000)])
    ref = put(mine, [(key(0), b"new")]).refs[0]
    assert read(r, [ref]) == [b"new"]
    r.close()
    # Undecidable (another pid namespace) and active within the TTL: kept.
    fn = os.path.join(ns_dir(mine), "writer.json")
    with open(fn, "rb") as f:
        d = json.loads(f.read())
    d["pid_ns"] += 1
    with open(fn, "wb") as f:
        f.write(json.dumps(d).encode())
    with pytest.raises(UnsafeStoreError, match="cannot be checked"):
        ShmStoreWriter(shm_root, ns, capacity_bytes=1 << 20)
    assert os.path.exists(fn)
    mine.close()


def test_a_live_writers_namespace_is_never_taken_over(shm_root, child_cmd):
    ns = make_namespace("live-same")
    w = _writer(child_cmd, shm_root, ns, 1, 1, 10, hold=True)
    try:
        assert w.stdout is not None
        assert w.stdout.readline().startswith("published 0")
        with pytest.raises(UnsafeStoreError, match="still running"):
            ShmStoreWriter(shm_root, ns)
        assert _reader(child_cmd, shm_root, ns, 1, 10, wait_all=False)["seen"] == [0]
    finally:
        w.kill()
        w.wait()


def test_undecidable_writer_waits_for_the_ttl(shm_root, writer):
    put(writer, [(key(1), b"x")])
    path = ns_dir(writer)
    fn = os.path.join(path, "writer.json")
    with open(fn, "rb") as f:
        d = json.loads(f.read())
    d["pid_ns"] += 1  # another pid namespace: liveness cannot be decided
    with open(fn, "wb") as f:
        f.write(json.dumps(d).encode())
    other = make_namespace("other")
    rep = collect_stale_stores(shm_root, 3600.0, exclude=(other,))
    assert writer.namespace in rep.kept_recent
    for name in [*os.listdir(path), "."]:
        os.utime(os.path.join(path, name), (0, 0))
    assert writer.namespace in collect_stale_stores(shm_root, 3600.0).removed


def test_store_io_error_is_typed(writer, monkeypatch):
    def broken(fd, bufs, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files_mod, "write_all", broken)
    with pytest.raises(StoreIOError):
        put(writer, [(key(1), b"x")])
    assert writer.lookup([key(1)]) == [None]


# ----------------------------------------------------------------- damage
def _upkeep_now(w: ShmStoreWriter) -> None:
    w._repair.last_check = 0.0  # the damage check runs at most every 100 ms
    w.maintain()


def test_a_removed_store_is_recreated_and_readers_follow(shm_root):
    w = ShmStoreWriter(shm_root, make_namespace(), capacity_bytes=1 << 20)
    r = ShmStoreReader(shm_root, w.namespace)
    old = put(w, [(key(i), payload(i, 300)) for i in range(4)], owner="a").refs
    assert read(r, old[:1]) == [payload(0, 300)]  # the reader maps the arena
    shutil.rmtree(shm_root)  # an operator's rm -rf while serving
    with pytest.raises(StoreClosedError):
        read(r, old)
    _upkeep_now(w)
    assert w.stats().stores_recreated == 1
    path = ns_dir(w)
    for p in (shm_root, path):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700
    # The old routes are gone (typed), never served from stale mappings;
    # new ones are written and read as usual, retention included.
    with pytest.raises(ObjectMissingError):
        read(r, old[:1])
    assert w.lookup([key(0)]) == [None]
    new = put(w, [(key(0), payload(0, 300)), (key(9), b"fresh")], owner="a").refs
    assert read(r, new) == [payload(0, 300), b"fresh"]
    assert w.release("a") == 5  # keys 0-3 and 9
    r.close()
    w.close()
    assert not os.path.exists(shm_root)


def test_a_file_in_place_of_the_root_fails_typed_until_removed(shm_root):
    w = ShmStoreWriter(shm_root, make_namespace(), capacity_bytes=1 << 20)
    r = ShmStoreReader(shm_root, w.namespace)
    put(w, [(key(1), b"x")])
    shutil.rmtree(shm_root)
    with open(shm_root, "w") as f:
        f.write("not a directory")
    _upkeep_now(w)
    with pytest.raises(StoreIOError, match="cannot be recreated"):
        put(w, [(key(2), b"y")])
    with pytest.raises(StoreClosedError):
        read(r, [ObjectRef(key(1), checksum(b"x"), 1)])
    _upkeep_now(w)  # still blocked: says so, keeps failing typed
    with pytest.raises(StoreIOError):
        put(w, [(key(2), b"y")])
    os.unlink(shm_root)
    _upkeep_now(w)
    ref = put(w, [(key(2), b"y")]).refs[0]
    assert read(r, [ref]) == [b"y"]
    r.close()
    w.close()
    assert not os.path.exists(shm_root)


def test_a_removed_index_log_means_a_fresh_store(writer, shm_root):
    r = ShmStoreReader(shm_root, writer.namespace)
    old = put(writer, [(key(1), b"x")]).refs
    os.unlink(os.path.join(ns_dir(writer), "index.log"))
    with pytest.raises(StoreClosedError):
        read(r, old)
    _upkeep_now(writer)
    assert writer.stats().stores_recreated == 1
    assert sorted(os.listdir(ns_dir(writer)))[-2:] == ["index.log", "writer.json"]
    with pytest.raises(ObjectMissingError):
        read(r, old)
    assert read(r, put(writer, [(key(2), b"y")]).refs) == [b"y"]
    r.close()


def test_a_deleted_arena_is_retired_and_its_retained_objects_kept(shm_root):
    w = ShmStoreWriter(
        shm_root, make_namespace(), capacity_bytes=1 << 20, arena_bytes=64 << 10
    )
    kept = put(w, [(key(i), payload(i, 500)) for i in range(3)], owner="run").refs
    loose = put(w, [(key(i), payload(i, 500)) for i in range(3, 6)]).refs
    path = ns_dir(w)
    (victim,) = arenas(path)
    os.unlink(os.path.join(path, victim))  # a reader never mapped it
    _upkeep_now(w)
    assert w.stats().arenas_lost == 1
    assert victim not in arenas(path)
    r = ShmStoreReader(shm_root, w.namespace)  # sees only what exists
    # Retained objects were copied out of the writer's own mapping.
    assert read(r, kept) == [payload(i, 500) for i in range(3)]
    for ref in loose:
        with pytest.raises(ObjectMissingError):
            read(r, [ref])
    assert w.lookup([loose[0].key]) == [None]
    more = put(w, [(key(7), b"later")]).refs
    assert read(r, more) == [b"later"]
    r.close()
    w.close()


def test_too_little_room_under_the_root_is_refused_at_start():
    """A /dev/shm of 1 MiB (a container's small default) cannot hold the
    default capacity's two 64 MiB arenas: the writer refuses to start with
    the fix in the message, and leaves nothing; a capacity whose arenas fit
    starts."""
    with small_tmpfs("1m") as mnt:
        root = os.path.join(mnt, "store")
        with pytest.raises(StoreCapacityError, match="--shm-size") as e:
            ShmStoreWriter(root, make_namespace())
        assert "needs at least 128.0 MiB" in str(e.value)
        assert os.listdir(mnt) == []
        w = ShmStoreWriter(root, make_namespace(), capacity_bytes=4 << 20)
        w.close()
        assert os.listdir(mnt) == []
