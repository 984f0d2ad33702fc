# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read-many objects (``readmany.py``): one object in ``/dev/shm`` read by
byte range by many processes until its producer, the driver or the last of
its readers removes it. Real ``/dev/shm``, real processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.host_transport import helpers
from vllm_host_transport import (
    HostTransportConfig,
    HostTransportConnector,
    HostTransportError,
    ScopeMissingError,
)
from vllm_host_transport import readmany as rm
from vllm_host_transport.discovery import ScopeDir, ScopeSquattedError
from vllm_host_transport.readmany import (
    ReadableMissingError,
    open_readable,
    readable_name,
    remove_readable,
)

ROOT = Path(__file__).resolve().parents[2]
HEADER = b"routes-header-".ljust(192, b"h")
BODY = (np.arange(3 << 20, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
SOURCE = HEADER + BODY.tobytes()


def _own_files(scope_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(scope_dir) if n.endswith(rm.SUFFIX))


def _tmp_files(scope_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(scope_dir) if n.startswith(".tmp-"))


def _read(scope: str, key: str, offset: int, n: int) -> bytes:
    out = np.empty(n, np.uint8)
    with open_readable(scope, key) as obj:
        obj.read_into(offset, out)
    return out.tobytes()


def _reader(scope: str, key: str, index: int, readers: int, start, out) -> None:
    """Forked reader ``index``: a range of its own, one shared with its
    neighbour and the header, all checked against the source; then it
    releases."""
    try:
        with open_readable(scope, key) as obj:
            assert obj.size == len(SOURCE)
            start.wait(30)
            share = len(SOURCE) // readers
            ranges = [
                (index * share, share),  # disjoint
                (max(index * share - share // 2, 0), share),  # overlapping
                (0, len(HEADER)),  # every reader reads the header
            ]
            ok = True
            for offset, n in ranges:
                dst = np.empty(n, np.uint8)
                obj.read_into(offset, dst)
                ok = ok and dst.tobytes() == SOURCE[offset : offset + n]
            out.put((index, ok, obj.release(index, readers)))
    except BaseException as e:  # reported, not lost in the child
        out.put((index, f"{type(e).__name__}: {e}", False))


def test_eight_processes_read_ranges_and_the_last_release_removes_it(
    make_conn, scope
) -> None:  # noqa: ANN001
    prod = make_conn()
    assert prod.put_readable("routes-1", [HEADER, BODY])
    assert _own_files(prod.scope_dir) == [readable_name("routes-1")]
    start, out = helpers.CTX.Event(), helpers.CTX.Queue()
    readers = [
        helpers.CTX.Process(target=_reader, args=(scope, "routes-1", i, 8, start, out))
        for i in range(8)
    ]
    for p in readers:
        p.start()
    start.set()
    results = sorted(out.get(timeout=60) for _ in readers)
    for p in readers:
        p.join(30)
        assert p.exitcode == 0
    assert [(i, ok) for i, ok, _ in results] == [(i, True) for i in range(8)]
    # Exactly one release completed the set, and it removed the object.
    assert sum(last for _, _, last in results) == 1
    assert _own_files(prod.scope_dir) == []
    t0 = time.monotonic()
    with pytest.raises(ReadableMissingError):
        open_readable(scope, "routes-1")
    assert time.monotonic() - t0 < 0.5  # at once, no waiting
    assert prod.readables_gone(["routes-1"]) == ["routes-1"]
    prod.close()
    assert not os.path.exists(os.path.join("/dev/shm", ScopeDir.dir_name(scope)))


def test_release_is_idempotent_per_reader_and_refuses_another_count(
    make_conn, scope
) -> None:  # noqa: ANN001
    prod = make_conn()
    assert prod.put_readable("k", [b"abc"])
    with open_readable(scope, "k") as a, open_readable(scope, "k") as b:
        assert a.release(0, 3) is False
        assert a.release(0, 3) is False  # again: no effect
        assert b.release(0, 3) is False  # the same index from another handle
        with pytest.raises(ValueError, match="released by 3 readers"):
            b.release(1, 4)
        for bad in ((3, 3), (-1, 3), (0, 0), (0, rm.MAX_READERS + 1)):
            with pytest.raises(ValueError):
                b.release(*bad)
        assert b.release(1, 3) is False
        assert os.path.exists(os.path.join(prod.scope_dir, readable_name("k")))
        assert a.release(2, 3) is True
        assert b.release(2, 3) is False  # gone already
        still = bytearray(3)
        a.read_into(0, still)  # still readable here
        assert still == b"abc"
    with pytest.raises(ReadableMissingError):
        open_readable(scope, "k")


def test_a_thousand_and_more_readers_are_counted(make_conn, scope) -> None:  # noqa: ANN001
    prod = make_conn()
    readers = 1500
    assert prod.put_readable("many", [b"x" * 10])
    with open_readable(scope, "many") as obj:
        # Out of order, each twice, the last index last.
        for i in [*range(readers - 2, -1, -2), *range(readers - 3, -1, -2)]:
            assert obj.release(i, readers) is False
            assert obj.release(i, readers) is False
        assert obj.release(readers - 1, readers) is True
    assert _own_files(prod.scope_dir) == []


def test_the_driver_removes_it_and_an_open_handle_keeps_reading(
    make_conn, scope
) -> None:  # noqa: ANN001
    prod = make_conn()
    assert prod.put_readable("k", [HEADER, BODY])
    held = open_readable(scope, "k")
    assert remove_readable(scope, "k") is True
    assert remove_readable(scope, "k") is False
    with pytest.raises(ReadableMissingError):
        open_readable(scope, "k")
    # Removal stops new opens; a reader that has it open reads on.
    dst = np.empty(len(SOURCE) - 100, np.uint8)
    held.read_into(100, dst)
    assert dst.tobytes() == SOURCE[100:]
    assert held.release(0, 1) is False  # removed by the driver, not by it
    with pytest.raises(ValueError, match="outside"):
        held.read_into(len(SOURCE) - 1, bytearray(2))
    held.close()
    with pytest.raises(HostTransportError, match="closed"):
        held.read_into(0, bytearray(1))
    assert prod.readables_gone(["k"]) == ["k"]


def test_a_missing_or_foreign_scope_is_a_typed_error(scope) -> None:  # noqa: ANN001
    with pytest.raises(ScopeMissingError):
        open_readable(scope, "k")
    with pytest.raises(ScopeMissingError):
        remove_readable(scope, "k")
    path = os.path.join("/dev/shm", ScopeDir.dir_name(scope))
    os.mkdir(path, 0o700)
    os.chmod(path, 0o755)  # not private: refused, nothing read from it
    try:
        with pytest.raises(ScopeSquattedError):
            open_readable(scope, "k")
    finally:
        os.rmdir(path)


def test_close_withdraws_and_readables_gone_reports(make_conn, scope) -> None:  # noqa: ANN001
    prod = make_conn()
    for key in ("a", "b", "c", "d"):
        assert prod.put_readable(key, [key.encode() * 100])
    with open_readable(scope, "a") as obj:
        assert obj.release(0, 1) is True
    assert remove_readable(scope, "b") is True
    assert prod.readables_gone(["a", "b", "c", "not-mine"]) == ["a", "b"]
    assert prod.readables_gone(["a", "b", "c"]) == []  # not tracked any more
    assert prod.withdraw_readable("c") is True
    assert prod.withdraw_readable("c") is False
    assert prod.withdraw_readable("never") is False
    assert _read(scope, "d", 0, 100) == b"d" * 100
    health = prod.health()
    assert health["readable_puts"] == 4 and health["readables_withdrawn"] == 1
    other = make_conn()  # keeps the scope open
    prod.close()
    assert _own_files(other.scope_dir) == []
    assert prod.put_readable("e", [b"e"]) is False  # closed
    other.close()
    assert not os.path.exists(os.path.join("/dev/shm", ScopeDir.dir_name(scope)))


def test_files_are_private_names_hashed_symlinks_refused(make_conn, scope) -> None:  # noqa: ANN001
    prod = make_conn()
    key = "req-17/../../etc/passwd"
    assert prod.put_readable(key, [b"payload"])
    (name,) = _own_files(prod.scope_dir)
    assert name == readable_name(key) and len(name) == 32 + len(rm.SUFFIX)
    st = os.stat(os.path.join(prod.scope_dir, name))
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    # One publication per key: a second put is refused, the first stays.
    assert prod.put_readable(key, [b"other"]) is False
    assert _read(scope, key, 0, 7) == b"payload"
    assert _tmp_files(prod.scope_dir) == []

    # A symlink planted at an object's name is neither followed nor removed.
    target = os.path.join(prod.scope_dir, "target")
    with open(target, "wb") as f:
        f.write(b"secret")
    planted = os.path.join(prod.scope_dir, readable_name("planted"))
    os.symlink(target, planted)
    try:
        assert prod.put_readable("planted", [b"x"]) is False
        with pytest.raises(HostTransportError, match="symlink"):
            open_readable(scope, "planted")
        with pytest.raises(HostTransportError, match="symlink"):
            remove_readable(scope, "planted")
        assert os.path.islink(planted)
        with open(target, "rb") as f:
            assert f.read() == b"secret"
    finally:
        os.unlink(planted)
        os.unlink(target)
    assert prod.health()["readable_put_failures"] == 2


def test_parts_and_bounds(make_conn, scope) -> None:  # noqa: ANN001
    prod = make_conn(max_payload_bytes=1 << 16)
    arr = np.arange(100, dtype=np.int64)
    assert prod.put_readable("parts", [b"ab", memoryview(b"cd"), arr, bytearray(0)])
    expect = b"abcd" + arr.tobytes()
    assert _read(scope, "parts", 0, len(expect)) == expect
    with open_readable(scope, "parts") as obj:
        assert obj.size == len(expect)
        wide = np.zeros(3, np.int64)
        obj.read_into(4 + 8, wide)  # any writable buffer, bytes counted
        assert wide.tolist() == [1, 2, 3]
        with pytest.raises(ValueError):
            obj.read_into(0, b"read-only")
    assert prod.put_readable("empty", [])
    assert _read(scope, "empty", 0, 0) == b""
    assert prod.put_readable("big", [bytes((1 << 16) + 1)]) is False
    with pytest.raises(TypeError):
        prod.put_readable("strided", [np.arange(10)[::2]])


def _publish_and_hang(scope: str, root: str, half_write: bool, ready, _go) -> None:
    """Forked producer: publishes two objects and hangs (SIGKILLed), or
    hangs half-way through writing a third."""
    c = HostTransportConnector(HostTransportConfig(scope=scope, shm_root=root))
    assert c.put_readable("whole-1", [BODY])
    assert c.put_readable("whole-2", [HEADER])
    if half_write:
        real = rm.write_all

        def stall(fd, bufs, offset):  # noqa: ANN001
            real(fd, [bytes(len(bufs[0]) // 2)], offset)
            ready.set()
            time.sleep(120)  # SIGKILLed here

        rm.write_all = stall
        c.put_readable("partial", [BODY])
    ready.set()
    time.sleep(120)


def _kill_producer(scope: str, root: str, half_write: bool) -> None:
    ready = helpers.CTX.Event()
    child = helpers.CTX.Process(
        target=_publish_and_hang, args=(scope, root, half_write, ready, None)
    )
    child.start()
    assert ready.wait(60)
    if half_write:
        # Mid-write: nothing of it is visible, its temporary is.
        scope_dir = os.path.join(root, ScopeDir.dir_name(scope))
        with pytest.raises(ReadableMissingError):
            open_readable(scope, "partial", shm_root=root)
        assert len(_tmp_files(scope_dir)) == 1
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)


@pytest.mark.parametrize("looker", ["remove_dead", "next_connector"])
def test_a_killed_producer_leaves_nothing_visible_and_is_swept(
    make_conn, scope, looker
) -> None:  # noqa: ANN001
    watcher = make_conn() if looker == "remove_dead" else None
    _kill_producer(scope, "/dev/shm", half_write=True)
    scope_dir = os.path.join("/dev/shm", ScopeDir.dir_name(scope))
    assert len(_own_files(scope_dir)) == 2 and len(_tmp_files(scope_dir)) == 1
    if watcher is not None:
        assert watcher.remove_dead() == 1
    else:
        watcher = make_conn()  # its join looks
    assert _own_files(scope_dir) == [] and _tmp_files(scope_dir) == []
    assert watcher.health()["dead_readables_removed"] == 2
    with pytest.raises(ReadableMissingError):
        open_readable(scope, "partial")


def test_an_object_of_a_killed_producer_is_not_opened(make_conn, scope) -> None:  # noqa: ANN001
    keeper = make_conn()  # keeps the scope; never looks
    _kill_producer(scope, "/dev/shm", half_write=False)
    assert len(_own_files(keeper.scope_dir)) == 2
    with pytest.raises(ReadableMissingError, match="producer is gone"):
        open_readable(scope, "whole-1")
    assert _own_files(keeper.scope_dir) == [readable_name("whole-2")]


def test_abandoned_scopes_are_collected_with_their_objects() -> None:
    """The sweep at engine start (``collect_abandoned_scopes``) removes a
    scope whose only producer was killed, read-many objects included."""
    from vllm_host_transport import discovery

    if not discovery._OWN_NAME_RE.match(readable_name("k")):
        pytest.skip(
            "discovery._OWN_NAME_RE does not name read-many objects yet "
            "(requested in .cache/coord/requests.md): a scope holding one "
            "cannot be removed by the collector"
        )
    root = f"/dev/shm/test-root-{uuid.uuid4().hex[:8]}"
    os.mkdir(root, 0o700)
    try:
        _kill_producer("killed", root, half_write=True)
        killed = ScopeDir.dir_name("killed")
        assert discovery.collect_abandoned_scopes(root) == [killed]
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


_FOREIGN_READER = """
import json, sys
import numpy as np
from vllm_host_transport.readmany import open_readable
scope, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open_readable(scope, key) as obj:
    dst = np.empty(n, np.uint8)
    obj.read_into(obj.size - n, dst)
    print(json.dumps({"size": obj.size, "tail": dst.tobytes().hex(),
                      "last": obj.release(0, 1)}))
"""


def test_a_reader_in_another_pid_namespace_reads_and_releases(make_conn, scope) -> None:  # noqa: ANN001
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a new PID namespace needs root and unshare(1)")
    prod = make_conn()
    assert prod.put_readable("k", [HEADER, BODY])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable]
    r = subprocess.run(
        [*argv, "-c", _FOREIGN_READER, scope, "k", "4096"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode and "unshare" in r.stderr and "Traceback" not in r.stderr:
        pytest.skip(f"unshare --pid refused here: {r.stderr.strip()[:300]}")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got == {"size": len(SOURCE), "tail": SOURCE[-4096:].hex(), "last": True}
    assert _own_files(prod.scope_dir) == []
