# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Safe file handling for the same-node stores under ``/dev/shm``.

Shared by the artifact store and the host transport. Every directory and
file is opened relative to a directory descriptor, never through a symlink,
and checked to be owned by this process's effective user with no
group/other access (directories 0700, files 0600). Names passed here are
always names the caller derived itself (hex digests, fixed names), never
strings from a request.

Each helper takes the exception class to raise on a failed check, so that
callers surface their own typed error.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable, Sequence

SHM_BASE = "/dev/shm"

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_IOV_MAX = 1024


class UnsafePathError(RuntimeError):
    """A path failed a safety check (owner, mode, symlink, type)."""


def check_owned(
    st: os.stat_result,
    what: str,
    *,
    directory: bool,
    error: type[Exception] = UnsafePathError,
) -> None:
    """Raise ``error`` unless ``st`` is a directory (or regular file) owned
    by this process's effective uid with no group/other permission bits."""
    uid = os.geteuid()
    if directory and not stat.S_ISDIR(st.st_mode):
        raise error(f"{what} is not a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise error(f"{what} is not a regular file")
    if st.st_uid != uid:
        raise error(
            f"{what} is owned by uid {st.st_uid}, not by this process's uid "
            f"{uid}; refusing to use it"
        )
    if st.st_mode & 0o077:
        raise error(
            f"{what} has mode {stat.S_IMODE(st.st_mode):o}; group/other access "
            "is not allowed"
        )


def is_symlink(name: str, dir_fd: int | None = None) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISLNK(st.st_mode)


def open_private_dir(
    path: str,
    *,
    dir_fd: int | None = None,
    error: type[Exception] = UnsafePathError,
) -> int:
    """Open a directory we own (0700) without following a final symlink.
    Raises ``error`` for a symlink or a failed check, ``OSError`` (e.g.
    ``FileNotFoundError``) when it cannot be opened."""
    try:
        fd = os.open(
            path, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as e:
        if is_symlink(path, dir_fd):
            raise error(f"{path!r} is a symlink; refusing it") from e
        raise
    try:
        check_owned(os.fstat(fd), f"directory {path!r}", directory=True, error=error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_file(
    name: str,
    dir_fd: int,
    flags: int,
    what: str,
    *,
    error: type[Exception] = UnsafePathError,
) -> int:
    """Open (or create, mode 0600, with ``O_CREAT`` in ``flags``) a regular
    file we own inside ``dir_fd`` without following a symlink."""
    try:
        fd = os.open(name, flags | O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if is_symlink(name, dir_fd):
            raise error(f"{what} is a symlink; refusing it") from e
        raise
    try:
        check_owned(os.fstat(fd), what, directory=False, error=error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def shm_subdir(root: str, *, error: type[Exception] = UnsafePathError) -> str:
    """Canonical form of ``root``, which must be an absolute path strictly
    under ``/dev/shm`` that passes through no symlink below ``/dev/shm``."""
    if not isinstance(root, str) or not root or "\x00" in root:
        raise error(f"invalid shared-memory directory {root!r}")
    if not os.path.isabs(root):
        raise error(f"{root!r} must be an absolute path under {SHM_BASE}")
    base = os.path.realpath(SHM_BASE)
    rel = os.path.relpath(os.path.normpath(root), SHM_BASE)
    real = os.path.realpath(root)
    if (
        rel == "."
        or rel.startswith("..")
        or real != os.path.join(base, rel)
        or os.path.commonpath([base, real]) != base
    ):
        raise error(
            f"{root!r} (resolves to {real!r}) is not a directory under "
            f"{SHM_BASE} reached without symlinks; choose e.g. "
            f"{SHM_BASE}/vllm-artifacts-{os.geteuid()}"
        )
    return real


def _walk_private_shm_dir(
    root: str,
    error: type[Exception],
    visit: Callable[[str, int, str], bool],
) -> bool:
    """Walk ``root``'s components under ``/dev/shm`` by directory fd (no
    symlink is ever followed): ``visit(name, parent_fd, path)`` first, which
    returns False to stop (the walk then returns False), then the component
    is opened as a private directory (ours, no group/other access)."""
    real = shm_subdir(root, error=error)
    base = os.path.realpath(SHM_BASE)
    parent_fd = os.open(base, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    try:
        path = base
        for part in os.path.relpath(real, base).split(os.sep):
            path = os.path.join(path, part)
            if not visit(part, parent_fd, path):
                return False
            fd = open_private_dir(part, dir_fd=parent_fd, error=error)
            os.close(parent_fd)
            parent_fd = fd
    finally:
        os.close(parent_fd)
    return True


def ensure_private_shm_dir(
    root: str, *, error: type[Exception] = UnsafePathError
) -> str:
    """Create ``root`` under ``/dev/shm`` (each missing component 0700) and
    check every component on the way (created or already there): a
    directory, not a symlink, owned by us, no group/other access. Returns
    the canonical path."""

    def make(part: str, parent_fd: int, path: str) -> bool:
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o700, dir_fd=parent_fd)
        return True

    _walk_private_shm_dir(root, error, make)
    return shm_subdir(root, error=error)


def check_private_shm_dir(
    root: str, *, error: type[Exception] = UnsafePathError
) -> bool:
    """Check ``root`` under ``/dev/shm`` as :func:`ensure_private_shm_dir`
    would, creating nothing: every component that exists must be a
    directory, not a symlink, owned by us, with no group/other access.
    Returns whether ``root`` exists."""

    def check(part: str, parent_fd: int, path: str) -> bool:
        try:
            check_private_entry(part, parent_fd, path, error=error)
        except FileNotFoundError:
            return False
        return True

    return _walk_private_shm_dir(root, error, check)


def check_private_entry(
    name: str, dir_fd: int, path: str, *, error: type[Exception] = UnsafePathError
) -> None:
    """Raise ``error`` unless the entry ``name`` of ``dir_fd`` (``path``, for
    the message) is a directory we own with no group/other access and not a
    symlink. Checked on the entry itself, not opened: a directory of another
    user may not be openable at all. ``FileNotFoundError`` if it is absent."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path!r} is a symlink; refusing it")
    check_owned(st, f"directory {path!r}", directory=True, error=error)


def owner_name(uid: int) -> str:
    """``uid N (login)`` for messages that name who owns a path."""
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def make_private_shm_dir(
    prefix: str, *, error: type[Exception] = UnsafePathError, attempts: int = 8
) -> str:
    """Create a new directory ``<prefix>-<16 random hex>`` (0700) in the
    existing parent of ``prefix`` under ``/dev/shm``; never an existing one,
    so nobody else can have prepared it. Returns its canonical path."""
    # The parent's canonical form; ``prefix`` itself may be anything (the
    # fresh directory replaces what is there).
    parent, stem = os.path.split(os.path.normpath(prefix))
    if not stem or stem in (".", ".."):
        raise error(f"invalid shared-memory directory {prefix!r}")
    if os.path.normpath(parent) == SHM_BASE:
        parent = os.path.realpath(SHM_BASE)
    else:
        parent = shm_subdir(parent, error=error)
    parent_fd = os.open(parent, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
    try:
        name = make_fresh_private_dir(
            parent_fd, stem, parent, error=error, attempts=attempts
        )
    finally:
        os.close(parent_fd)
    return os.path.join(parent, name)


def make_fresh_private_dir(
    parent_fd: int,
    stem: str,
    parent: str,
    *,
    error: type[Exception] = UnsafePathError,
    attempts: int = 8,
) -> str:
    """Create a new directory ``<stem>-<16 random hex>`` (0700) in
    ``parent_fd`` (``parent``, for the message) and return its name. Never
    an existing one, so nobody else can have prepared it; the random part
    makes its name unpredictable to other users."""
    for _ in range(attempts):
        name = f"{stem}-{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            continue
        os.close(open_private_dir(name, dir_fd=parent_fd, error=error))
        return name
    raise error(
        f"could not create a fresh directory {os.path.join(parent, stem)}-<random>"
    )


def write_all(
    fd: int, bufs: Sequence[bytes | bytearray | memoryview], offset: int
) -> int:
    """``pwritev`` all of ``bufs`` at ``offset`` (retrying short writes);
    returns the number of bytes written."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = 0
    i = 0
    while i < len(views):
        chunk = views[i : i + _IOV_MAX]
        n = os.pwritev(fd, chunk, offset + total)
        total += n
        # Skip what was written (a short write leaves part of a view).
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return total
