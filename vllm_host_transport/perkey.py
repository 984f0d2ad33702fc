# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-key segments: the portable data plane.

Each payload is one file ``<h>.seg`` in the scope directory plus a lock file
``<h>.lock``, where ``<h>`` is a hash of (edge, key). A segment file is::

    [segment header 64 B: magic | producer pid | producer start | key hash
                          | producer pid namespace | producer boot tag]
    [tensor frame, see .frame]

The writer takes the lock exclusively, writes a temporary file and renames it
over ``<h>.seg`` (which retires an unclaimed earlier version). A reader only
tries the lock without blocking, probes the size with ``fstat`` (nothing is
mapped before it knows the object exists and is whole), maps it, copies the
payload into owned memory and unlinks both files to claim it. A missing
object is a quiet ``None``.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from typing import Any

from vllm_host_transport.discovery import ProducerId
from vllm_host_transport.frame import (
    CorruptFrame,
    EncodedFrame,
    RawFrame,
    write_frame_to_fd,
)

SEG_MAGIC = b"VHTSEG01"
SEG_HEADER = struct.Struct("<8sQQ16sQ8s")
SEG_HEADER_SIZE = 64

MISSING = object()  # nothing there (or gone)
BUSY = object()  # lock held by another process
CORRUPT = object()  # counted, consumed
DEAD = object()  # producer gone; segment removed


def _flags(extra: int = 0) -> int:
    return os.O_NOFOLLOW | os.O_CLOEXEC | extra


def _lock_matches(dir_fd: int, name: str, fd: int) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_ino == os.fstat(fd).st_ino


def _lock_path(dir_fd: int, lock_name: str, wait_s: float) -> int | None:
    """Open/create the lock file and lock it exclusively, making sure the
    locked inode is still the one at ``lock_name`` (a reader may unlink it)."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(lock_name, _flags(os.O_RDWR | os.O_CREAT), 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.0002)
            continue
        if _lock_matches(dir_fd, lock_name, fd):
            return fd
        os.close(fd)


def write_segment(
    dir_fd: int,
    name: str,
    key_hash: bytes,
    frame: EncodedFrame | RawFrame,
    producer: ProducerId,
    lock_wait_s: float = 1.0,
) -> bool:
    """Publish ``frame`` as segment ``name``; False if the lock stayed busy."""
    lock_name = name + ".lock"
    lfd = _lock_path(dir_fd, lock_name, lock_wait_s)
    if lfd is None:
        return False
    tmp = f".tmp-{name}-{producer.token}"
    try:
        fd = os.open(
            tmp, _flags(os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 0o600, dir_fd=dir_fd
        )
        try:
            hdr = SEG_HEADER.pack(
                SEG_MAGIC,
                producer.pid,
                producer.start,
                key_hash,
                producer.pid_ns,
                bytes.fromhex(producer.boot),
            )
            os.write(fd, hdr + bytes(SEG_HEADER_SIZE - len(hdr)))
            write_frame_to_fd(fd, frame)
        finally:
            os.close(fd)
        os.rename(tmp, name + ".seg", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        fcntl.flock(lfd, fcntl.LOCK_UN)
        os.close(lfd)


def claim_segment(
    dir_fd: int, name: str, key_hash: bytes, codec: Any, borrow: bool = False
) -> Any:
    """Try to take segment ``name``: the owned payload, or MISSING, BUSY,
    CORRUPT, DEAD. Never blocks on a lock. With ``borrow``, the segment is
    mapped privately (copy on write) and the payload's large numpy arrays
    are views of that mapping instead of copies: once claimed the segment
    is unlinked, so nothing else reaches those pages, and they are freed
    when the arrays are."""
    lock_name = name + ".lock"
    try:
        lfd = os.open(lock_name, _flags(os.O_RDWR), dir_fd=dir_fd)
    except FileNotFoundError:
        return MISSING
    try:
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return BUSY
        if not _lock_matches(dir_fd, lock_name, lfd):
            return BUSY
        seg_name = name + ".seg"
        try:
            fd = os.open(seg_name, _flags(os.O_RDONLY), dir_fd=dir_fd)
        except FileNotFoundError:
            # A lock without a segment (a writer died before publishing):
            # we hold it, so remove it; writers re-check the inode.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_name, dir_fd=dir_fd)
            return MISSING
        try:
            size = os.fstat(fd).st_size  # probe before attaching anything
            result: Any
            if size <= SEG_HEADER_SIZE:
                result = CORRUPT
            elif borrow:
                mm = mmap.mmap(
                    fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
                )
                mv = memoryview(mm)
                try:
                    result = _decode_segment(mv, key_hash, codec, borrow=True)
                finally:
                    # The arrays returned keep the mapping (exports): it goes
                    # with them.
                    with contextlib.suppress(BufferError):
                        mv.release()
            else:
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
                    mv = memoryview(mm)
                    try:
                        result = _decode_segment(mv, key_hash, codec)
                    finally:
                        mv.release()
        finally:
            os.close(fd)
        # Claim (or discard): unlink the segment, then its lock file.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(seg_name, dir_fd=dir_fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_name, dir_fd=dir_fd)
        return result
    finally:
        os.close(lfd)


def _decode_segment(
    mv: memoryview, key_hash: bytes, codec: Any, borrow: bool = False
) -> Any:
    magic, pid, start, kh, pid_ns, boot = SEG_HEADER.unpack_from(mv)
    if magic != SEG_MAGIC or kh != key_hash:
        return CORRUPT
    # Only a producer proven gone is DEAD: one of another PID namespace (a
    # container sharing /dev/shm) cannot be checked from here and is alive.
    if not ProducerId(pid, start, pid_ns, boot.hex()).alive():
        return DEAD
    sub = mv[SEG_HEADER_SIZE:]
    try:
        return codec.decode(sub, borrow=borrow)
    except CorruptFrame:
        return CORRUPT
    finally:
        with contextlib.suppress(BufferError):
            sub.release()


def segment_producer(dir_fd: int, seg_file: str) -> ProducerId | None:
    """The producer of segment file ``seg_file`` (from its header), or None
    when it cannot be read."""
    try:
        fd = os.open(seg_file, _flags(os.O_RDONLY), dir_fd=dir_fd)
    except OSError:
        return None
    try:
        hdr = os.pread(fd, SEG_HEADER.size, 0)
    finally:
        os.close(fd)
    if len(hdr) < SEG_HEADER.size:
        return None
    magic, pid, start, _, pid_ns, boot = SEG_HEADER.unpack(hdr)
    if magic != SEG_MAGIC:
        return None
    return ProducerId(pid, start, pid_ns, boot.hex())


def remove_segment(dir_fd: int, name: str, lock_wait_s: float = 0.05) -> Any:
    """Retire an unclaimed segment: True if one was there, False if not, BUSY
    if its lock stayed busy (a receiver is taking it)."""
    lock_name = name + ".lock"
    try:
        os.stat(lock_name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    lfd = _lock_path(dir_fd, lock_name, lock_wait_s)
    if lfd is None:
        return BUSY
    try:
        try:
            os.unlink(name + ".seg", dir_fd=dir_fd)
            found = True
        except FileNotFoundError:
            found = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_name, dir_fd=dir_fd)
        return found
    finally:
        fcntl.flock(lfd, fcntl.LOCK_UN)
        os.close(lfd)
