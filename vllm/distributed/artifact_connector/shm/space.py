# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Free space under a store: ``/dev/shm`` is shared (by the stores of every
engine on the node, their references, vLLM's own segments, other software),
so it can be full while this store is within its capacity.

The writer treats the file system's free space as a second capacity: when
growing fails with ``ENOSPC`` (or ``EDQUOT``) it gives back its own room,
exactly as capacity eviction does (``ShmStoreWriter._give_back_space``:
its index log compacted where that halves it, else its oldest unretained
arena evicted), and tries again. The log counts: with small objects (a
tiny model's routes) its 64-byte records are a third of the arenas' bytes,
and a log left to grow to its ordinary compaction point fills a tight
file system by itself. An eviction appends its records to the
index log before it unlinks the arena, so the log keeps pages reserved
ahead of its end (:func:`reserve_log`, ``fallocate`` with
``FALLOC_FL_KEEP_SIZE``: the file's size, which readers go by, does not
change): the records of one eviction always find room, even when another
process took the last free page.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Callable
from typing import TypeVar

from vllm.config.artifact_sizing import (
    MAX_ARENA_BYTES,
    MIN_ARENA_BYTES,
)
from vllm.distributed.artifact_connector.store import StoreCapacityError
from vllm.logger import init_logger

logger = init_logger(__name__)
_T = TypeVar("_T")

#: ``errno`` values that mean the file system (not the store) is full.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

_PAGE = mmap.PAGESIZE


def page_end(n: int) -> int:
    """``n`` rounded up to a whole page (what tmpfs allocates)."""
    return (n + _PAGE - 1) // _PAGE * _PAGE


def log_reserve_bytes(arena_bytes: int) -> int:
    """Bytes the index log of a store with arenas of ``arena_bytes`` keeps
    allocated beyond its end (counted in its capacity): an arena's eighth,
    4 to 64 KiB. At least half of it stays free after every ordinary
    append, so that an eviction's records (one ``RETIRE``, plus a ``MOVE``
    per retained object it relocates: 64 bytes each) fit without
    allocating."""
    return min(64 << 10, max(4 << 10, arena_bytes // 8))


_FALLOC_FL_KEEP_SIZE = 1


def no_space(e: BaseException) -> bool:
    """Whether ``e`` (an error of the store, or its cause) is a full file
    system."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in NO_SPACE:
            return True
        cause = cause.__cause__
    return False


def when_full(
    op: Callable[[], _T],
    give_back: Callable[[], bool],
    counts: dict[str, int],
    root: str,
) -> _T:
    """Run ``op`` (a step that grows a store's files); while it fails
    because the file system is full, give back room (``give_back``: compact
    the store's index log or evict its oldest arena, counting what it did;
    False when neither can be done) and run it again. The first time is
    logged."""
    while True:
        try:
            return op()
        except StoreCapacityError as e:
            if not no_space(e):
                raise
            first = not (counts["space_evictions"] or counts["space_compactions"])
            if not give_back():
                raise StoreCapacityError(
                    f"{e}. The file system under {root} is full and this store "
                    "has nothing left to evict (running requests hold what it "
                    "keeps): give /dev/shm more room, or size the stores of the "
                    "engines that share it (engines_per_node or "
                    "$VLLM_ENGINES_PER_NODE, or a lower capacity_bytes)"
                ) from e
        if first:
            logger.warning(
                "artifact store under %s: the file system is full; evicting "
                "this engine's oldest routes to make room (the engines on this "
                "node together may use more than it holds: see engines_per_node "
                "in the user guide)",
                root,
            )


def free_bytes(root: str) -> int:
    """Free bytes under ``root`` (a huge number when that cannot be told)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def keep_headroom(root: str, need: int, give_back: Callable[[], bool]) -> None:
    """Before a store takes ``need`` bytes less one arena of the file system,
    give back its own room (``give_back``, see :func:`when_full`) while less
    than ``need`` is free: a store never takes the last arena of room the
    engines of the node share, so the room one of them frees stays there
    for it. Stops when giving back frees nothing (a reader still maps the
    arena or holds the replaced log; its next read lets go of it) or
    nothing can be given back."""
    free = free_bytes(root)
    while free < need and give_back():
        after = free_bytes(root)
        if after <= free:
            return
        free = after


def _load_fallocate():
    with contextlib.suppress(OSError, AttributeError):
        fn = ctypes.CDLL(None, use_errno=True).fallocate
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int
        return fn
    return None


_fallocate = _load_fallocate()


def reserve_log(fd: int, offset: int, length: int) -> bool:
    """Allocate ``length`` bytes of ``fd`` from ``offset`` without changing
    its size. Returns False where that cannot be done (no ``fallocate`` in
    the C library, a file system without ``FALLOC_FL_KEEP_SIZE``): appends
    then allocate as they go. Raises ``OSError`` (``ENOSPC``) when the file
    system is full."""
    if _fallocate is None:
        return False
    if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def check_room(root: str, arena_bytes: int) -> None:
    """Refuse to start where the file system cannot hold the two arenas the
    store needs at once (a container's default 64 MiB ``/dev/shm`` and a
    large capacity): every request would fail otherwise."""
    need = 2 * arena_bytes
    try:
        st = os.statvfs(root)
    except OSError as e:
        raise StoreCapacityError(f"checking the free space under {root}: {e}") from e
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return
    with contextlib.suppress(OSError):
        os.rmdir(root)  # only if this writer just created it, empty
    raise StoreCapacityError(
        f"{root} has {free / (1 << 20):.1f} MiB free; the routed-experts "
        f"store needs at least {need / (1 << 20):.1f} MiB to start (an active "
        f"and a spare arena of {arena_bytes / (1 << 20):.1f} MiB). Give "
        "/dev/shm more room (e.g. `docker run --shm-size=16g`, or a larger "
        "memory-backed /dev/shm volume), or lower --artifact-config "
        f"capacity_bytes (arenas are capacity/16, from {MIN_ARENA_BYTES >> 10} "
        f"KiB to {MAX_ARENA_BYTES >> 20} MiB), or tell the engine how many engines "
        "share /dev/shm (engines_per_node, or $VLLM_ENGINES_PER_NODE) and let "
        "it size the store."
    )
