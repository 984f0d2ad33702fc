# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A receiver's side of one producer's host ring (:mod:`.ring` describes the
layout, the states and the memory ordering): the mapping, a private index
of the frames published, and the claim."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from typing import Any

from vllm_host_transport import ring
from vllm_host_transport.frame import CorruptFrame
from vllm_host_transport.ring import (
    BUSY,
    CORRUPT,
    DONE,
    FRAME,
    FRAME_ALIGN,
    FRAME_HDR,
    GONE,
    HEADER_SIZE,
    PAD,
    Q_CAP,
    Q_CLOSED,
    Q_EDGE,
    Q_HEAD,
    Q_INST,
    Q_MAGIC,
    Q_PID,
    Q_START,
    Q_TAIL,
    Q_VERSION,
    READY,
    RING_MAGIC,
    RING_VERSION,
    SPILLING,
    STATE_OFF,
    edge_words,
)

_flock = fcntl.flock
_LOCK_EX_NB = fcntl.LOCK_EX | fcntl.LOCK_NB
_LOCK_UN = fcntl.LOCK_UN


class RingView:
    """A receiver's mapping of one producer's ring, with a private index of
    the READY frames it has seen (key hash -> absolute position)."""

    def __init__(
        self,
        dir_fd: int,
        name: str,
        edge_hex: str,
        pid: int,
        start: int,
        instance: int,
    ) -> None:
        self.name = name
        self.pid = pid
        self.start = start
        self.fd = -1
        self._mm: mmap.mmap | None = None
        self.mv: memoryview | None = None
        self.q: memoryview | None = None
        self.cursor = 0
        self.index: dict[bytes, int] = {}
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size <= HEADER_SIZE:
                raise CorruptFrame(f"ring {name} has a bad owner or size")
            mm = mmap.mmap(fd, st.st_size, flags=ring.MAP_FLAGS)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._mm = mm
        self.mv = memoryview(mm)
        self.q = self.mv[:HEADER_SIZE].cast("Q")
        q = self.q
        e0, e1 = edge_words(edge_hex)
        if (
            q[Q_MAGIC] != RING_MAGIC
            or q[Q_VERSION] != RING_VERSION
            or q[Q_CAP] != st.st_size - HEADER_SIZE
            or q[Q_CAP] % FRAME_ALIGN
            or q[Q_PID] != pid
            or q[Q_START] != start
            or q[Q_EDGE] != e0
            or q[Q_EDGE + 1] != e1
            or q[Q_INST] != instance
        ):
            self.close()
            raise CorruptFrame(f"ring {name} has an invalid header")
        self.capacity = int(q[Q_CAP])
        self.cursor = int(q[Q_TAIL])

    @property
    def closed(self) -> bool:
        q = self.q
        return q is None or q[Q_CLOSED] != 0

    def scan(self) -> int:
        """Index records published since the last scan; returns the number of
        corrupt records met (the scan skips to ``head`` after one)."""
        q, mv = self.q, self.mv
        if q is None or mv is None:
            return 0
        head = q[Q_HEAD]
        cur = self.cursor
        if head == cur:
            return 0
        # The records below this head are complete before they are read.
        ring.memory_fence()
        tail = q[Q_TAIL]
        if cur < tail:
            cur = tail
            if self.index:
                self.index = {k: p for k, p in self.index.items() if p >= tail}
        cap = self.capacity
        corrupt = 0
        index = self.index
        while cur < head:
            off = cur % cap
            length, state, pos, kh = FRAME.unpack_from(mv, HEADER_SIZE + off)
            if (
                pos != cur
                or length < FRAME_HDR
                or length % FRAME_ALIGN
                or off + length > cap
            ):
                new_tail = q[Q_TAIL]
                if new_tail > cur:  # we lagged and the slot was reused
                    cur = new_tail
                    continue
                corrupt += 1
                cur = head
                break
            if state in (READY, SPILLING):
                index[kh] = pos
            elif state != PAD:
                # A later record of the key (taken, withdrawn, tombstone)
                # supersedes any earlier READY frame of it.
                index.pop(kh, None)
            cur += length
        self.cursor = cur
        return corrupt

    def claim(self, pos: int, key_hash: bytes, codec: Any) -> Any:
        """Take the READY frame at ``pos`` for ``key_hash`` (a position this
        view indexed). Returns the owned payload or one of BUSY, GONE,
        CORRUPT."""
        mv = self.mv
        q = self.q
        if mv is None or q is None:
            return GONE
        cap = self.capacity
        rel = pos % cap
        off = HEADER_SIZE + rel
        # Unlocked pre-check: a frame already taken (or overwritten) is GONE
        # without touching the lock. The decisive check is repeated below.
        state = mv[off + STATE_OFF]
        if state != READY:
            return BUSY if state == SPILLING else GONE
        fd = self.fd
        try:
            _flock(fd, _LOCK_EX_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return BUSY
            raise
        try:
            length, state, fpos, kh = FRAME.unpack_from(mv, off)
            if fpos != pos or kh != key_hash:
                return GONE
            if state != READY:
                return BUSY if state == SPILLING else GONE
            if length < FRAME_HDR or rel + length > cap or pos + length > q[Q_HEAD]:
                obj: Any = CORRUPT
            else:
                sub = mv[off + FRAME_HDR : off + length]
                try:
                    obj = codec.decode(sub)
                except CorruptFrame:
                    obj = CORRUPT
                try:  # noqa: SIM105 (contextlib.suppress costs ~1 us per claim)
                    sub.release()
                except BufferError:
                    pass
            # The copy out of the slot is complete before DONE lets the
            # producer reuse it.
            ring.memory_fence()
            mv[off + STATE_OFF] = DONE
            return obj
        finally:
            _flock(fd, _LOCK_UN)

    def close(self) -> None:
        for attr in ("q", "mv"):
            v = getattr(self, attr)
            setattr(self, attr, None)
            if v is not None:
                v.release()
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.index = {}
