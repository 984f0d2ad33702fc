# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Arena files of a ``/dev/shm`` store: append-only object data.

The writer creates an arena with its full size allocated up front
(``posix_fallocate``: a write through the mapping can then never hit a full
``/dev/shm`` and die of SIGBUS) and maps it without populating it (the
puts that fill it take its page faults, a few pages each).
Readers map arenas read-only. Arenas are never truncated or rewritten: an
evicted arena is unlinked, and a reader that still maps it keeps reading
the bytes its index describes until it sees the ``RETIRE`` record.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

from vllm.distributed.artifact_connector.store import (
    StoreCapacityError,
    StoreIOError,
    UnsafeStoreError,
)
from vllm_host_transport.safe_fs import open_private_file

ALIGN = 64  # objects and batches start on cache-line boundaries


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def arena_name(aid: int) -> str:
    return f"{aid:016x}.arena"


class Arena:
    """One mapped arena. ``arr`` is the mapping as uint8, ``mv`` as a
    memoryview (slicing an ``mmap`` object would copy)."""

    __slots__ = ("aid", "size", "fill", "_mm", "mv", "arr")

    def __init__(self, aid: int, mm: mmap.mmap, size: int) -> None:
        self.aid = aid
        self.size = size
        self.fill = 0  # writer: bytes handed out so far
        self._mm = mm
        self.mv = memoryview(mm)
        self.arr = np.frombuffer(mm, np.uint8)

    @classmethod
    def create(cls, ns_fd: int, aid: int, size: int) -> Arena:
        """Writer: create, allocate and map arena ``aid`` (read-write).
        Raises :class:`StoreCapacityError` if ``/dev/shm`` is full."""
        name = arena_name(aid)
        fd = open_private_file(
            name,
            ns_fd,
            os.O_RDWR | os.O_CREAT | os.O_EXCL,
            "artifact arena",
            error=UnsafeStoreError,
        )
        try:
            # fallocate reserves the pages (a full /dev/shm fails here, not
            # at a later write). No MAP_POPULATE: populating an arena inside
            # mmap() holds the interpreter lock (~2 ms for 4 MiB), which was
            # the step loop's worst stall; the puts take the page faults
            # instead, a few pages each (docs/benchmarks.md, "Publication,
            # rebuilt").
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=ns_fd)
            raise StoreCapacityError(
                f"allocating a {size}-byte artifact arena failed ({e}); "
                "/dev/shm may be full: free space there or lower the "
                "artifact store capacity"
            ) from e
        finally:
            os.close(fd)
        return cls(aid, mm, size)

    @classmethod
    def open_readonly(cls, ns_fd: int, aid: int) -> Arena:
        """Reader: map an existing arena read-only. ``FileNotFoundError``
        when it was evicted meanwhile (the log then says where its objects
        went)."""
        fd = open_private_file(
            arena_name(aid),
            ns_fd,
            os.O_RDONLY,
            "artifact arena",
            error=UnsafeStoreError,
        )
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise StoreIOError(f"artifact arena {aid:016x} is empty")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(aid, mm, size)

    def reserve(self, nbytes: int) -> int | None:
        """Writer: offset of ``nbytes`` of fresh space, ``None`` if full."""
        off = align(self.fill)
        if off + nbytes > self.size:
            return None
        self.fill = off + nbytes
        return off

    def close(self) -> None:
        self.arr = np.zeros(0, np.uint8)
        with contextlib.suppress(BufferError):
            self.mv.release()
        # A view still alive: the mapping goes when it is collected.
        with contextlib.suppress(BufferError):
            self._mm.close()
