# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read-many objects: one payload in the scope directory that any number of
processes read by byte range until it is removed.

An object is one file ``<h>.rdm`` in the scope directory, ``h`` a hash of
its key (never the key itself)::

    [prefix 4 KiB: magic | version | prefix size | user size | key hash
                   | producer pid | start | pid namespace | boot
                   | at 128: readers (u32, 0 until the first release)
                   | at 256: release bitmap, one bit per reader]
    [user bytes]

The producer writes ``.tmp-<h>-<producer token>`` (0600, ``O_EXCL``) and
links it to ``<h>.rdm`` (``link`` refuses an existing name: one publication
per key), so a reader never sees a partial object. Unlike a per-key segment
nothing claims it: readers open it, read the ranges they need with
``preadv`` and mark themselves done in the release bitmap under an
``flock`` of the file. The release that completes the set removes the file;
so do the producer (:meth:`ReadablePublisher.withdraw`, its close), the
driver (:func:`remove_readable`) and the sweep of killed producers
(:mod:`.liveness`). Every removal takes the same lock and unlinks the name
only while it still names the locked inode. A reader that has the file open
keeps reading it after its removal (POSIX): removal only stops new opens.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from vllm_host_transport.discovery import (
    HostTransportError,
    ProducerId,
    ScopeDir,
    ScopeMissingError,
    ScopeSquattedError,
)
from vllm_host_transport.safe_fs import (
    open_private_dir,
    open_private_file,
    write_all,
)

logger = logging.getLogger("vllm.host_transport.readmany")

RDM_MAGIC = b"VHTRDM01"
RDM_VERSION = 1
# magic | version | prefix size | user size | key hash | pid | start
# | pid namespace | boot
RDM_HEADER = struct.Struct("<8sIIQ16sQQQ8s")
# User bytes start here: page-aligned, so a reader may also map them.
PREFIX_SIZE = 4096
_READERS_AT = 128  # u32: the reader count the first release named
_BITMAP_AT = 256
#: Most readers one object can count (bits in the release bitmap).
MAX_READERS = 8 * 2048
_U32 = struct.Struct("<I")
SUFFIX = ".rdm"
# Longest a release or a removal waits for another process's hold on an
# object's lock (each holds it for a few system calls).
LOCK_WAIT_S = 5.0


class ReadableMissingError(HostTransportError):
    """The read-many object is not there: never published, released by its
    last reader or the driver, withdrawn by its producer, or its producer was
    killed."""


def readable_name(key: str) -> str:
    """The object's file name in the scope directory: a hash of the key."""
    return (
        hashlib.blake2b(key.encode(), digest_size=16, person=b"vhtrdm").hexdigest()
        + SUFFIX
    )


def _key_hash(key: str) -> bytes:
    # As shared.key_hash (which this module may not import: layers).
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def _lock(fd: int, wait_s: float) -> bool:
    """``flock(LOCK_EX)`` tried until ``wait_s`` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)


def _names_inode(dir_fd: int, name: str, ino: int) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_ino == ino and stat.S_ISREG(st.st_mode)


def remove_object(
    dir_fd: int, name: str, wait_s: float = LOCK_WAIT_S, ino: int | None = None
) -> bool:
    """Remove the object file ``name`` (only the inode ``ino`` when given)
    under its lock: True if this call removed it; False if it was not there,
    or its lock stayed busy for ``wait_s``. A symlink or a file that is not
    ours raises :class:`HostTransportError`."""
    try:
        fd = open_private_file(
            name,
            dir_fd,
            os.O_RDONLY,
            f"read-many object {name}",
            error=HostTransportError,
        )
    except FileNotFoundError:
        return False
    try:
        if not _lock(fd, wait_s):
            return False
        own = os.fstat(fd).st_ino
        if (ino is not None and own != ino) or not _names_inode(dir_fd, name, own):
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    finally:
        os.close(fd)  # drops the lock


def _unpack_prefix(raw: bytes) -> tuple[int, bytes, ProducerId] | None:
    """(user size, key hash, producer) of a prefix, None if not one."""
    if len(raw) < RDM_HEADER.size:
        return None
    magic, version, prefix, size, kh, pid, start, pid_ns, boot = RDM_HEADER.unpack_from(
        raw
    )
    if magic != RDM_MAGIC or version != RDM_VERSION or prefix != PREFIX_SIZE:
        return None
    return size, kh, ProducerId(pid, start, pid_ns, boot.hex())


def object_producer(dir_fd: int, name: str) -> ProducerId | None:
    """The producer of object file ``name`` (from its prefix), or None when
    it cannot be read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        got = _unpack_prefix(os.pread(fd, RDM_HEADER.size, 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if got is None else got[2]


# ---------------------------------------------------------------- readers
def _open_scope(scope: str, shm_root: str | None) -> int:
    """The scope directory's descriptor, joining nothing and creating
    nothing: :class:`ScopeMissingError` when it is not there,
    :class:`ScopeSquattedError` when it is not this user's private one."""
    if not isinstance(scope, str) or not scope:
        raise ValueError("scope must be a non-empty string")
    root = shm_root if shm_root is not None else "/dev/shm"
    name = ScopeDir.dir_name(scope)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_private_dir(name, dir_fd=root_fd, error=ScopeSquattedError)
    except FileNotFoundError:
        raise ScopeMissingError(f"{os.path.join(root, name)} does not exist") from None
    except OSError as e:
        raise HostTransportError(
            f"{os.path.join(root, name)} cannot be opened: {e}"
        ) from e
    finally:
        os.close(root_fd)


class ReadableObject:
    """An open read-many object: read ranges of it, then release it. Reads
    go on after the object is removed (the file stays open)."""

    def __init__(self, dir_fd: int, fd: int, name: str, size: int) -> None:
        self._dir_fd = dir_fd
        self._fd = fd
        self.name = name
        self.size = size  # user bytes

    def _check_open(self) -> int:
        if self._fd < 0:
            raise HostTransportError("read-many object is closed")
        return self._fd

    def read_into(self, offset: int, dst: Any) -> None:
        """Fill ``dst`` (a writable, contiguous buffer, e.g. a numpy uint8
        array) exactly with the user bytes from ``offset``."""
        fd = self._check_open()
        view = memoryview(dst).cast("B")
        if view.readonly:
            raise ValueError("dst must be writable")
        n = len(view)
        if offset < 0 or offset + n > self.size:
            raise ValueError(
                f"range [{offset}, {offset + n}) is outside the object's "
                f"{self.size} bytes"
            )
        done = 0
        while done < n:
            got = os.preadv(fd, [view[done:]], PREFIX_SIZE + offset + done)
            if got <= 0:
                raise HostTransportError(
                    f"short read of read-many object {self.name}: {done} of "
                    f"{n} bytes at {offset} (truncated by another process?)"
                )
            done += got

    def release(self, reader: int, readers: int) -> bool:
        """Mark reader ``reader`` of ``readers`` done (again: no effect).
        The release that completes the set removes the object and returns
        True; otherwise False (also when the object is gone already). A
        ``readers`` other than the first release's raises ValueError."""
        fd = self._check_open()
        if not 0 < readers <= MAX_READERS:
            raise ValueError(f"readers must lie in 1..{MAX_READERS}, got {readers}")
        if not 0 <= reader < readers:
            raise ValueError(f"reader must lie in 0..{readers - 1}, got {reader}")
        if not _lock(fd, LOCK_WAIT_S):
            raise HostTransportError(
                f"read-many object {self.name}: its lock stayed busy for "
                f"{LOCK_WAIT_S} s"
            )
        try:
            ino = os.fstat(fd).st_ino
            if not _names_inode(self._dir_fd, self.name, ino):
                return False  # removed (and perhaps published again) meanwhile
            (first,) = _U32.unpack(os.pread(fd, 4, _READERS_AT))
            if first == 0:
                os.pwrite(fd, _U32.pack(readers), _READERS_AT)
            elif first != readers:
                raise ValueError(
                    f"read-many object {self.name} is released by {first} "
                    f"readers, not {readers}"
                )
            nbytes = (readers + 7) // 8
            bitmap = bytearray(os.pread(fd, nbytes, _BITMAP_AT))
            bit = 1 << (reader % 8)
            if not bitmap[reader // 8] & bit:
                bitmap[reader // 8] |= bit
                os.pwrite(
                    fd, bitmap[reader // 8 : reader // 8 + 1], _BITMAP_AT + reader // 8
                )
            if int.from_bytes(bitmap, "little").bit_count() < readers:
                return False
            os.unlink(self.name, dir_fd=self._dir_fd)
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        dir_fd, self._dir_fd = self._dir_fd, -1
        for d in (fd, dir_fd):
            if d >= 0:
                os.close(d)

    def __enter__(self) -> ReadableObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # No module globals here: at interpreter exit they may be gone.
        try:  # noqa: SIM105 - contextlib may be gone at exit
            self.close()
        except Exception:
            pass


def open_readable(
    scope: str, key: str, *, shm_root: str | None = None
) -> ReadableObject:
    """Open the read-many object ``key`` of ``scope``. Raises at once:
    :class:`ReadableMissingError` when it is not there,
    :class:`ScopeMissingError` when the scope is not,
    :class:`HostTransportError` when either is not this user's private
    directory or file (a symlink is refused) or is not a whole object."""
    name = readable_name(key)
    dir_fd = _open_scope(scope, shm_root)
    fd = -1
    try:
        try:
            fd = open_private_file(
                name,
                dir_fd,
                os.O_RDWR,
                f"read-many object {name}",
                error=HostTransportError,
            )
        except FileNotFoundError:
            raise ReadableMissingError(
                f"read-many object {key!r} is not in scope {scope!r}"
            ) from None
        got = _unpack_prefix(os.pread(fd, PREFIX_SIZE, 0))
        if got is None or got[1] != _key_hash(key):
            raise HostTransportError(f"{name} is not a read-many object of {key!r}")
        size, _, producer = got
        if os.fstat(fd).st_size != PREFIX_SIZE + size:
            raise HostTransportError(f"read-many object {name} is not whole")
        # Nothing of a producer proven gone is read (as with segments); one
        # of another PID namespace cannot be checked from here and is alive.
        if not producer.alive():
            with contextlib.suppress(OSError, HostTransportError):
                remove_object(dir_fd, name, 0.0, os.fstat(fd).st_ino)
            raise ReadableMissingError(
                f"read-many object {key!r}: its producer is gone"
            )
        obj = ReadableObject(dir_fd, fd, name, size)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        os.close(dir_fd)
        raise
    return obj


def remove_readable(scope: str, key: str, *, shm_root: str | None = None) -> bool:
    """Remove the read-many object ``key`` of ``scope`` now (the driver's
    release): True if this call removed it, False if it was not there."""
    dir_fd = _open_scope(scope, shm_root)
    try:
        return remove_object(dir_fd, readable_name(key))
    finally:
        os.close(dir_fd)


# --------------------------------------------------------------- producer
class PublisherScope(Protocol):
    """What a connector shares with its publisher (``shared.Shared``)."""

    ident: ProducerId
    stats: dict[str, int]
    scope: ScopeDir | None

    def check_open(self) -> ScopeDir: ...


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class ReadablePublisher:
    """One connector's read-many objects: publishing, withdrawing, and the
    bookkeeping that lets ``close`` withdraw them all (at most
    ``max_tracked``; the oldest is withdrawn beyond it)."""

    def __init__(
        self,
        shared: PublisherScope,
        register: Callable[[], None],
        max_tracked: int,
        max_bytes: int,
    ) -> None:
        self._shared = shared
        self._register = register  # the producer's registration (liveness)
        self._max_tracked = max_tracked
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        # key -> (file name, inode); insertion-ordered: oldest first.
        self._tracked: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._logged: set[str] = set()

    def _log_once(self, what: str, msg: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            logger.warning(
                "%s (further such failures are counted in "
                "health()['readable_put_failures'], not logged)",
                msg % args,
            )

    def put(self, key: str, parts: Sequence[Any]) -> bool:
        if not isinstance(key, str):
            raise TypeError("key must be a str")
        views = [memoryview(p).cast("B") for p in parts]
        stats = self._shared.stats
        size = sum(len(v) for v in views)
        if size > self._max_bytes:
            stats["readable_put_failures"] += 1
            self._log_once(
                "large",
                "host transport: read-many object %r of %d bytes is "
                "larger than max_payload_bytes",
                key,
                size,
            )
            return False
        try:
            self._register()
            with self._lock:
                ok = self._put_locked(key, views, size)
        except OSError as e:
            ok = False
            if e.errno in _NO_SPACE:
                stats["put_no_space"] += 1
                self._log_once(
                    "space",
                    "host transport: read-many put %r failed: the "
                    "shared-memory mount is full (%s)",
                    key,
                    e.strerror,
                )
            else:
                self._log_once(
                    "os", "host transport: read-many put %r failed: %s", key, e
                )
        except HostTransportError as e:
            ok = False
            self._log_once("closed", "host transport: read-many put %r: %s", key, e)
        if ok:
            stats["readable_puts"] += 1
        else:
            stats["readable_put_failures"] += 1
        return ok

    def _put_locked(self, key: str, views: list[memoryview], size: int) -> bool:
        shared = self._shared
        dir_fd = shared.check_open().fd
        ident = shared.ident
        name = readable_name(key)
        prefix = bytearray(PREFIX_SIZE)
        RDM_HEADER.pack_into(
            prefix,
            0,
            RDM_MAGIC,
            RDM_VERSION,
            PREFIX_SIZE,
            size,
            _key_hash(key),
            ident.pid,
            ident.start,
            ident.pid_ns,
            bytes.fromhex(ident.boot),
        )
        # The name the sweep of killed producers recognises (liveness).
        tmp = f".tmp-{name[: -len(SUFFIX)]}-{ident.token}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            # Ours (the name carries this process), left by a failed put.
            os.unlink(tmp, dir_fd=dir_fd)
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            try:
                # Room first: a full mount fails here, before the copy.
                os.posix_fallocate(fd, 0, PREFIX_SIZE + size)
                if write_all(fd, [prefix, *views], 0) != PREFIX_SIZE + size:
                    raise OSError(errno.EIO, "short write")
                ino = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            try:
                os.link(
                    tmp,
                    name,
                    src_dir_fd=dir_fd,
                    dst_dir_fd=dir_fd,
                    follow_symlinks=False,
                )
            except FileExistsError:
                self._log_once(
                    "exists",
                    "host transport: read-many object %r is already "
                    "published; withdraw it before publishing it again",
                    key,
                )
                return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        tracked = self._tracked
        tracked.pop(key, None)
        tracked[key] = (name, ino)
        if len(tracked) > self._max_tracked:
            oldest, (oname, oino) = tracked.popitem(last=False)
            with contextlib.suppress(OSError, HostTransportError):
                if remove_object(dir_fd, oname, LOCK_WAIT_S, oino):
                    shared.stats["readables_evicted"] += 1
        return True

    def withdraw(self, key: str) -> bool:
        """Remove ``key``'s object now: True if this call removed it."""
        with self._lock:
            entry = self._tracked.pop(key, None)
            scope = self._shared.scope
            if entry is None or scope is None:
                return False
            try:
                removed = remove_object(scope.fd, entry[0], LOCK_WAIT_S, entry[1])
            except (OSError, HostTransportError) as e:
                logger.warning("host transport: withdraw of %r failed: %s", key, e)
                return False
            if removed:
                self._shared.stats["readables_withdrawn"] += 1
            return removed

    def gone(self, keys: Iterable[str]) -> list[str]:
        """Which of ``keys`` this publisher tracks whose object is no longer
        there (one listing of the scope); they are not tracked any more."""
        with self._lock:
            scope = self._shared.scope
            tracked = self._tracked
            wanted = [k for k in keys if k in tracked]
            if scope is None or not wanted:
                return []
            with os.scandir(scope.fd) as it:
                present = {e.name: e.inode() for e in it if e.name.endswith(SUFFIX)}
            gone = []
            for key in wanted:
                name, ino = tracked[key]
                if present.get(name) != ino:
                    gone.append(key)
                    del tracked[key]
            return gone

    def close(self) -> None:
        """Withdraw every object this publisher tracks."""
        with self._lock:
            scope = self._shared.scope
            tracked, self._tracked = self._tracked, OrderedDict()
            if scope is None:
                return
            for name, ino in tracked.values():
                with contextlib.suppress(OSError, HostTransportError):
                    remove_object(scope.fd, name, 0.05, ino)
