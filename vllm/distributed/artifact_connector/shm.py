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

Arenas are allocated in full when they are started (``posix_fallocate``, so
a write through the mapping can never hit a full ``/dev/shm``) and mapped
(``mmap``, pre-faulted). A batched put (:meth:`ShmObjectStore.put_packed`)
lets the caller encode its objects straight into the next free range of the
active arena (one copy, no system call), records the objects' checksums
(the encoder's one-pass xxh3, or computed here) and then appends one index
batch (a header with a CRC over the batch and one 64-byte record per object,
encoded with numpy) with one ``pwrite``. A reader only trusts index batches
whose CRC matches, and the data is complete before the batch that names it
is written, so a reader sees a whole object or nothing, also when the writer
is killed between (or in the middle of) the two steps: bytes that no index
batch names are never read.

Readers keep an in-memory index (numpy arrays of locations addressed by
slot, dicts from keys to slots) that they extend by reading the log tail,
map each arena read-only once and keep the mapping until a ``RETIRE``
record says the arena was evicted. A read resolves all keys at once, checks
each object's checksum over the mapped bytes and copies them into a private
buffer (``get_batch``) or straight into the caller's array (``get_split``):
values leave the store, never paths or mappings.

Eviction works on whole arenas, oldest first: pinned objects in the victim
arena are copied into the active arena (``MOVE`` records), the others are
dropped (``DROP`` records), then a ``RETIRE`` record is appended and the
arena file is unlinked. Files are never truncated or rewritten in place, so
a reader that mapped an arena before it was unlinked still reads the bytes
the index described.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TypeVar

import numpy as np

from vllm.distributed.artifact_connector.store import (
    KEY_HEX_LEN,
    KEY_NBYTES,
    ArtifactStoreError,
    ChecksumAlgorithm,
    ChecksumMismatchError,
    FillFn,
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
    SplitBatch,
    StoreCapacityError,
    StoreClosedError,
    StoreStats,
    UnsafeStoreError,
    checksum_function,
    default_checksum,
    ref_key,
    validate_keys,
)
from vllm.distributed.process_identity import ProcessWatch, process_start_ticks
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
_LOG_VERSION = 2
_BATCH_MAGIC = b"VBAT"
_BATCH_HEADER = struct.Struct("<4sIII")  # magic, count, records crc, hdr crc
_RECORD = struct.Struct("<B3xI32sQQQ")  # type, arena, key, off, len, checksum
_REC_PUT = 1  # new version (or identical re-put); becomes the current one
_REC_MOVE = 2  # same version, new location
_REC_DROP = 3  # version gone
_REC_NOCURRENT = 4  # key keeps old versions but has no current version
_REC_RETIRE = 5  # arena unlinked: readers drop their mapping of it
_ALIGN = 64  # batches start on 64-byte boundaries

_T = TypeVar("_T")


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
        with ProcessWatch(self.pid, self.start_ticks) as watch:
            return watch.alive()


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


# --------------------------------------------------------------------------
# Index
# --------------------------------------------------------------------------
# The record layout as a numpy dtype (same bytes as _RECORD). No gaps, so
# that concatenation (structured-dtype promotion) keeps the layout.
_REC_DTYPE = np.dtype(
    [
        ("type", "u1"),
        ("pad", "V3"),
        ("arena", "<u4"),
        ("key", "V32"),
        ("off", "<u8"),
        ("len", "<u8"),
        ("cs", "<u8"),
    ]
)
if _REC_DTYPE.itemsize != _RECORD.size:  # pragma: no cover - import-time check
    raise ImportError("artifact index record layout mismatch")


class _Index:
    """key -> versions; shared by writer (authoritative) and readers.

    A version's location lives in numpy arrays indexed by *slot*. ``cur``
    maps a key to the slot of its current version and ``head`` to the first
    slot of its version chain (``nxt`` links the rest; more than one
    version only after a divergence). A batch of keys is resolved with one
    C-level dict lookup per key and gathered with vectorised indexing; a
    batch of new keys is inserted with two ``dict.update`` calls."""

    _ARRAYS = ("arena", "off", "length", "cs", "live", "nxt", "kb")

    def __init__(self) -> None:
        self.cur: dict[str, int] = {}
        self.head: dict[str, int] = {}
        self.arena = np.zeros(0, np.int64)
        self.off = np.zeros(0, np.int64)
        self.length = np.zeros(0, np.int64)
        self.cs = np.zeros(0, np.uint64)
        self.live = np.zeros(0, np.bool_)
        self.nxt = np.zeros(0, np.int64)
        self.kb = np.zeros(0, "V32")  # the slot's key, raw
        self.free: list[int] = []
        self.top = 0
        self.num_versions = 0

    def _grow(self, need: int) -> None:
        cap = self.arena.shape[0]
        if self.top + need <= cap:
            return
        new = max(1024, 2 * cap, self.top + need)
        for name in self._ARRAYS:
            old = getattr(self, name)
            arr = np.zeros(new, old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)

    def alloc(self, n: int) -> np.ndarray:
        take = min(n, len(self.free))
        reused = [self.free.pop() for _ in range(take)]
        self._grow(n - take)
        fresh = np.arange(self.top, self.top + n - take, dtype=np.int64)
        self.top += n - take
        slots = np.concatenate((np.array(reused, np.int64), fresh)) if take else fresh
        self.live[slots] = True
        self.nxt[slots] = -1
        return slots

    def versions(self, key: str) -> list[int]:
        out = []
        s = self.head.get(key, -1)
        while s >= 0:
            out.append(s)
            s = int(self.nxt[s])
        return out

    def find(self, key: str, cs: int) -> int | None:
        s = self.head.get(key, -1)
        while s >= 0:
            if int(self.cs[s]) == cs:
                return s
            s = int(self.nxt[s])
        return None

    def put_new(
        self,
        keys: Sequence[str],
        kraw: bytes,
        cs: np.ndarray,
        arena: np.ndarray | int,
        off: np.ndarray,
        ln: np.ndarray,
    ) -> None:
        """Insert versions of distinct keys absent from the index."""
        slots = self.alloc(len(keys))
        self.arena[slots] = arena
        self.off[slots] = off
        self.length[slots] = ln
        self.cs[slots] = cs
        self.kb[slots] = np.frombuffer(kraw, "V32")
        sl = slots.tolist()
        self.cur.update(zip(keys, sl))
        self.head.update(zip(keys, sl))
        self.num_versions += len(sl)

    def put(self, key: str, cs: int, arena: int, off: int, ln: int) -> None:
        s = self.find(key, cs)
        if s is None:
            s = int(self.alloc(1)[0])
            self.cs[s] = cs
            self.kb[s] = bytes.fromhex(key)
            self.nxt[s] = self.head.get(key, -1)
            self.head[key] = s
            self.num_versions += 1
        self.arena[s], self.off[s], self.length[s] = arena, off, ln
        self.cur[key] = s

    def move(self, key: str, cs: int, arena: int, off: int, ln: int) -> None:
        s = self.find(key, cs)
        if s is not None:
            self.arena[s], self.off[s], self.length[s] = arena, off, ln

    def drop(self, key: str, cs: int) -> None:
        prev, s = -1, self.head.get(key, -1)
        while s >= 0 and int(self.cs[s]) != cs:
            prev, s = s, int(self.nxt[s])
        if s < 0:
            return
        nxt = int(self.nxt[s])
        if prev >= 0:
            self.nxt[prev] = nxt
        elif nxt >= 0:
            self.head[key] = nxt
        else:
            del self.head[key]
        self.live[s] = False
        self.free.append(s)
        self.num_versions -= 1
        if self.cur.get(key) == s:
            del self.cur[key]

    def nocurrent(self, key: str) -> None:
        self.cur.pop(key, None)

    def apply_records(self, recs: np.ndarray) -> list[int]:
        """Apply decoded log records; returns retired arena ids."""
        n = recs.shape[0]
        kraw = recs["key"].tobytes()
        hexed = kraw.hex()
        keys = [hexed[i : i + KEY_HEX_LEN] for i in range(0, n * KEY_HEX_LEN, 64)]
        types = recs["type"]
        if (
            n
            and (types == _REC_PUT).all()
            and self.head.keys().isdisjoint(keys)
            and len(set(keys)) == n
        ):
            self.put_new(
                keys,
                kraw,
                recs["cs"].astype(np.uint64),
                recs["arena"].astype(np.int64),
                recs["off"].astype(np.int64),
                recs["len"].astype(np.int64),
            )
            return []
        retired = []
        for rtype, key, arena, off, ln, cs in zip(
            types.tolist(),
            keys,
            recs["arena"].tolist(),
            recs["off"].tolist(),
            recs["len"].tolist(),
            recs["cs"].tolist(),
        ):
            if rtype == _REC_PUT:
                self.put(key, cs, arena, off, ln)
            elif rtype == _REC_MOVE:
                self.move(key, cs, arena, off, ln)
            elif rtype == _REC_DROP:
                self.drop(key, cs)
            elif rtype == _REC_NOCURRENT:
                self.nocurrent(key)
            elif rtype == _REC_RETIRE:
                retired.append(arena)
        return retired

    def lookup(self, keys: Sequence[KeyOrRef]) -> list[int | None]:
        """Slot per key or ref (``None`` where missing)."""
        if set(map(type, keys)) <= {str}:
            return list(map(self.cur.get, keys))  # type: ignore[arg-type]
        out: list[int | None] = []
        for k in keys:
            if isinstance(k, ObjectRef):
                out.append(self.find(k.key, k.checksum))
            else:
                out.append(self.cur.get(k))
        return out

    def slots_of_arena(self, aid: int) -> np.ndarray:
        top = self.top
        return np.flatnonzero(self.live[:top] & (self.arena[:top] == aid))

    def keys_of(self, slots: np.ndarray) -> list[str]:
        hexed = self.kb[slots].tobytes().hex()
        return [hexed[i : i + KEY_HEX_LEN] for i in range(0, len(hexed), KEY_HEX_LEN)]


def _records(
    rtype: int | np.ndarray,
    keys_raw: bytes,
    arena: int | np.ndarray,
    off: int | np.ndarray,
    ln: int | np.ndarray,
    cs: int | np.ndarray,
) -> np.ndarray:
    n = len(keys_raw) // KEY_NBYTES
    recs = np.zeros(n, _REC_DTYPE)
    recs["type"] = rtype
    recs["arena"] = arena
    recs["key"] = np.frombuffer(keys_raw, "V32")
    recs["off"] = off
    recs["len"] = ln
    recs["cs"] = cs
    return recs


def _encode_batch(recs: np.ndarray) -> bytes:
    body = recs.tobytes()
    head = struct.pack("<4sII", _BATCH_MAGIC, recs.shape[0], zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


def _log_header(algo: ChecksumAlgorithm) -> bytes:
    head = struct.pack("<8sHB5x", _LOG_MAGIC, _LOG_VERSION, int(algo))
    return head + struct.pack("<I", zlib.crc32(head))


def _map_file(fd: int, size: int, *, write: bool) -> mmap.mmap:
    if write:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)


class _Arena:
    """A mapped arena file. Only this module sees the mapping; readers copy
    out of it (values, never mappings, leave the store)."""

    __slots__ = ("aid", "mm", "mv", "arr", "size", "fill")

    def __init__(self, aid: int, mm: mmap.mmap, size: int) -> None:
        self.aid = aid
        self.mm = mm
        self.mv = memoryview(mm)  # slicing an mmap would copy; a view does not
        self.arr = np.frombuffer(mm, np.uint8)
        self.size = size
        self.fill = 0

    def close(self) -> None:
        self.arr = np.zeros(0, np.uint8)
        with contextlib.suppress(BufferError):
            self.mv.release()
        # A view still alive (BufferError): unmapped when it is collected.
        with contextlib.suppress(BufferError):
            self.mm.close()


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


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


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
        self._algo = ChecksumAlgorithm.XXH3_64
        self._index = _Index()
        self._stats = StoreStats()
        self._capacity = 0
        self._arenas: dict[int, _Arena] = {}  # mapped arenas (both sides)
        # writer only
        self._arena_bytes = 0
        self._active: _Arena | None = None
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
        ``collect_on_start``. ``arena_bytes`` is the size of the arena files
        (default: capacity / 16, clamped to [1 MiB, 64 MiB] and to the
        capacity); each is allocated in full when it is started.
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
        algo = checksum or default_checksum()
        checksum_function(algo)  # clear error if unavailable
        real = ensure_root(root)
        self = cls()
        self._writer = True
        self._root = real
        self._namespace = namespace
        self._capacity = capacity_bytes
        self._stats.capacity_bytes = capacity_bytes
        self._arena_bytes = _align(
            min(
                capacity_bytes,
                arena_bytes or max(1 << 20, min(64 << 20, capacity_bytes // 16)),
            )
        )
        self._ttl = inactive_ttl_s
        self._collect_interval = collect_interval_s
        self._on_divergence = on_divergence
        self._algo = algo
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

    @property
    def checksum_algorithm(self) -> ChecksumAlgorithm:
        return self._algo

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
            checksum_function(self._algo)
        except ValueError as e:
            os.close(fd)
            raise UnsafeStoreError(f"unknown checksum algorithm {algo}") from e
        except ArtifactStoreError:
            os.close(fd)
            raise
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd = fd
        self._log_ino = os.fstat(fd).st_ino
        self._log_size = _LOG_HEADER.size
        self._index = _Index()
        self._unmap_all()  # mapped lazily again
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
        elif st.st_size > self._log_size:
            self._read_log_tail()

    def _read_log_tail(self) -> None:
        size = os.fstat(self._log_fd).st_size
        if size <= self._log_size:
            return
        buf = os.pread(self._log_fd, size - self._log_size, self._log_size)
        pos = 0
        hs = _BATCH_HEADER.size
        bodies = []
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
            bodies.append(body)
            pos = end
        self._log_size += pos
        if bodies:
            recs = np.frombuffer(b"".join(bodies), _REC_DTYPE)
            for aid in self._index.apply_records(recs):
                arena = self._arenas.pop(aid, None)
                if arena is not None:
                    arena.close()

    # ----------------------------------------------------------- arenas
    def _unmap_all(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        self._active = None

    def _map_arena(self, aid: int) -> _Arena:
        arena = self._arenas.get(aid)
        if arena is not None:
            return arena
        fd = _open_file(f"{aid:016x}.arena", self._ns_fd, os.O_RDONLY, "arena")
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ChecksumMismatchError(
                    f"artifact arena {aid:016x} in store {self._namespace} is empty"
                )
            arena = _Arena(aid, _map_file(fd, size, write=False), size)
        finally:
            os.close(fd)
        self._arenas[aid] = arena
        return arena

    def _start_arena(self, min_bytes: int) -> _Arena:
        """Writer: create, allocate in full and map a fresh arena."""
        aid = self._next_arena
        self._next_arena += 1
        size = max(self._arena_bytes, _align(min_bytes))
        fd = _open_file(
            f"{aid:016x}.arena",
            self._ns_fd,
            os.O_RDWR | os.O_CREAT | os.O_EXCL,
            "arena",
        )
        try:
            # Allocate every page now: writes through the mapping can then
            # never hit a full /dev/shm (SIGBUS), and page allocation is paid
            # once per arena instead of inside each put.
            os.posix_fallocate(fd, 0, size)
            mm = _map_file(fd, size, write=True)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(f"{aid:016x}.arena", dir_fd=self._ns_fd)
            raise StoreCapacityError(
                f"allocating a {size}-byte artifact arena failed: {e}; /dev/shm "
                f"may be full (store capacity {self._capacity})"
            ) from e
        os.close(fd)
        arena = _Arena(aid, mm, size)
        self._arenas[aid] = arena
        self._stats.used_bytes += size
        extra = self._stats.extra
        extra["arenas_started"] = extra.get("arenas_started", 0) + 1
        self._active = arena
        return arena

    def _reserve(self, nbytes: int) -> tuple[_Arena, int]:
        """Writer: space for ``nbytes`` in the active arena (starting one if
        needed); returns (arena, offset). The space is consumed whether or
        not it ends up indexed (never reused)."""
        a = self._active
        if a is None or _align(a.fill) + nbytes > a.size:
            a = self._start_arena(nbytes)
        off = _align(a.fill)
        a.fill = off + nbytes
        return a, off

    def _fits_active(self, nbytes: int) -> bool:
        a = self._active
        return a is not None and _align(a.fill) + nbytes <= a.size

    # ----------------------------------------------------------- writer
    def _append_log(self, recs: np.ndarray) -> None:
        if recs.shape[0] == 0:
            return
        data = _encode_batch(recs)
        if self._fault_hook is not None:
            half = len(data) // 2
            _write_all(self._log_fd, [data[:half]], self._log_size)
            self._fault_hook("mid_index")
            _write_all(self._log_fd, [data[half:]], self._log_size + half)
        else:
            _write_all(self._log_fd, [data], self._log_size)
        self._log_size += len(data)

    def _used(self) -> int:
        return sum(a.size for a in self._arenas.values())

    def _pinned_bytes(self, protect: set[str]) -> int:
        idx = self._index
        slots = [s for key in set(self._pins) | protect for s in idx.versions(key)]
        return int(idx.length[np.array(slots, np.int64)].sum()) if slots else 0

    def _make_room(self, incoming: int, protect: set[str]) -> None:
        def need() -> int:
            if self._fits_active(incoming):
                return 0
            return max(self._arena_bytes, _align(incoming))

        if self._used() + need() <= self._capacity:
            return
        pinned = self._pinned_bytes(protect)
        if pinned + incoming > self._capacity:
            raise StoreCapacityError(
                f"artifact store full: {pinned} bytes pinned by live requests "
                f"+ {incoming} new bytes exceed the capacity of "
                f"{self._capacity} bytes; raise the artifact capacity or lower "
                "the number of concurrent requests"
            )
        for aid in sorted(self._arenas):
            if self._used() + need() <= self._capacity:
                break
            if aid not in self._arenas:
                continue
            if self._active is not None and aid == self._active.aid:
                # Seal the active arena so that it can be evicted; moved
                # objects go to a fresh one.
                self._active = None
            self._evict_arena(aid, protect)

    def _evict_arena(self, aid: int, protect: set[str]) -> None:
        idx = self._index
        victim = self._arenas[aid]
        slots = idx.slots_of_arena(aid)
        moves: list[tuple[str, int, int]] = []  # key, checksum, slot
        drops: list[tuple[str, int]] = []
        for s, key in zip(slots.tolist(), idx.keys_of(slots)):
            cs = int(idx.cs[s])
            if self._pins.get(key) or key in protect:
                moves.append((key, cs, s))
            else:
                drops.append((key, cs))
        parts = []
        if drops:
            parts.append(
                _records(
                    _REC_DROP,
                    bytes.fromhex("".join(k for k, _ in drops)),
                    aid,
                    0,
                    0,
                    np.array([c for _, c in drops], np.uint64),
                )
            )
            for key, cs in drops:
                idx.drop(key, cs)
            self._stats.evicted_objects += len(drops)
        if moves:
            ms = np.array([s for _, _, s in moves], np.int64)
            lens = idx.length[ms]
            total = int(lens.sum())
            dst, base = self._reserve(total)
            offs = base + np.concatenate(([0], np.cumsum(lens)[:-1]))
            for s, o, ln in zip(ms.tolist(), offs.tolist(), lens.tolist()):
                so = int(idx.off[s])
                dst.arr[o : o + ln] = victim.arr[so : so + ln]
            parts.append(
                _records(
                    _REC_MOVE,
                    bytes.fromhex("".join(k for k, _, _ in moves)),
                    dst.aid,
                    offs,
                    lens,
                    np.array([c for _, c, _ in moves], np.uint64),
                )
            )
            idx.arena[ms] = dst.aid
            idx.off[ms] = offs
            self._stats.relocated_objects += len(moves)
        parts.append(_records(_REC_RETIRE, bytes(KEY_NBYTES), aid, 0, 0, 0))
        self._append_log(np.concatenate(parts).astype(_REC_DTYPE, copy=False))
        del self._arenas[aid]
        victim.close()
        self._stats.used_bytes -= victim.size
        os.unlink(f"{aid:016x}.arena", dir_fd=self._ns_fd)

    def put_many(
        self, items: Sequence[tuple[str, Payload]], *, pin: bool = False
    ) -> PutResult:
        """Publish a batch: one copy into the arena and one index write.

        Identical re-puts write nothing (the version becomes current again);
        different bytes under an existing key are stored as a new version
        (``on_divergence="version"``) and counted in ``stats().divergences``,
        or rejected with :class:`ObjectDivergenceError` (``"raise"``).
        """
        views = [memoryview(d).cast("B") for _, d in items]
        lens = [len(v) for v in views]

        def fill(buf: np.ndarray) -> None:
            mv = buf.data
            o = 0
            for v in views:
                mv[o : o + len(v)] = v
                o += len(v)

        return self.put_packed([k for k, _ in items], lens, fill, pin=pin)

    def put_packed(
        self,
        keys: Sequence[str],
        lengths: Sequence[int] | np.ndarray,
        fill: FillFn,
        *,
        pin: bool = False,
    ) -> PutResult:
        """See :meth:`ObjectStore.put_packed`: ``fill`` writes straight into
        the arena; data is complete before the index batch that names it is
        appended, which is what makes publication atomic."""
        with self._lock:
            self._check_writer()
            n = len(keys)
            if n == 0:
                return PutResult((), ())
            kraw = validate_keys(keys)
            lens = np.asarray(lengths, np.int64)
            if lens.shape != (n,) or (lens < 0).any():
                raise ValueError("lengths must be one non-negative int per key")
            total = int(lens.sum())
            protect = set(keys) if pin else set()
            self._make_room(total, protect)
            arena, base = self._reserve(total)
            region = arena.arr[base : base + total]
            offs = np.empty(n, np.int64)
            offs[0] = 0
            np.cumsum(lens[:-1], out=offs[1:])
            sums = fill(region)
            off_l, len_l = offs.tolist(), lens.tolist()
            if sums is None:
                fn = checksum_function(self._algo)
                mv = region.data
                cs = np.fromiter(
                    (fn(mv[o : o + ln]) for o, ln in zip(off_l, len_l)), np.uint64, n
                )
            else:
                cs = np.asarray(sums, np.uint64)
                if cs.shape != (n,):
                    raise ValueError("fill must return one checksum per object")
            offs += base
            if self._fault_hook is not None:
                self._fault_hook("after_data")
            idx = self._index
            fresh = idx.head.keys().isdisjoint(keys) and len(set(keys)) == n
            if fresh:
                statuses = [PutStatus.WRITTEN] * n
                recs = _records(_REC_PUT, kraw, arena.aid, offs, lens, cs)
                self._append_log(recs)
                idx.put_new(keys, kraw, cs, arena.aid, offs, lens)
                self._stats.puts_written += n
            else:
                statuses, recs = self._classify(
                    keys, kraw, cs, arena, offs, lens, region
                )
                self._append_log(recs)
                for i, key in enumerate(keys):
                    r = recs[i]
                    idx.put(
                        key, int(r["cs"]), int(r["arena"]), int(r["off"]), int(r["len"])
                    )
            # tuple.__new__ builds the named tuples without a Python frame.
            refs = tuple(
                map(tuple.__new__, repeat(ObjectRef), zip(keys, cs.tolist(), len_l))
            )
            if pin:
                pins = self._pins
                for key in keys:
                    pins[key] = pins.get(key, 0) + 1
            self._maybe_compact_log()
            self._housekeeping()
            return PutResult(refs, tuple(statuses))

    def _classify(
        self,
        keys: Sequence[str],
        kraw: bytes,
        cs: np.ndarray,
        arena: _Arena,
        offs: np.ndarray,
        lens: np.ndarray,
        region: np.ndarray,
    ) -> tuple[list[PutStatus], np.ndarray]:
        """Slow path of a put that touches existing keys (or repeats a key):
        identical re-puts point at the existing bytes, divergent ones become
        new versions. Returns statuses and the index records."""
        idx = self._index
        arenas = np.full(len(keys), arena.aid, np.int64)
        offs = offs.copy()
        lens = lens.copy()
        statuses: list[PutStatus] = []
        pending: dict[tuple[str, int], int] = {}
        pending_keys: set[str] = set()
        rbase = int(offs[0])  # arena offset of ``region``
        for i, key in enumerate(keys):
            c = int(cs[i])
            s = idx.find(key, c)
            exists = key in idx.head
            lo = int(offs[i]) - rbase
            mine = region[lo : lo + int(lens[i])]
            j = pending.get((key, c))
            if j is not None:
                arenas[i], offs[i], lens[i] = arenas[j], offs[j], lens[j]
                statuses.append(PutStatus.IDENTICAL)
                continue
            if s is not None:
                old = self._map_arena(int(idx.arena[s]))
                so, sl = int(idx.off[s]), int(idx.length[s])
                if (
                    sl == len(mine)
                    and old.arr[so : so + sl].tobytes() == mine.tobytes()
                ):
                    arenas[i], offs[i], lens[i] = idx.arena[s], so, sl
                    statuses.append(PutStatus.IDENTICAL)
                    continue
            status = (
                PutStatus.DIVERGED
                if exists or key in pending_keys
                else PutStatus.WRITTEN
            )
            if status == PutStatus.DIVERGED and self._on_divergence == "raise":
                raise ObjectDivergenceError(
                    f"artifact object {key} already exists with different "
                    "bytes (strict divergence policy)"
                )
            pending[(key, c)] = i
            pending_keys.add(key)
            statuses.append(status)
        for st, key, c in zip(statuses, keys, cs.tolist()):
            if st == PutStatus.WRITTEN:
                self._stats.puts_written += 1
            elif st == PutStatus.IDENTICAL:
                self._stats.puts_identical += 1
            else:
                self._stats.divergences += 1
                logger.debug("artifact object %s diverged (new checksum %#x)", key, c)
        return statuses, _records(_REC_PUT, kraw, arenas, offs, lens, cs)

    def _maybe_compact_log(self) -> None:
        live = self._index.num_versions
        if self._log_size <= self._log_compact_bytes or self._log_size <= 4 * (
            _RECORD.size * (live + 1) + 4096
        ):
            return
        idx = self._index
        parts = []
        for key in idx.head:
            cur = idx.cur.get(key)
            order = [s for s in reversed(idx.versions(key)) if s != cur]
            if cur is not None:
                order.append(cur)
            sl = np.array(order, np.int64)
            kb = bytes.fromhex(key) * len(order)
            parts.append(
                _records(
                    _REC_PUT, kb, idx.arena[sl], idx.off[sl], idx.length[sl], idx.cs[sl]
                )
            )
            if cur is None:
                parts.append(_records(_REC_NOCURRENT, bytes.fromhex(key), 0, 0, 0, 0))
        recs = (
            np.concatenate(parts).astype(_REC_DTYPE, copy=False)
            if parts
            else np.zeros(0, _REC_DTYPE)
        )
        tmp = f"{self._next_arena:016x}.tmp"
        self._next_arena += 1
        fd = _open_file(tmp, self._ns_fd, os.O_RDWR | os.O_CREAT | os.O_EXCL, "log")
        try:
            data = [_log_header(self._algo)]
            for i in range(0, recs.shape[0], 4096):
                data.append(_encode_batch(recs[i : i + 4096]))
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
            ks = list(keys)
            slots = self._index.lookup(ks)
            for k, s in zip(ks, slots):
                if s is None:
                    raise ObjectMissingError(
                        f"cannot pin artifact object {ref_key(k)}: missing"
                    )
            for k in ks:
                key = k.key if isinstance(k, ObjectRef) else k
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
            ref_key(key)
            return self._index.lookup([key])[0] is not None

    def _locate(self, keys: Sequence[KeyOrRef]) -> np.ndarray:
        """Slots of ``keys``, raising the typed error for the first one
        that is missing."""
        # Fast path: current versions by key. ``cur`` has str keys only, so
        # a ref (a tuple) or a missing key yields None, on which fromiter
        # raises; the general lookup below then sorts it out.
        try:
            return np.fromiter(map(self._index.cur.get, keys), np.int64, len(keys))  # type: ignore[arg-type]
        except TypeError:
            pass
        found = self._index.lookup(keys)
        if None in found:
            for k, s in zip(keys, found):
                key = ref_key(k)  # InvalidKeyError for malformed keys
                if s is not None:
                    continue
                what = (
                    f"version {k.checksum:#x} of artifact object {key}"
                    if isinstance(k, ObjectRef)
                    else f"artifact object {key}"
                )
                if isinstance(k, ObjectRef) or key not in self._index.head:
                    raise ObjectMissingError(
                        f"{what} is missing from store {self._namespace} "
                        "(never published, evicted, or from another namespace "
                        "or weight version)"
                    )
                raise ObjectDivergenceError(
                    f"{what} has no current version (its latest version was "
                    "evicted after a divergence)"
                )
        return np.fromiter(found, np.int64, len(found))

    def _with_retry(self, op: Callable[[], _T]) -> _T:
        with self._lock:
            self._check_open()
            self._refresh()
            for attempt in range(3):
                try:
                    return op()
                except FileNotFoundError:
                    # An arena was evicted between lookup and open: the log
                    # already says where its objects went.
                    if attempt == 2 or self._writer:
                        raise
                    self._refresh()
            raise ArtifactStoreError("unreachable")  # pragma: no cover

    def get_batch(self, keys: Sequence[KeyOrRef]) -> ObjectBatch:
        """Read objects into one private buffer and verify every checksum
        on that copy."""
        return self._with_retry(lambda: self._get_batch_once(keys))

    def get_split(
        self,
        keys: Sequence[KeyOrRef],
        trailer_nbytes: int,
        out: np.ndarray,
        body_nbytes: Sequence[int] | np.ndarray | None = None,
    ) -> SplitBatch:
        """See :meth:`ObjectStore.get_split`. Each object's checksum is
        verified over the arena's bytes right before they are copied
        (arena bytes are immutable once indexed); bodies go straight into
        ``out``, one copy per byte."""
        return self._with_retry(
            lambda: self._get_split_once(keys, trailer_nbytes, out, body_nbytes)
        )

    def _resolve_many(
        self, keys: Sequence[KeyOrRef]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[_Arena]]:
        idx = self._index
        slots = self._locate(keys)
        aids, offs = idx.arena[slots], idx.off[slots]
        lens, sums = idx.length[slots], idx.cs[slots]
        maps = []
        for aid in np.unique(aids).tolist():
            a = self._map_arena(aid)
            sel = aids == aid
            bad = offs[sel] + lens[sel] > a.size
            if bad.any():
                self._stats.checksum_failures += 1
                raise ChecksumMismatchError(
                    f"artifact arena {aid:016x} in store {self._namespace} is "
                    "shorter than its index says"
                )
            maps.append(a)
        return aids, offs, lens, sums, maps

    def _verify(
        self,
        keys: Sequence[KeyOrRef],
        views: Sequence[memoryview],
        offs: Sequence[int],
        lens: Sequence[int],
        sums: np.ndarray,
    ) -> None:
        fn = checksum_function(self._algo)
        got = np.fromiter(
            (fn(v[o : o + ln]) for v, o, ln in zip(views, offs, lens)),
            np.uint64,
            len(lens),
        )
        bad = got != sums
        if bad.any():
            i = int(np.argmax(bad))
            self._stats.checksum_failures += 1
            raise ChecksumMismatchError(
                f"artifact object {ref_key(keys[i])} in store "
                f"{self._namespace} failed its checksum (corrupted bytes)"
            )

    def _get_batch_once(self, keys: Sequence[KeyOrRef]) -> ObjectBatch:
        n = len(keys)
        aids, offs, lens, sums, maps = self._resolve_many(keys)
        by_id = {a.aid: a for a in maps}
        dst = np.zeros(n, np.int64)
        if n > 1:
            np.cumsum(lens[:-1], out=dst[1:])
        data = np.empty(int(lens.sum()) if n else 0, np.uint8)
        for aid, so, d, ln in _runs(aids, offs, lens, dst):
            data[d : d + ln] = by_id[aid].arr[so : so + ln]
        mv = data.data
        self._verify(keys, [mv] * n, dst.tolist(), lens.tolist(), sums)
        return ObjectBatch(data, dst, lens, tuple(sums.tolist()))

    def _checksum_failed(self, keys: Sequence[KeyOrRef], i: int) -> None:
        self._stats.checksum_failures += 1
        raise ChecksumMismatchError(
            f"artifact object {ref_key(keys[i])} in store "
            f"{self._namespace} failed its checksum (corrupted bytes)"
        )

    def _get_split_once(
        self,
        keys: Sequence[KeyOrRef],
        trailer_nbytes: int,
        out: np.ndarray,
        body_nbytes: Sequence[int] | np.ndarray | None,
    ) -> SplitBatch:
        n = len(keys)
        aids, offs, lens, sums, maps = self._resolve_many(keys)
        bodies = self._check_split(lens, trailer_nbytes, out, body_nbytes)
        trailers = np.empty((n, trailer_nbytes), np.uint8)
        if n == 0:
            return SplitBatch(trailers, lens, sums)
        if trailer_nbytes:
            starts = offs + bodies
            # Trailers aligned to their own size (64-byte envelopes after
            # 64-byte-multiple bodies): one take per arena over a view of the
            # arena as trailer-sized units; else a 2-D fancy index.
            unit = trailer_nbytes
            aligned = (
                all(a.size % unit == 0 for a in maps) and not (starts % unit).any()
            )
            tv = trailers.view(f"V{unit}").reshape(n) if aligned else None
            tcol = np.arange(trailer_nbytes)
            for a in maps:
                sel = np.flatnonzero(aids == a.aid) if len(maps) > 1 else slice(None)
                if tv is not None:
                    tv[sel] = a.arr.view(f"V{unit}")[starts[sel] // unit]
                else:
                    trailers[sel] = a.arr[starts[sel][:, None] + tcol]
        # Each object is checksummed and then copied while its bytes are
        # still in L1 (an object is a few KiB), so memory is read once. One
        # object per iteration with memoryview slices (memcpy) beat hashing
        # a chunk of objects and copying it with one strided numpy copy.
        dst_end = np.cumsum(bodies)
        fn = checksum_function(self._algo)
        omv = out.data
        mvs = {a.aid: a.mv for a in maps}
        aid_l = aids.tolist()
        offs_l, ends_l, sums_l = offs.tolist(), (offs + lens).tolist(), sums.tolist()
        views = repeat(maps[0].mv) if len(maps) == 1 else map(mvs.__getitem__, aid_l)
        for mv, o, e, b, de, want in zip(
            views, offs_l, ends_l, bodies.tolist(), dst_end.tolist(), sums_l
        ):
            v = mv[o:e]
            if fn(v) != want:
                # Name the first object that fails (rare; no index kept above).
                bad = [
                    fn(mvs[a][o:e]) != w
                    for a, o, e, w in zip(aid_l, offs_l, ends_l, sums_l)
                ]
                self._checksum_failed(keys, bad.index(True) if True in bad else 0)
            omv[de - b : de] = v[:b]
        return SplitBatch(trailers, lens, sums)

    # ----------------------------------------------------------- misc
    def stats(self) -> StoreStats:
        with self._lock:
            s = self._stats
            s.objects = self._index.num_versions
            s.keys = len(self._index.head)
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
        """Close handles and mappings. A writer removes its namespace unless
        it was created with ``remove_on_close=False`` (then TTL collection
        removes it after the writer is gone)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._unmap_all()
            for attr in ("_log_fd", "_writer_fd"):
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
            for attr in ("_log_fd", "_writer_fd", "_ns_fd", "_root_fd"):
                fd = getattr(self, attr, -1)
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)


def _runs(
    aids: np.ndarray, offs: np.ndarray, lens: np.ndarray, dst: np.ndarray
) -> list[tuple[int, int, int, int]]:
    """Merge objects adjacent in one arena (and in the output) into
    (arena, source offset, destination offset, length) runs."""
    n = aids.shape[0]
    if n == 0:
        return []
    brk = np.ones(n, np.bool_)
    brk[1:] = (aids[1:] != aids[:-1]) | (offs[1:] != offs[:-1] + lens[:-1])
    starts = np.flatnonzero(brk)
    run_len = np.add.reduceat(lens, starts)
    return list(
        zip(
            aids[starts].tolist(),
            offs[starts].tolist(),
            dst[starts].tolist(),
            run_len.tolist(),
        )
    )


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
