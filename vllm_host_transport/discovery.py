# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scope directory, directory stamp, producer identity and liveness."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import re
import sys
import threading
import time

from vllm_host_transport.process_identity import process_start_ticks
from vllm_host_transport.safe_fs import open_private_dir, open_private_file

STAMP_FILE = "stamp"
STAMP_SIZE = 4096
STAMP_MAGIC = 0x31504D5453544856  # "VHTSTMP1"
# Indexes into the stamp file viewed as an array of u64 (one cache line each).
Q_MAGIC = 0
Q_STAMP = 8
Q_PK_TOKEN = 16

# ring-<edge>-<pid>-<start>-<connector instance>
# Longest a new connector waits while the last connector of its scope removes
# the directory (a handful of unlinks).
_JOIN_WAIT_S = 10.0
RING_NAME_RE = re.compile(
    r"^ring-([0-9a-f]{16})-([0-9]{1,10})-([0-9]{1,20})-([0-9a-f]{16})$"
)
# Every name the transport creates in a scope directory (what the last
# connector to close removes): the stamp, rings, per-key segments and their
# lock files, files being built.
_OWN_NAME_RE = re.compile(
    r"^(stamp|ring-[0-9a-f-]+|[0-9a-f]{32}\.(seg|lock)|\.tmp-[0-9a-zA-Z.-]+)$"
)


class HostTransportError(RuntimeError):
    """The transport cannot work in this environment."""


def check_platform() -> None:
    if not sys.platform.startswith("linux"):
        raise HostTransportError(
            "the host transport needs Linux (shared memory under /dev/shm, "
            f"flock, pidfd); this platform is {sys.platform!r}"
        )


def hex_name(*parts: str | bytes, size: int = 16) -> str:
    """A fixed-width hex name for untrusted strings (never used as a path)."""
    h = hashlib.blake2b(digest_size=size // 2)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


_self_identity: tuple[int, int] | None = None

# Per-key token source: a random 64-bit base drawn once per process (redrawn
# after a fork) plus a counter, so no two writes of any two processes (or two
# connectors of one process) store the same token.
_token_lock = threading.Lock()
_token_state: list[int] = [-1, 0, 0]  # pid, base, counter


def next_token() -> int:
    with _token_lock:
        pid = os.getpid()
        if _token_state[0] != pid:
            _token_state[0] = pid
            _token_state[1] = int.from_bytes(os.urandom(8), "little")
            _token_state[2] = 0
        _token_state[2] += 1
        return (_token_state[1] + _token_state[2]) & 0xFFFFFFFFFFFFFFFF


def self_identity() -> tuple[int, int]:
    """(pid, start time) of this process; recomputed after a fork."""
    global _self_identity
    pid = os.getpid()
    if _self_identity is None or _self_identity[0] != pid:
        start = process_start_ticks(pid)
        if start is None:
            raise HostTransportError("cannot read /proc/self/stat")
        _self_identity = (pid, start)
    return _self_identity


def producer_alive(pid: int, start: int) -> bool:
    """One-shot liveness check (no descriptor kept)."""
    return process_start_ticks(pid) == start


def _open_root(root: str) -> int:
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_private_dir(root_fd: int, name: str) -> int:
    """Create (mode 0700) or open the directory ``name`` under ``root_fd``
    without following a symlink, and check that it is a directory owned by
    us with no group or other bits. Returns its descriptor."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=root_fd)
    return open_private_dir(name, dir_fd=root_fd, error=HostTransportError)


class ScopeDir:
    """The per-user, per-deployment directory and its stamp file.

    Every open connector holds a shared ``flock`` on the directory; the one
    that closes last (it gets the lock exclusively) removes the directory and
    everything the transport left in it."""

    @staticmethod
    def dir_name(scope: str) -> str:
        """The directory's name under the root (scope names are untrusted:
        only their hash is used)."""
        return f"vllm-ht-{os.getuid()}-{hex_name(scope)}"

    def __init__(self, root: str, scope: str) -> None:
        check_platform()
        self.uid = os.getuid()
        self.root = root
        self.name = self.dir_name(scope)
        self.path = os.path.join(root, self.name)
        self.fd = -1
        self.stamp_fd = -1
        self._mm: mmap.mmap | None = None
        self.q: memoryview | None = None
        root_fd = _open_root(root)
        try:
            deadline = time.monotonic() + _JOIN_WAIT_S
            while True:
                fd = _open_private_dir(root_fd, self.name)
                # Membership: busy only while a last closer removes the
                # directory.
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    if time.monotonic() > deadline:
                        raise HostTransportError(
                            f"{self.path} stayed locked by a closing connector"
                        ) from None
                    time.sleep(0.001)
                    continue
                if os.fstat(fd).st_nlink > 0:
                    break
                os.close(fd)  # removed meanwhile: create it again
        finally:
            os.close(root_fd)
        self.fd = fd
        try:
            self._open_stamp()
        except BaseException:
            self.close(teardown=False)
            raise

    # -------------------------------------------------------------- stamp
    def _open_stamp(self) -> None:
        try:
            fd = open_private_file(
                STAMP_FILE, self.fd, os.O_RDWR, "stamp file", error=HostTransportError
            )
        except FileNotFoundError:
            fd = self._create_stamp()
        try:
            st = os.fstat(fd)
            if st.st_size < STAMP_SIZE or st.st_uid != self.uid:
                raise HostTransportError("stamp file is not valid")
            mm = mmap.mmap(fd, STAMP_SIZE)
        except Exception:
            os.close(fd)
            raise
        self.stamp_fd = fd
        self._mm = mm
        self.q = memoryview(mm).cast("Q")
        if self.q[Q_MAGIC] != STAMP_MAGIC:
            self.close()
            raise HostTransportError("stamp file has a bad magic")

    def _create_stamp(self) -> int:
        tmp = f".tmp-stamp-{os.getpid()}-{threading.get_ident()}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
        try:
            os.posix_fallocate(fd, 0, STAMP_SIZE)
            with mmap.mmap(fd, STAMP_SIZE) as mm:
                q = memoryview(mm).cast("Q")
                q[Q_STAMP] = time.time_ns()
                q[Q_MAGIC] = STAMP_MAGIC
                q.release()
            try:
                os.link(tmp, STAMP_FILE, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except FileExistsError:
                os.close(fd)
                fd = os.open(
                    STAMP_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd
                )
        except Exception:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
        return fd

    def read_stamp(self) -> int:
        q = self.q
        return q[Q_STAMP] if q is not None else 0

    def advance_stamp(self, wait: bool = True) -> bool:
        """Move the directory stamp strictly forward (even with a frozen or
        backwards clock). Serialised by a lock on the stamp file; only
        registrations and retirements call it. With ``wait=False`` (the
        receive path) the lock is only tried: False when it was busy."""
        q = self.q
        if q is None:
            raise HostTransportError("stamp file is closed")
        try:
            fcntl.flock(
                self.stamp_fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB
            )
        except BlockingIOError:
            return False
        try:
            q[Q_STAMP] = max(q[Q_STAMP] + 1, time.time_ns())
            return True
        finally:
            fcntl.flock(self.stamp_fd, fcntl.LOCK_UN)

    def read_pk_token(self) -> int:
        q = self.q
        return q[Q_PK_TOKEN] if q is not None else -1

    def bump_pk_token(self) -> None:
        """Announce a per-key publication. Lock-free: every write stores a value
        no other write stores (see :func:`next_token`), so a receiver that read
        the token before its probe sees a change afterwards."""
        q = self.q
        if q is None:
            return
        q[Q_PK_TOKEN] = next_token()

    def list_rings(self) -> list[str]:
        return [n for n in os.listdir(self.fd) if n.startswith("ring-")]

    def close(self, teardown: bool = True) -> None:
        """Release the directory. With ``teardown`` (the connector's owning
        process), the last connector of the scope to close removes it."""
        q, self.q = self.q, None
        if q is not None:
            q.release()
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()
        fd, self.stamp_fd = self.stamp_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            if teardown:
                with contextlib.suppress(OSError):
                    self._remove_if_last(fd)
        finally:
            os.close(fd)

    def _remove_if_last(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another connector still uses the scope
        try:
            # No connector is open in this scope (each holds a shared lock),
            # and a new one waits for this lock, then sees the directory gone.
            for name in os.listdir(fd):
                if _OWN_NAME_RE.match(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=fd)
            root_fd = _open_root(self.root)
            try:
                os.rmdir(self.name, dir_fd=root_fd)  # fails if anything else is in it
            finally:
                os.close(root_fd)
        finally:
            # Released explicitly: a forked child may still hold a copy of
            # this descriptor (the same open file, so the same lock).
            fcntl.flock(fd, fcntl.LOCK_UN)
