# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-node artifact store under a trusted ``/dev/shm`` root.

Physical layout of one store (one *namespace*, one writer process)::

    <root>/                      0700, owned by the engine's user
      <namespace>/               0700; namespace = hex digest
        writer.json              0600; pid, process start time, boot id
        index.log                0600; append-only log of index batches
        <16 hex>.arena           0600; append-only object data
        <16 hex>.tmp             0600; index snapshot being written

Objects are packed: a batched put appends all its objects to the active
arena with one ``pwritev`` and then appends one index batch (a header with a
CRC over the batch and one 64-byte record per object) with one ``pwrite``.
A reader only trusts index batches whose CRC matches, and only after the
data write has returned, so a reader sees a whole object or nothing, also
when the writer is killed between (or in the middle of) the two writes.
Readers keep an in-memory index that they extend by reading the log tail,
and read a request's objects with one ``preadv`` per contiguous run (not one
open per object). Every read verifies the object's checksum.

Eviction works on whole arenas, oldest first: pinned objects in the victim
arena are copied into the active arena (``MOVE`` records), the others are
dropped (``DROP`` records), then the arena file is unlinked. Files are never
truncated or rewritten in place, so a reader that opened an arena before it
was unlinked still reads the bytes the index described.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm.distributed.artifact_connector.store import (
    ArtifactStoreError,
    ChecksumAlgorithm,
    ChecksumMismatchError,
    KeyOrRef,
    ObjectBatch,
    ObjectDivergenceError,
    ObjectMissingError,
    ObjectRef,
    ObjectStore,
    Payload,
    PutResult,
    PutStatus,
    ReadOnlyStoreError,
    StoreCapacityError,
    StoreClosedError,
    StoreStats,
    UnsafeStoreError,
    compute_checksum,
    default_checksum,
    ref_key,
    validate_key,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

SHM_BASE = "/dev/shm"
DEFAULT_CAPACITY_BYTES = 8 << 30
DEFAULT_INACTIVE_TTL_S = 3600.0
DEFAULT_COLLECT_INTERVAL_S = 300.0
_HEARTBEAT_INTERVAL_S = 10.0

WRITER_FILE = "writer.json"
INDEX_FILE = "index.log"
_NAMESPACE_RE = re.compile(r"[0-9a-f]{16,64}\Z")
_ARENA_RE = re.compile(r"([0-9a-f]{16})\.arena\Z")
_TMP_RE = re.compile(r"[0-9a-f]{16}\.tmp\Z")

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_IOV_MAX = 1024

# Index log format.
_LOG_MAGIC = b"VARTLOG1"
_LOG_HEADER = struct.Struct("<8sHB5xI")  # magic, version, algo, crc -> 20 B
_LOG_VERSION = 1
_BATCH_MAGIC = b"VBAT"
_BATCH_HEADER = struct.Struct("<4sIII")  # magic, count, records crc, hdr crc
_RECORD = struct.Struct("<B3xI32sQQQ")  # type, arena, key, off, len, checksum
_REC_PUT = 1  # new version (or identical re-put); becomes the current one
_REC_MOVE = 2  # same version, new location
_REC_DROP = 3  # version gone
_REC_NOCURRENT = 4  # key keeps old versions but has no current version


# --------------------------------------------------------------------------
# Liveness
# --------------------------------------------------------------------------
def _read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/pid/stat``
    field 22), or ``None`` if the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the
    # last ')'.
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class WriterIdentity:
    """Who writes a store: enough to tell whether that process still runs."""

    pid: int
    start_ticks: int
    boot_id: str
    pid_ns: int
    uid: int
    created: float

    @classmethod
    def current(cls) -> WriterIdentity:
        pid = os.getpid()
        return cls(
            pid=pid,
            start_ticks=process_start_ticks(pid) or 0,
            boot_id=_read_boot_id(),
            pid_ns=_pid_ns_inode(),
            uid=os.geteuid(),
            created=time.time(),
        )

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": 1,
                "pid": self.pid,
                "start_ticks": self.start_ticks,
                "boot_id": self.boot_id,
                "pid_ns": self.pid_ns,
                "uid": self.uid,
                "created": self.created,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WriterIdentity:
        d = json.loads(raw)
        if not isinstance(d, dict) or d.get("format") != 1:
            raise ValueError("unknown writer record format")
        return cls(
            pid=int(d["pid"]),
            start_ticks=int(d["start_ticks"]),
            boot_id=str(d["boot_id"]),
            pid_ns=int(d["pid_ns"]),
            uid=int(d["uid"]),
            created=float(d["created"]),
        )

    def is_alive(self) -> bool | None:
        """True if the writer process still runs, False if it is gone (or
        its pid now belongs to another process), None if this process cannot
        tell (different pid namespace)."""
        if self.boot_id and self.boot_id != _read_boot_id():
            return False
        if self.pid_ns and self.pid_ns != _pid_ns_inode():
            return None
        pidfd = -1
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                pidfd = pidfd_open(self.pid)
            except ProcessLookupError:
                return False
            except OSError:
                pidfd = -1
        else:  # pragma: no cover - Linux < 5.3 / Python without pidfd
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
        try:
            if process_start_ticks(self.pid) != self.start_ticks:
                return False  # pid reused by another process
            if pidfd >= 0:
                # A pidfd becomes readable when its process exits: the start
                # time we read belonged to the live process the pidfd names.
                r, _, _ = select.select([pidfd], [], [], 0)
                if r:
                    return False
            return True
        finally:
            if pidfd >= 0:
                os.close(pidfd)


# --------------------------------------------------------------------------
# Safe file-system helpers
# --------------------------------------------------------------------------
def _shm_base() -> str:
    return os.path.realpath(SHM_BASE)


def validate_root(root: str) -> str:
    """Return the canonical root path, or raise :class:`UnsafeStoreError`
    unless ``root`` is a directory path strictly under ``/dev/shm``."""
    if not isinstance(root, str) or not root or "\x00" in root:
        raise UnsafeStoreError(f"invalid artifact store root {root!r}")
    if not os.path.isabs(root):
        raise UnsafeStoreError(
            f"artifact store root must be an absolute path under {SHM_BASE}, "
            f"got {root!r}"
        )
    base = _shm_base()
    norm = os.path.normpath(root)
    rel = os.path.relpath(norm, SHM_BASE)
    real = os.path.realpath(root)
    # The path must be textually under /dev/shm and must not pass through a
    # symlink below /dev/shm (only /dev/shm itself may be a symlink).
    if (
        rel == "."
        or rel.startswith("..")
        or real != os.path.join(base, rel)
        or os.path.commonpath([base, real]) != base
    ):
        raise UnsafeStoreError(
            f"artifact store root {root!r} (resolves to {real!r}) is not a "
            f"directory under {SHM_BASE} reached without symlinks; choose e.g. "
            f"{SHM_BASE}/vllm-artifacts-{os.geteuid()}"
        )
    return real


def _check_owned(st: os.stat_result, what: str, *, directory: bool) -> None:
    uid = os.geteuid()
    if directory and not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreError(f"{what} is not a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise UnsafeStoreError(f"{what} is not a regular file")
    if st.st_uid != uid:
        raise UnsafeStoreError(
            f"{what} is owned by uid {st.st_uid}, not by this process's uid "
            f"{uid}; refusing to use it"
        )
    if st.st_mode & 0o077:
        raise UnsafeStoreError(
            f"{what} has mode {stat.S_IMODE(st.st_mode):o}; group/other access "
            "is not allowed"
        )


def _open_dir(path: str, *, dir_fd: int | None = None) -> int:
    try:
        fd = os.open(
            path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as e:
        if os.path.islink(path) if dir_fd is None else _is_link(path, dir_fd):
            raise UnsafeStoreError(f"{path!r} is a symlink; refusing it") from e
        raise
    try:
        _check_owned(os.fstat(fd), f"directory {path!r}", directory=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_file(name: str, dir_fd: int, flags: int, what: str) -> int:
    try:
        fd = os.open(name, flags | _O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if _is_link(name, dir_fd):
            raise UnsafeStoreError(f"{what} is a symlink; refusing it") from e
        raise
    try:
        _check_owned(os.fstat(fd), what, directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_root(root: str) -> str:
    """Create the root (mode 0700) if needed and check it. Returns the
    canonical path."""
    real = validate_root(root)
    base = _shm_base()
    parts = os.path.relpath(real, base).split(os.sep)
    cur = base
    for part in parts:
        cur = os.path.join(cur, part)
        with contextlib.suppress(FileExistsError):
            os.mkdir(cur, 0o700)
    fd = _open_dir(real)
    os.close(fd)
    return real


def _write_all(fd: int, bufs: Sequence[Payload], offset: int) -> int:
    """pwritev all of ``bufs`` at ``offset``; returns bytes written."""
    total = 0
    views = [memoryview(b).cast("B") for b in bufs]
    i = 0
    while i < len(views):
        chunk = views[i : i + _IOV_MAX]
        n = os.pwritev(fd, chunk, offset + total)
        want = sum(len(v) for v in chunk)
        total += n
        if n == want:
            i += len(chunk)
            continue
        # Short write: skip what was written and continue.
        rest = n
        while rest and rest >= len(views[i]):
            rest -= len(views[i])
            i += 1
        if rest:
            views[i] = views[i][rest:]
    return total


def _read_exact(fd: int, out: memoryview, offset: int) -> bool:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n <= 0:
            return False
        got += n
    return True


# --------------------------------------------------------------------------
# Index
# --------------------------------------------------------------------------
@dataclass(slots=True)
class _Loc:
    arena: int
    offset: int
    length: int


@dataclass(slots=True)
class _Entry:
    versions: dict[int, _Loc] = field(default_factory=dict)
    current: int | None = None


class _Index:
    """key -> versions; shared by writer (authoritative) and readers."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.num_versions = 0

    def apply(
        self, rtype: int, key: str, cs: int, arena: int, off: int, ln: int
    ) -> None:
        if rtype == _REC_PUT:
            e = self.entries.get(key)
            if e is None:
                e = self.entries[key] = _Entry()
            if cs not in e.versions:
                self.num_versions += 1
            e.versions[cs] = _Loc(arena, off, ln)
            e.current = cs
        elif rtype == _REC_MOVE:
            e = self.entries.get(key)
            if e is not None and cs in e.versions:
                e.versions[cs] = _Loc(arena, off, ln)
        elif rtype == _REC_DROP:
            e = self.entries.get(key)
            if e is not None and e.versions.pop(cs, None) is not None:
                self.num_versions -= 1
                if e.current == cs:
                    e.current = None
                if not e.versions:
                    del self.entries[key]
        elif rtype == _REC_NOCURRENT:
            e = self.entries.get(key)
            if e is not None:
                e.current = None

    def resolve(self, k: KeyOrRef) -> tuple[str, int, _Loc] | None:
        key = k.key if isinstance(k, ObjectRef) else k
        e = self.entries.get(key)  # only valid keys are ever stored
        if e is None:
            validate_key(key)
            return None
        if isinstance(k, ObjectRef):
            cs = k.checksum
        elif e.current is not None:
            cs = e.current
        else:
            return None
        loc = e.versions.get(cs)
        if loc is None:
            return None
        return key, cs, loc


def _encode_batch(records: Sequence[bytes]) -> bytes:
    body = b"".join(records)
    import zlib

    head = struct.pack("<4sII", _BATCH_MAGIC, len(records), zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


def _log_header(algo: ChecksumAlgorithm) -> bytes:
    import zlib

    head = struct.pack("<8sHB5x", _LOG_MAGIC, _LOG_VERSION, int(algo))
    return head + struct.pack("<I", zlib.crc32(head))


# --------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectReport:
    """What :func:`collect_stale_stores` did."""

    removed: tuple[str, ...] = ()
    kept_alive: tuple[str, ...] = ()
    kept_recent: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()  # entries not ours / unsafe; left alone


class ShmObjectStore(ObjectStore):
    """The ``/dev/shm`` backend. One writer process per namespace
    (``ShmObjectStore.create``), any number of readers in other processes
    (``ShmObjectStore.open_reader``). The writer may read too.

    Not thread-safe for concurrent mutation from several threads of one
    process beyond the internal lock that serialises calls.
    """

    def __init__(self) -> None:  # use create() / open_reader()
        self._closed = True
        self._lock = threading.RLock()
        self._writer = False
        self._root = ""
        self._namespace = ""
        self._root_fd = -1
        self._ns_fd = -1
        self._log_fd = -1
        self._log_ino = 0
        self._log_size = 0
        self._algo = default_checksum()
        self._index = _Index()
        self._stats = StoreStats()
        self._capacity = 0
        # writer only
        self._arena_bytes = 0
        self._arena_objs: dict[int, dict[tuple[str, int], int]] = {}
        self._arena_size: dict[int, int] = {}
        self._active: int | None = None
        self._active_fd = -1
        self._next_arena = 1
        self._pins: dict[str, int] = {}
        self._on_divergence = "version"
        self._remove_on_close = True
        self._writer_fd = -1
        self._last_heartbeat = 0.0
        self._ttl = DEFAULT_INACTIVE_TTL_S
        self._collect_interval = DEFAULT_COLLECT_INTERVAL_S
        self._last_collect = 0.0
        self._log_compact_bytes = 64 << 20
        # Test hook: called with a stage name inside put_many.
        self._fault_hook: Callable[[str], None] | None = None

    # ----------------------------------------------------------- construct
    @classmethod
    def create(
        cls,
        root: str,
        namespace: str,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        arena_bytes: int | None = None,
        inactive_ttl_s: float = DEFAULT_INACTIVE_TTL_S,
        collect_interval_s: float = DEFAULT_COLLECT_INTERVAL_S,
        on_divergence: str = "version",
        checksum: ChecksumAlgorithm | None = None,
        remove_on_close: bool = True,
        collect_on_start: bool = True,
    ) -> ShmObjectStore:
        """Create the writer side of a new namespace under ``root``.

        ``on_divergence``: ``"version"`` (default; see module docs of
        ``store``) or ``"raise"`` (strict: :class:`ObjectDivergenceError`).
        Stale stores of dead writers are collected first when
        ``collect_on_start``.
        """
        if on_divergence not in ("version", "raise"):
            raise ValueError("on_divergence must be 'version' or 'raise'")
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if inactive_ttl_s < 0:
            raise ValueError("inactive_ttl_s must be >= 0")
        if _NAMESPACE_RE.match(namespace) is None:
            raise UnsafeStoreError(
                "artifact namespace must be 16-64 lowercase hex characters, "
                f"got {namespace!r:.80}"
            )
        real = ensure_root(root)
        self = cls()
        self._writer = True
        self._root = real
        self._namespace = namespace
        self._capacity = capacity_bytes
        self._stats.capacity_bytes = capacity_bytes
        self._arena_bytes = arena_bytes or max(
            1 << 20, min(64 << 20, capacity_bytes // 16)
        )
        self._ttl = inactive_ttl_s
        self._collect_interval = collect_interval_s
        self._on_divergence = on_divergence
        self._algo = checksum or default_checksum()
        self._remove_on_close = remove_on_close
        if collect_on_start:
            collect_stale_stores(real, inactive_ttl_s, exclude=(namespace,))
        self._last_collect = time.monotonic()
        self._root_fd = _open_dir(real)
        try:
            os.mkdir(namespace, 0o700, dir_fd=self._root_fd)
        except FileExistsError as e:
            os.close(self._root_fd)
            raise UnsafeStoreError(
                f"artifact namespace {namespace} already exists under {real}; "
                "namespaces are per engine instance and must be fresh"
            ) from e
        try:
            self._ns_fd = _open_dir(namespace, dir_fd=self._root_fd)
            ident = WriterIdentity.current()
            wfd = _open_file(
                WRITER_FILE,
                self._ns_fd,
                os.O_RDWR | os.O_CREAT | os.O_EXCL,
                "writer record",
            )
            _write_all(wfd, [ident.to_json()], 0)
            self._writer_fd = wfd
            self._log_fd = _open_file(
                INDEX_FILE,
                self._ns_fd,
                os.O_RDWR | os.O_CREAT | os.O_EXCL,
                "index log",
            )
            hdr = _log_header(self._algo)
            _write_all(self._log_fd, [hdr], 0)
            self._log_size = len(hdr)
            self._log_ino = os.fstat(self._log_fd).st_ino
        except BaseException:
            self._closed = False
            self.close()
            raise
        self._closed = False
        return self

    @classmethod
    def open_reader(cls, root: str, namespace: str) -> ShmObjectStore:
        """Open an existing namespace read-only (from any process of the
        same user)."""
        if _NAMESPACE_RE.match(namespace) is None:
            raise UnsafeStoreError(
                f"artifact namespace must be hex, got {namespace!r:.80}"
            )
        real = validate_root(root)
        self = cls()
        self._root = real
        self._namespace = namespace
        self._root_fd = _open_dir(real)
        try:
            self._ns_fd = _open_dir(namespace, dir_fd=self._root_fd)
            self._closed = False
            self._reload_log()
        except BaseException:
            self._closed = False
            self.close()
            raise
        return self

    # ----------------------------------------------------------- properties
    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def root(self) -> str:
        return self._root

    @property
    def is_writer(self) -> bool:
        return self._writer

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"artifact store {self._namespace or '?'} is closed")

    def _check_writer(self) -> None:
        self._check_open()
        if not self._writer:
            raise ReadOnlyStoreError("this artifact store handle is a reader")

    # ----------------------------------------------------------- log (reader)
    def _reload_log(self) -> None:
        fd = _open_file(INDEX_FILE, self._ns_fd, os.O_RDONLY, "index log")
        hdr = os.pread(fd, _LOG_HEADER.size, 0)
        import zlib

        if len(hdr) < _LOG_HEADER.size:
            os.close(fd)
            raise UnsafeStoreError("artifact index log is truncated")
        magic, version, algo, crc = _LOG_HEADER.unpack(hdr)
        if (
            magic != _LOG_MAGIC
            or version != _LOG_VERSION
            or crc != zlib.crc32(hdr[:-4])
        ):
            os.close(fd)
            raise UnsafeStoreError("artifact index log has an unknown format")
        try:
            self._algo = ChecksumAlgorithm(algo)
        except ValueError as e:
            os.close(fd)
            raise UnsafeStoreError(f"unknown checksum algorithm {algo}") from e
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd = fd
        self._log_ino = os.fstat(fd).st_ino
        self._log_size = _LOG_HEADER.size
        self._index = _Index()
        self._read_log_tail()

    def _refresh(self) -> None:
        """Reader: pick up new index batches (or a compacted log)."""
        if self._writer:
            return
        try:
            st = os.stat(INDEX_FILE, dir_fd=self._ns_fd, follow_symlinks=False)
        except FileNotFoundError as e:
            raise StoreClosedError(
                f"artifact store {self._namespace} no longer exists "
                "(writer closed it or it was collected)"
            ) from e
        if st.st_ino != self._log_ino:
            self._reload_log()
        else:
            self._read_log_tail()

    def _read_log_tail(self) -> None:
        import zlib

        size = os.fstat(self._log_fd).st_size
        if size <= self._log_size:
            return
        buf = os.pread(self._log_fd, size - self._log_size, self._log_size)
        pos = 0
        hs = _BATCH_HEADER.size
        apply = self._index.apply
        while pos + hs <= len(buf):
            magic, count, rcrc, hcrc = _BATCH_HEADER.unpack_from(buf, pos)
            if magic != _BATCH_MAGIC or hcrc != zlib.crc32(buf[pos : pos + hs - 4]):
                break  # torn or still being written: stop here
            end = pos + hs + count * _RECORD.size
            if end > len(buf):
                break
            body = buf[pos + hs : end]
            if zlib.crc32(body) != rcrc:
                break
            for rtype, arena, kb, off, ln, cs in _RECORD.iter_unpack(body):
                apply(rtype, kb.hex(), cs, arena, off, ln)
            pos = end
        self._log_size += pos

    # ----------------------------------------------------------- writer
    def _append_log(self, records: list[bytes]) -> None:
        if not records:
            return
        data = _encode_batch(records)
        if self._fault_hook is not None:
            half = len(data) // 2
            _write_all(self._log_fd, [data[:half]], self._log_size)
            self._fault_hook("mid_index")
            _write_all(self._log_fd, [data[half:]], self._log_size + half)
        else:
            _write_all(self._log_fd, [data], self._log_size)
        self._log_size += len(data)

    def _roll_arena(self) -> None:
        if self._active_fd >= 0:
            os.close(self._active_fd)
        aid = self._next_arena
        self._next_arena += 1
        name = f"{aid:016x}.arena"
        self._active_fd = _open_file(
            name, self._ns_fd, os.O_RDWR | os.O_CREAT | os.O_EXCL, "arena"
        )
        self._active = aid
        self._arena_objs[aid] = {}
        self._arena_size[aid] = 0

    def _write_objects(self, bufs: Sequence[Payload], total: int) -> tuple[int, int]:
        """Append ``bufs`` to the active arena; returns (arena, offset)."""
        if self._active is None or (
            self._arena_size[self._active] > 0
            and self._arena_size[self._active] + total > self._arena_bytes
        ):
            self._roll_arena()
        assert_active = self._active
        if assert_active is None:  # pragma: no cover - _roll_arena sets it
            raise ArtifactStoreError("no active arena")
        off = self._arena_size[assert_active]
        try:
            n = _write_all(self._active_fd, bufs, off)
        except OSError as e:
            raise StoreCapacityError(
                f"writing {total} bytes to the artifact store failed: {e}; "
                f"/dev/shm may be full (store capacity {self._capacity})"
            ) from e
        # Even a partial write occupies space (never reused).
        self._arena_size[assert_active] = off + n
        self._stats.used_bytes += n
        if n != total:  # pragma: no cover - _write_all loops until done
            raise ArtifactStoreError("short write to artifact arena")
        return assert_active, off

    def _used(self) -> int:
        return sum(self._arena_size.values())

    def _pinned_bytes(self, protect: set[str]) -> int:
        total = 0
        for key in set(self._pins) | protect:
            e = self._index.entries.get(key)
            if e is not None:
                total += sum(loc.length for loc in e.versions.values())
        return total

    def _make_room(self, incoming: int, protect: set[str]) -> None:
        if self._used() + incoming <= self._capacity:
            return
        pinned = self._pinned_bytes(protect)
        if pinned + incoming > self._capacity:
            raise StoreCapacityError(
                f"artifact store full: {pinned} bytes pinned by live requests "
                f"+ {incoming} new bytes exceed the capacity of "
                f"{self._capacity} bytes; raise the artifact capacity or lower "
                "the number of concurrent requests"
            )
        for aid in sorted(self._arena_objs):
            if self._used() + incoming <= self._capacity:
                break
            if aid == self._active:
                # Seal the active arena so that it can be evicted; moved
                # objects go to a fresh one.
                os.close(self._active_fd)
                self._active_fd = -1
                self._active = None
            self._evict_arena(aid, protect)

    def _evict_arena(self, aid: int, protect: set[str]) -> None:
        objs = self._arena_objs.pop(aid)
        name = f"{aid:016x}.arena"
        moves: list[tuple[str, int, _Loc]] = []
        records: list[bytes] = []
        for key, cs in objs:
            e = self._index.entries[key]
            loc = e.versions[cs]
            if self._pins.get(key) or key in protect:
                moves.append((key, cs, loc))
            else:
                records.append(
                    _RECORD.pack(_REC_DROP, aid, bytes.fromhex(key), 0, 0, cs)
                )
                self._index.apply(_REC_DROP, key, cs, aid, 0, 0)
                self._stats.evicted_objects += 1
        if moves:
            fd = _open_file(name, self._ns_fd, os.O_RDONLY, "arena")
            try:
                bufs = []
                for _key, _cs, loc in moves:
                    b = bytearray(loc.length)
                    if not _read_exact(fd, memoryview(b), loc.offset):
                        raise ChecksumMismatchError(f"arena {name} is truncated")
                    bufs.append(b)
            finally:
                os.close(fd)
            total = sum(len(b) for b in bufs)
            new_aid, off = self._write_objects(bufs, total)
            for (key, cs, _loc), b in zip(moves, bufs):
                records.append(
                    _RECORD.pack(
                        _REC_MOVE, new_aid, bytes.fromhex(key), off, len(b), cs
                    )
                )
                self._index.apply(_REC_MOVE, key, cs, new_aid, off, len(b))
                self._arena_objs[new_aid][(key, cs)] = len(b)
                off += len(b)
            self._stats.relocated_objects += len(moves)
        self._append_log(records)
        size = self._arena_size.pop(aid)
        self._stats.used_bytes -= size
        os.unlink(name, dir_fd=self._ns_fd)

    def put_many(
        self, items: Sequence[tuple[str, Payload]], *, pin: bool = False
    ) -> PutResult:
        """Publish a batch: one data write and one index write.

        Identical re-puts write nothing (the version becomes current again);
        different bytes under an existing key are stored as a new version
        (``on_divergence="version"``) and counted in ``stats().divergences``,
        or rejected with :class:`ObjectDivergenceError` (``"raise"``).
        """
        with self._lock:
            self._check_writer()
            algo = self._algo
            plan: list[tuple[str, memoryview, int, PutStatus]] = []
            pending: dict[tuple[str, int], int] = {}
            pending_keys: set[str] = set()
            for key, data in items:
                validate_key(key)
                mv = memoryview(data).cast("B")
                cs = compute_checksum(algo, mv)
                e = self._index.entries.get(key)
                if (key, cs) in pending or (
                    e is not None
                    and cs in e.versions
                    and self._same_bytes(e.versions[cs], mv)
                ):
                    plan.append((key, mv, cs, PutStatus.IDENTICAL))
                    continue
                status = (
                    PutStatus.DIVERGED
                    if (e is not None and e.versions) or key in pending_keys
                    else PutStatus.WRITTEN
                )
                if status == PutStatus.DIVERGED and self._on_divergence == "raise":
                    raise ObjectDivergenceError(
                        f"artifact object {key} already exists with different "
                        "bytes (strict divergence policy)"
                    )
                pending[(key, cs)] = len(mv)
                pending_keys.add(key)
                plan.append((key, mv, cs, status))
            to_write = [p for p in plan if p[3] != PutStatus.IDENTICAL]
            incoming = sum(len(p[1]) for p in to_write)
            protect = {p[0] for p in plan} if pin else set()
            self._make_room(incoming, protect)
            records: list[bytes] = []
            written: dict[tuple[str, int], _Loc] = {}
            if to_write:
                aid, off = self._write_objects([p[1] for p in to_write], incoming)
                if self._fault_hook is not None:
                    self._fault_hook("after_data")
                for key, mv, cs, _status in to_write:
                    written[(key, cs)] = _Loc(aid, off, len(mv))
                    off += len(mv)
            refs = []
            for key, mv, cs, _status in plan:
                loc = written.get((key, cs))
                if loc is None:
                    e = self._index.entries.get(key)
                    loc = e.versions[cs] if e and cs in e.versions else None
                    if loc is None:
                        loc = written_or_pending(written, key, cs)
                records.append(
                    _RECORD.pack(
                        _REC_PUT,
                        loc.arena,
                        bytes.fromhex(key),
                        loc.offset,
                        loc.length,
                        cs,
                    )
                )
                refs.append(ObjectRef(key, cs, len(mv)))
            self._append_log(records)
            # Publication is complete; update the in-memory index.
            statuses = []
            for key, _mv, cs, status in plan:
                loc = written.get((key, cs))
                if loc is not None:
                    self._index.apply(
                        _REC_PUT, key, cs, loc.arena, loc.offset, loc.length
                    )
                    self._arena_objs[loc.arena][(key, cs)] = loc.length
                else:
                    e = self._index.entries[key]
                    cur = e.versions[cs]
                    self._index.apply(
                        _REC_PUT, key, cs, cur.arena, cur.offset, cur.length
                    )
                if status == PutStatus.WRITTEN:
                    self._stats.puts_written += 1
                elif status == PutStatus.IDENTICAL:
                    self._stats.puts_identical += 1
                else:
                    self._stats.divergences += 1
                    logger.debug(
                        "artifact object %s diverged (new checksum %#x)", key, cs
                    )
                statuses.append(status)
            if pin:
                for ref in refs:
                    self._pins[ref.key] = self._pins.get(ref.key, 0) + 1
            self._maybe_compact_log()
            self._housekeeping()
            return PutResult(tuple(refs), tuple(statuses))

    def _same_bytes(self, loc: _Loc, mv: memoryview) -> bool:
        if loc.length != len(mv):
            return False
        buf = bytearray(loc.length)
        fd = _open_file(f"{loc.arena:016x}.arena", self._ns_fd, os.O_RDONLY, "arena")
        try:
            if not _read_exact(fd, memoryview(buf), loc.offset):
                return False
        finally:
            os.close(fd)
        return buf == mv

    def _maybe_compact_log(self) -> None:
        live = self._index.num_versions
        if self._log_size <= self._log_compact_bytes or self._log_size <= 4 * (
            _RECORD.size * (live + 1) + 4096
        ):
            return
        records: list[bytes] = []
        for key, e in self._index.entries.items():
            kb = bytes.fromhex(key)
            order = [cs for cs in e.versions if cs != e.current]
            if e.current is not None:
                order.append(e.current)
            for cs in order:
                loc = e.versions[cs]
                records.append(
                    _RECORD.pack(_REC_PUT, loc.arena, kb, loc.offset, loc.length, cs)
                )
            if e.current is None:
                records.append(_RECORD.pack(_REC_NOCURRENT, 0, kb, 0, 0, 0))
        tmp = f"{self._next_arena:016x}.tmp"
        self._next_arena += 1
        fd = _open_file(tmp, self._ns_fd, os.O_RDWR | os.O_CREAT | os.O_EXCL, "log")
        try:
            data = [_log_header(self._algo)]
            for i in range(0, len(records), 4096):
                data.append(_encode_batch(records[i : i + 4096]))
            size = _write_all(fd, data, 0)
            os.rename(tmp, INDEX_FILE, src_dir_fd=self._ns_fd, dst_dir_fd=self._ns_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._ns_fd)
            raise
        os.close(self._log_fd)
        self._log_fd = fd
        self._log_size = size
        self._log_ino = os.fstat(fd).st_ino
        self._stats.extra["log_compactions"] = (
            self._stats.extra.get("log_compactions", 0) + 1
        )

    def heartbeat(self) -> None:
        """Mark the store active (writer). Called from put automatically."""
        with self._lock:
            self._check_writer()
            os.utime(self._writer_fd)
            self._last_heartbeat = time.monotonic()

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= _HEARTBEAT_INTERVAL_S:
            os.utime(self._writer_fd)
            self._last_heartbeat = now
        if now - self._last_collect >= self._collect_interval:
            self._last_collect = now
            try:
                collect_stale_stores(self._root, self._ttl, exclude=(self._namespace,))
            except OSError as e:  # never fail a put because of a neighbour
                logger.warning("artifact store collection failed: %s", e)

    # ----------------------------------------------------------- pins
    def pin(self, keys: Iterable[KeyOrRef]) -> None:
        with self._lock:
            self._check_writer()
            resolved = []
            for k in keys:
                r = self._index.resolve(k)
                if r is None:
                    raise ObjectMissingError(
                        f"cannot pin artifact object {ref_key(k)}: missing"
                    )
                resolved.append(r[0])
            for key in resolved:
                self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[KeyOrRef]) -> None:
        with self._lock:
            self._check_writer()
            for k in keys:
                key = ref_key(k)
                n = self._pins.get(key, 0)
                if n <= 1:
                    self._pins.pop(key, None)
                else:
                    self._pins[key] = n - 1

    # ----------------------------------------------------------- reads
    def exists(self, key: KeyOrRef) -> bool:
        with self._lock:
            self._check_open()
            self._refresh()
            return self._index.resolve(key) is not None

    def get_batch(self, keys: Sequence[KeyOrRef]) -> ObjectBatch:
        """Read objects into one private buffer with one ``preadv`` per
        contiguous run and verify every checksum."""
        with self._lock:
            self._check_open()
            self._refresh()
            for attempt in range(3):
                try:
                    return self._get_batch_once(keys)
                except FileNotFoundError:
                    # An arena was evicted between lookup and open: the log
                    # already says where its objects went.
                    if attempt == 2:
                        raise
                    if self._writer:
                        continue
                    self._refresh()
            raise ArtifactStoreError("unreachable")  # pragma: no cover

    def _get_batch_once(self, keys: Sequence[KeyOrRef]) -> ObjectBatch:
        n = len(keys)
        locs: list[_Loc] = []
        sums: list[int] = []
        resolve = self._index.resolve
        for k in keys:
            r = resolve(k)
            if r is None:
                key = ref_key(k)
                what = (
                    f"version {k.checksum:#x} of artifact object {key}"
                    if isinstance(k, ObjectRef)
                    else f"artifact object {key}"
                )
                e = self._index.entries.get(key)
                if isinstance(k, ObjectRef) or e is None:
                    raise ObjectMissingError(
                        f"{what} is missing from store {self._namespace} "
                        "(never published, evicted, or from another namespace "
                        "or weight version)"
                    )
                raise ObjectDivergenceError(
                    f"{what} has no current version (its latest version was "
                    "evicted after a divergence)"
                )
            locs.append(r[2])
            sums.append(r[1])
        lengths = np.fromiter((loc.length for loc in locs), np.int64, n)
        offsets = np.zeros(n, np.int64)
        if n > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        total = int(lengths.sum()) if n else 0
        data = np.empty(total, np.uint8)
        out = data.data
        # Merge runs of objects that are adjacent in one arena.
        runs: list[tuple[int, int, int, int]] = []  # arena, src, dst, len
        dst = 0
        for loc in locs:
            if runs:
                a, src, d, ln = runs[-1]
                if a == loc.arena and src + ln == loc.offset:
                    runs[-1] = (a, src, d, ln + loc.length)
                    dst += loc.length
                    continue
            runs.append((loc.arena, loc.offset, dst, loc.length))
            dst += loc.length
        fds: dict[int, int] = {}
        try:
            for a, src, d, ln in runs:
                fd = fds.get(a)
                if fd is None:
                    fd = fds[a] = _open_file(
                        f"{a:016x}.arena", self._ns_fd, os.O_RDONLY, "arena"
                    )
                if not _read_exact(fd, out[d : d + ln], src):
                    self._stats.checksum_failures += 1
                    raise ChecksumMismatchError(
                        f"artifact arena {a:016x} in store {self._namespace} is "
                        "shorter than its index says"
                    )
        finally:
            for fd in fds.values():
                os.close(fd)
        algo = self._algo
        off = 0
        for i, (loc, cs) in enumerate(zip(locs, sums)):
            if compute_checksum(algo, out[off : off + loc.length]) != cs:
                self._stats.checksum_failures += 1
                raise ChecksumMismatchError(
                    f"artifact object {ref_key(keys[i])} in store "
                    f"{self._namespace} failed its checksum (corrupted bytes)"
                )
            off += loc.length
        return ObjectBatch(data, offsets, lengths, tuple(sums))

    # ----------------------------------------------------------- misc
    def stats(self) -> StoreStats:
        with self._lock:
            s = self._stats
            s.objects = self._index.num_versions
            s.keys = len(self._index.entries)
            s.pinned_keys = len(self._pins)
            if self._writer:
                s.used_bytes = self._used()
            return StoreStats(
                objects=s.objects,
                keys=s.keys,
                used_bytes=s.used_bytes,
                capacity_bytes=s.capacity_bytes,
                pinned_keys=s.pinned_keys,
                puts_written=s.puts_written,
                puts_identical=s.puts_identical,
                divergences=s.divergences,
                evicted_objects=s.evicted_objects,
                relocated_objects=s.relocated_objects,
                checksum_failures=s.checksum_failures,
                extra=dict(s.extra),
            )

    def close(self) -> None:
        """Close handles. A writer removes its namespace unless it was
        created with ``remove_on_close=False`` (then TTL collection removes
        it after the writer is gone)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for attr in ("_active_fd", "_log_fd", "_writer_fd"):
                fd = getattr(self, attr)
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    setattr(self, attr, -1)
            if self._writer and self._remove_on_close and self._ns_fd >= 0:
                _remove_namespace(self._root_fd, self._namespace)
            for attr in ("_ns_fd", "_root_fd"):
                fd = getattr(self, attr)
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    setattr(self, attr, -1)
            self._index = _Index()

    def __del__(self) -> None:
        # Only release descriptors; never delete files from a finaliser.
        if not getattr(self, "_closed", True):
            for attr in ("_active_fd", "_log_fd", "_writer_fd", "_ns_fd", "_root_fd"):
                fd = getattr(self, attr, -1)
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)


def written_or_pending(written: dict[tuple[str, int], _Loc], key: str, cs: int) -> _Loc:
    """Location of a version written earlier in the same batch."""
    loc = written.get((key, cs))
    if loc is None:  # pragma: no cover - plan guarantees one exists
        raise ArtifactStoreError(f"internal: no location for {key}")
    return loc


# --------------------------------------------------------------------------
# Collection
# --------------------------------------------------------------------------
def _remove_namespace(root_fd: int, namespace: str) -> list[str]:
    """Remove our own files in ``namespace`` and the directory if empty.
    Returns the entries that were refused (left in place)."""
    refused: list[str] = []
    try:
        ns_fd = _open_dir(namespace, dir_fd=root_fd)
    except (UnsafeStoreError, OSError):
        return [namespace]
    uid = os.geteuid()
    try:
        for name in os.listdir(ns_fd):
            try:
                st = os.stat(name, dir_fd=ns_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            ours = (
                stat.S_ISREG(st.st_mode)
                and st.st_uid == uid
                and (
                    name in (WRITER_FILE, INDEX_FILE)
                    or _ARENA_RE.match(name) is not None
                    or _TMP_RE.match(name) is not None
                )
            )
            if not ours:
                refused.append(f"{namespace}/{name}")
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=ns_fd)
    finally:
        os.close(ns_fd)
    if not refused:
        with contextlib.suppress(OSError):
            os.rmdir(namespace, dir_fd=root_fd)
    else:
        logger.warning(
            "artifact store: left entries that are not ours in place: %s", refused
        )
    return refused


def _last_activity(ns_fd: int) -> float:
    latest = os.fstat(ns_fd).st_mtime
    for name in (WRITER_FILE, INDEX_FILE):
        with contextlib.suppress(OSError):
            latest = max(
                latest, os.stat(name, dir_fd=ns_fd, follow_symlinks=False).st_mtime
            )
    return latest


def collect_stale_stores(
    root: str,
    inactive_ttl_s: float = DEFAULT_INACTIVE_TTL_S,
    *,
    exclude: Iterable[str] = (),
    now: float | None = None,
) -> CollectReport:
    """Remove namespaces under ``root`` whose writer is gone and that have
    been inactive for longer than ``inactive_ttl_s`` seconds.

    A namespace whose writer still runs is never removed. A namespace whose
    writer cannot be checked (another pid namespace) or that has no valid
    writer record is removed only once inactive past the TTL. Only regular
    files we own with names we create are deleted; symlinks, foreign-owned
    entries and unknown names are refused and left alone.
    """
    real = validate_root(root)
    now = time.time() if now is None else now
    skip = set(exclude)
    removed, alive, recent, refused = [], [], [], []
    try:
        root_fd = _open_dir(real)
    except FileNotFoundError:
        return CollectReport()
    uid = os.geteuid()
    try:
        for name in os.listdir(root_fd):
            if name in skip:
                continue
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (
                _NAMESPACE_RE.match(name) is None
                or not stat.S_ISDIR(st.st_mode)
                or st.st_uid != uid
            ):
                refused.append(name)
                continue
            try:
                ns_fd = _open_dir(name, dir_fd=root_fd)
            except (UnsafeStoreError, OSError):
                refused.append(name)
                continue
            try:
                live: bool | None
                try:
                    wfd = _open_file(WRITER_FILE, ns_fd, os.O_RDONLY, "writer")
                    try:
                        raw = os.pread(wfd, 1 << 16, 0)
                    finally:
                        os.close(wfd)
                    live = WriterIdentity.from_json(raw).is_alive()
                except (OSError, ValueError, KeyError, UnsafeStoreError):
                    live = None
                idle = now - _last_activity(ns_fd)
            finally:
                os.close(ns_fd)
            if live:
                alive.append(name)
            elif idle < inactive_ttl_s:
                recent.append(name)
            else:
                left = _remove_namespace(root_fd, name)
                if left:
                    refused.extend(left)
                else:
                    removed.append(name)
    finally:
        os.close(root_fd)
    if removed:
        logger.info("artifact store: collected %d stale store(s)", len(removed))
    return CollectReport(tuple(removed), tuple(alive), tuple(recent), tuple(refused))


def make_namespace(*parts: object) -> str:
    """A fresh per-engine-instance namespace: a digest of the given parts
    (e.g. engine id, DP rank) plus this process's identity and randomness."""
    import hashlib

    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    ident = WriterIdentity.current()
    h.update(f"{ident.pid}:{ident.start_ticks}:{ident.boot_id}".encode())
    h.update(os.urandom(16))
    return h.hexdigest()[:32]
