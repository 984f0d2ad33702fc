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
from typing import NamedTuple

from vllm_host_transport.process_identity import (
    ProcessWatch,
    boot_tag,
    judge_origin,
    pid_namespace,
    process_start_ticks,
)
from vllm_host_transport.safe_fs import (
    check_private_entry,
    make_fresh_private_dir,
    open_private_dir,
    open_private_file,
    owner_name,
)

STAMP_FILE = "stamp"
STAMP_SIZE = 4096
STAMP_MAGIC = 0x31504D5453544856  # "VHTSTMP1"
# Indexes into the stamp file viewed as an array of u64 (one cache line each).
Q_MAGIC = 0
Q_STAMP = 8
Q_PK_TOKEN = 16

# Longest a new connector waits while the last connector of its scope removes
# the directory (a handful of unlinks).
_JOIN_WAIT_S = 10.0
# A producer's origin in a name: its PID namespace (inode, hex) and boot
# (see ProducerId).
ORIGIN_RE = r"([0-9a-f]{1,16})-([0-9a-f]{16})"
# ring-<edge>-<pid>-<start>-<connector instance>-<pid namespace>-<boot>
RING_NAME_RE = re.compile(
    r"^ring-([0-9a-f]{16})-([0-9]{1,10})-([0-9]{1,20})-([0-9a-f]{16})-"
    + ORIGIN_RE
    + "$"
)
_NO_BOOT = "0" * 16
# Every name the transport creates in a scope directory (what the last
# connector to close removes): the stamp, rings, producers' registrations,
# per-key segments and their lock files, files being built.
_OWN_NAME_RE = re.compile(
    r"^(stamp|ring-[0-9a-f-]+|member-[0-9a-f-]+|[0-9a-f]{32}\.(seg|lock|rdm)"
    r"|\.tmp-[0-9a-zA-Z.-]+)$"
)
# A fallback scope, ``<scope>~<16 hex>``: its directory is ``<scope>``'s plus
# ``-<16 hex>`` (see ScopeDir), so it is found from its name alone.
_FALLBACK_RE = re.compile(r"(.*)~([0-9a-f]{16})\Z", re.DOTALL)


class HostTransportError(RuntimeError):
    """The transport cannot work in this environment."""


class ScopeMissingError(HostTransportError):
    """The scope's directory does not exist, and the connector was asked to
    join an existing scope only (``create_scope=False``)."""


class ScopeSquattedError(HostTransportError):
    """The scope's directory exists but is not this user's private directory
    (another owner, group or other access, a symlink, not a directory):
    another local user may have created it first."""


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


class ProducerId(NamedTuple):
    """Who produced something in a scope: pid and start time (clock ticks
    since boot) as seen in the producer's own PID namespace, that
    namespace's inode and a tag of its boot (:func:`.boot_tag`; zeros when
    unknown). Rings, registrations, segment headers and half-written files
    carry it, so whoever looks can tell whether the producer can be checked
    from where it stands (see :meth:`watch`)."""

    pid: int
    start: int
    pid_ns: int
    boot: str

    @property
    def origin(self) -> str:
        """``<pid namespace>-<boot>``, the end of the names it creates."""
        return f"{self.pid_ns:x}-{self.boot}"

    @property
    def token(self) -> str:
        """``<pid>-<start>-<origin>``: the producer, in a file name."""
        return f"{self.pid}-{self.start}-{self.origin}"

    @classmethod
    def parse(cls, pid: str, start: str, pid_ns: str, boot: str) -> ProducerId:
        """From the decimal pid and start and the hex origin of a name."""
        return cls(int(pid), int(start), int(pid_ns, 16), boot)

    def judge(self) -> bool | None:
        """False: proven gone (another boot); None: this process cannot
        tell (another or an unknown PID namespace); True: its pid and start
        time decide."""
        own = _boot_tag()
        same_boot = self.boot == own or _NO_BOOT in (self.boot, own)
        return judge_origin(same_boot, self.pid_ns)

    def watch(self) -> ProcessWatch | None:
        """A watch on this producer, or None when this process cannot tell
        whether it runs: such a producer is never treated as dead here (what
        it left goes by a TTL, or when a process of its namespace looks)."""
        verdict = self.judge()
        if verdict is None:
            return None
        return ProcessWatch(self.pid, self.start, gone=not verdict)

    def alive(self) -> bool:
        """One-shot check (no descriptor kept): False only when the producer
        is proven gone."""
        verdict = self.judge()
        if verdict is None:
            return True
        return verdict and process_start_ticks(self.pid) == self.start


def _boot_tag() -> str:
    return boot_tag() or _NO_BOOT


_self_identity: ProducerId | None = None

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


def self_identity() -> ProducerId:
    """This process's identity; recomputed after a fork."""
    global _self_identity
    pid = os.getpid()
    if _self_identity is None or _self_identity.pid != pid:
        start = process_start_ticks(pid)
        if start is None:
            raise HostTransportError("cannot read /proc/self/stat")
        _self_identity = ProducerId(pid, start, pid_namespace(), _boot_tag())
    return _self_identity


def _open_root(root: str) -> int:
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_scope_dir(root_fd: int, name: str, path: str, create: bool) -> int:
    """Create (mode 0700, with ``create``) or open the directory ``name``
    under ``root_fd`` without following a symlink, and check that it is a
    directory owned by us with no group or other bits. Returns its
    descriptor; :class:`ScopeSquattedError`, naming the owner, when the
    entry there is not such a directory."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=root_fd)
    try:
        return open_private_dir(name, dir_fd=root_fd, error=HostTransportError)
    except FileNotFoundError:
        raise
    except (HostTransportError, OSError):
        squat = _squat(root_fd, name, path)
        if squat is None:
            raise
        raise squat from None


def _squat(root_fd: int, name: str, path: str) -> ScopeSquattedError | None:
    """Why the entry ``name`` is not our private directory, naming its owner,
    or None when it is. Judged on the entry itself: another user's 0700
    directory cannot even be opened (EACCES), a file fails with ENOTDIR."""
    try:
        check_private_entry(name, root_fd, path, error=ScopeSquattedError)
    except ScopeSquattedError as e:
        try:
            uid = os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_uid
        except OSError:
            return e
        return ScopeSquattedError(f"{e} (owner: {owner_name(uid)})")
    except OSError:
        pass
    return None


def _remove_locked(fd: int, root_fd: int, name: str) -> None:
    """Remove everything the transport creates in the scope directory
    ``name`` (open as ``fd``, locked exclusively: no connector is in it),
    then the directory (which fails if anything else is in it)."""
    for entry in os.listdir(fd):
        if _OWN_NAME_RE.match(entry):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=fd)
    os.rmdir(name, dir_fd=root_fd)


def _collect_abandoned(root_fd: int, pattern: re.Pattern[str], keep: str) -> list[str]:
    """Remove the scope directories matching ``pattern`` (but ``keep``) that
    no connector is in any more but that once had one (a stamp): their
    producers were killed (a closing last connector removes its directory).
    A directory without a stamp may be one being created; anything not ours
    is left alone. Returns the names removed."""
    removed = []
    for name in os.listdir(root_fd):
        if name == keep or pattern.match(name) is None:
            continue
        try:
            fd = open_private_dir(name, dir_fd=root_fd, error=HostTransportError)
        except (HostTransportError, OSError):
            continue
        try:
            try:
                os.stat(STAMP_FILE, dir_fd=fd, follow_symlinks=False)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # no stamp, or a connector is in it
                continue
            try:
                _remove_locked(fd, root_fd, name)
                removed.append(name)
            except OSError:
                pass
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return removed


def collect_abandoned_scopes(root: str = "/dev/shm", keep: str = "") -> list[str]:
    """Remove every scope directory of this user under ``root`` that no
    connector is in and that once had one (the producers of such a scope
    were all killed: a clean close of the last connector removes it).
    A scope is named after its deployment's scope string, which a later
    engine need not share (the default derives it from the session id), so
    an engine starting on the node collects them all, whatever namespace
    or scope they belonged to: the lock on the directory is held by every
    connector, whatever its PID namespace. Returns the names removed."""
    pattern = re.compile(rf"vllm-ht-{os.getuid()}-[0-9a-f]{{16}}(-[0-9a-f]{{16}})*\Z")
    root_fd = _open_root(root)
    try:
        return _collect_abandoned(root_fd, pattern, keep)
    finally:
        os.close(root_fd)


class ScopeDir:
    """The per-user, per-deployment directory and its stamp file.

    Every open connector holds a shared ``flock`` on the directory; the one
    that closes last (it gets the lock exclusively) removes the directory and
    everything the transport left in it.

    With ``fallback``, a directory squatted by another user (see
    :class:`ScopeSquattedError`) is replaced by a fresh private one,
    ``<name>-<16 random hex>``, and :attr:`scope` becomes
    ``<scope>~<16 random hex>``, the scope that names it (:attr:`squatted`
    says why)."""

    @staticmethod
    def dir_name(scope: str) -> str:
        """The directory's name under the root (scope names are untrusted:
        only their hash is used, plus the random part of a fallback)."""
        suffixes = []
        while (m := _FALLBACK_RE.match(scope)) is not None:
            scope = m.group(1)
            suffixes.append(m.group(2))
        return "-".join([f"vllm-ht-{os.getuid()}-{hex_name(scope)}", *suffixes[::-1]])

    def __init__(
        self, root: str, scope: str, fallback: bool = False, create: bool = True
    ) -> None:
        check_platform()
        self.uid = os.getuid()
        self.root = root
        self.scope = scope
        self.squatted: str | None = None
        self.name = self.dir_name(scope)
        self.path = os.path.join(root, self.name)
        self.fd = -1
        self.stamp_fd = -1
        self._mm: mmap.mmap | None = None
        self.q: memoryview | None = None
        root_fd = _open_root(root)
        try:
            try:
                fd = self._join(root_fd, create=create)
            except ScopeSquattedError as e:
                if not fallback:
                    raise
                self.squatted = str(e)
                fd = self._join_fresh(root_fd)
        finally:
            os.close(root_fd)
        self.fd = fd
        try:
            self._open_stamp()
        except BaseException:
            self.close(teardown=False)
            raise

    def _join(self, root_fd: int, create: bool) -> int:
        """Open the directory and take a shared lock on it (membership)."""
        deadline = time.monotonic() + _JOIN_WAIT_S
        while True:
            try:
                fd = _open_scope_dir(root_fd, self.name, self.path, create)
            except FileNotFoundError:
                # Removed between our mkdir and open by a last closer.
                if not create:
                    raise ScopeMissingError(f"{self.path} does not exist") from None
                if time.monotonic() > deadline:
                    raise HostTransportError(f"{self.path} vanished") from None
                continue
            # Busy only while a last closer removes the directory.
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
                return fd
            os.close(fd)  # removed meanwhile: create it again
            if not create:
                raise ScopeMissingError(f"{self.path} was removed")

    def _join_fresh(self, root_fd: int) -> int:
        """Join a new private directory instead of the squatted one."""
        base = self.name
        name = make_fresh_private_dir(
            root_fd, base, self.root, error=HostTransportError
        )
        self.scope = f"{self.scope}~{name[len(base) + 1 :]}"
        self.name = name
        self.path = os.path.join(self.root, name)
        # Never created again under this name if it goes: a name seen in
        # the root's listing is no longer unpredictable.
        fd = self._join(root_fd, create=False)
        with contextlib.suppress(OSError):
            _collect_abandoned(
                root_fd, re.compile(re.escape(base) + r"-[0-9a-f]{16}\Z"), keep=name
            )
        return fd

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
            root_fd = _open_root(self.root)
            try:
                _remove_locked(fd, root_fd, self.name)
            finally:
                os.close(root_fd)
        finally:
            # Released explicitly: a forked child may still hold a copy of
            # this descriptor (the same open file, so the same lock).
            fcntl.flock(fd, fcntl.LOCK_UN)
