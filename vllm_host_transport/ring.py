# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host ring: one bounded shared-memory ring per (producer connector, edge).

The layout and protocol, the memory fence, and the producer's side
(:class:`ProducerRing`); a receiver's side is :mod:`.ring_view`.

Layout of the ring file (``ring-<edge>-<pid>-<start>-<instance>-<origin>`` in
the scope dir, the origin being the producer's PID namespace and boot)::

    [header 4096 B][data: capacity bytes]

Header, as u64 slots (each hot field on its own cache line)::

    q[0]  magic            q[1] version      q[2] capacity
    q[3]  producer pid     q[4] start time   q[5..6] edge id (16 hex chars)
    q[7]  connector instance id (random, part of the file name)
    q[8]  head   (absolute byte position after the last published frame)
    q[16] tail   (absolute position before which every frame is finished)
    q[24] closed (1 once the producer has retired the ring)

Positions are absolute and only grow; a frame lives at ``pos % capacity``.
Every frame is 64-byte aligned and starts with a 32-byte record::

    u32 length | u8 state | 3 B pad | u64 absolute position | 16 B key hash

followed by a tensor frame (see :mod:`.frame`). A frame never wraps: when it
does not fit before the end of the data area the producer writes a ``PAD``
record up to the end and continues at offset 0.

States: ``WRITING`` (0) while the producer copies, ``READY`` (1) once the
frame is complete, ``DONE`` (2) once a receiver took it, ``RETIRED`` (3) when
the producer withdrew it (a 64-byte record in this state with no frame is a
*tombstone*), ``PAD`` (4), ``SPILLING`` (5) while the producer moves it to
a per-key segment (a claim is "try again": it is in neither place). Only the
producer moves ``head`` and ``tail``;
receivers only flip a ``READY`` byte, under the ring lock (an ``flock`` on the
ring file, always taken non-blocking by receivers). The latest record of a key
in a ring decides: a receiver never takes a ``READY`` frame of a key that a
later record of the same ring supersedes.

Memory ordering (see docs/design/host_transport.md): four fences, placed by
:func:`memory_fence`, order the plain stores and loads on shared memory on any
CPU: producer frame bytes -> fence -> ``head``; receiver ``head`` -> fence ->
frame bytes; receiver copy -> fence -> ``DONE``; producer ``DONE`` -> fence ->
reuse of the slot.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import platform
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_host_transport.frame import EncodedFrame, RawFrame

RING_MAGIC = 0x31474E4952544856  # "VHTRING1"
RING_VERSION = 3  # 3: the SPILLING state
HEADER_SIZE = 4096
Q_MAGIC, Q_VERSION, Q_CAP, Q_PID, Q_START, Q_EDGE, Q_INST = 0, 1, 2, 3, 4, 5, 7
Q_HEAD = 8
Q_TAIL = 16
Q_CLOSED = 24

FRAME = struct.Struct("<IB3xQ16s")
FRAME_HDR = 32
FRAME_ALIGN = 64
STATE_OFF = 4
_NO_KEY = bytes(16)

WRITING, READY, DONE, RETIRED, PAD, SPILLING = 0, 1, 2, 3, 4, 5

# Results of a claim that are not a payload.
BUSY = object()  # ring lock held elsewhere; try again
GONE = object()  # not there (claimed, retired, overwritten)
CORRUPT = object()  # frame failed validation; counted and consumed
DEAD = object()  # producer exited or was restarted

# Results of ProducerRing.retire.
RETIRED_NOW = 1  # it was READY and is withdrawn
NOT_READY = 0  # already taken or withdrawn: nothing to do
LOCK_BUSY = -1  # the ring lock stayed busy: the frame may still be READY


# Map rings with their page tables filled in: otherwise the first pass over a
# fresh ring takes a minor fault per 4 KiB page in the producer and again in
# every receiver, on the hot path of each put and get.
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

_SEQ_CST = 5  # __ATOMIC_SEQ_CST
_TSO_MACHINES = frozenset({"x86_64", "amd64"})


def _tso_fence() -> None:
    """x86-64 keeps stores in order with stores and loads with loads and with
    later stores (TSO); the ring's four orderings are all of those kinds, so
    the CPU needs no fence instruction. A real fence (libatomic, through
    ctypes) measured 250-284 ns per call on the benchmark machine, about
    0.7 us per message for the three a message takes (docs/benchmarks.md)."""


def select_fence(machine: str) -> Callable[[], None] | None:
    """The memory fence for CPU ``machine``; ``None`` when none is available
    (the connector then keeps the ring off and says so at start-up)."""
    if machine.lower() in _TSO_MACHINES:
        return _tso_fence
    try:
        lib = ctypes.CDLL("libatomic.so.1")
        fence = lib.atomic_thread_fence  # C11 atomic_thread_fence(memory_order)
    except (OSError, AttributeError):
        return None
    fence.restype = None
    fence.argtypes = [ctypes.c_int]
    return functools.partial(fence, _SEQ_CST)


_selected_fence = select_fence(platform.machine())
#: True when the ring can be used on this CPU (see :func:`select_fence`).
FENCE_AVAILABLE = _selected_fence is not None
#: A full memory fence between plain accesses to shared memory. Where none is
#: available no ring is created or attached, so it is never called.
memory_fence: Callable[[], None] = (
    _selected_fence if _selected_fence is not None else _tso_fence
)


def edge_words(edge_hex: str) -> tuple[int, int]:
    b = bytes.fromhex(edge_hex)
    return int.from_bytes(b[:4], "little"), int.from_bytes(b[4:8], "little")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return False
        raise
    return True


def _lock_within(fd: int, wait_s: float) -> bool:
    """Try the ring lock until ``wait_s`` has passed (producer side only)."""
    if _try_lock(fd):
        return True
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.0002)
        if _try_lock(fd):
            return True
    return False


class ProducerRing:
    """The producer's side of one ring. Only the producer writes frames and
    moves ``head``/``tail``; it owns and finally unlinks the file."""

    def __init__(
        self,
        dir_fd: int,
        edge_hex: str,
        capacity: int,
        pid: int,
        start: int,
        instance: int,
        origin: str,
    ) -> None:
        self.dir_fd = dir_fd
        self.capacity = capacity
        self.name = f"ring-{edge_hex}-{pid}-{start}-{instance:016x}-{origin}"
        self.fd = -1
        self._mm: mmap.mmap | None = None
        self._mv: memoryview | None = None
        self._q: memoryview | None = None
        # Keeps an export of the mapping so its address stays valid; dropped
        # before the mapping is closed.
        self._anchor: Any = None
        self._data_addr = 0
        self.head = 0
        self.tail = 0
        # (position, key, publication time) of every frame from ``tail`` on,
        # oldest first: the age of the oldest unclaimed frame and the key to
        # spill it under.
        self.frames: deque[tuple[int, str, float]] = deque()
        # Set when a put found the ring full: the tail then and the size that
        # did not fit. While the oldest frame is still unclaimed, a put of at
        # least that size fails at once without walking the ring.
        self._full_tail = -1
        self._full_need = 0
        # The tail at which a bounded wait for space last ran out: no new wait
        # until the oldest frame moves (a wedged ring costs one wait, not one
        # per put).
        self.wait_failed_tail = -1
        self.registered = False
        tmp = f".tmp-{self.name}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            size = HEADER_SIZE + capacity
            # Reserve the pages now: a full /dev/shm fails here with ENOSPC
            # instead of a SIGBUS on first touch.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        self.fd = fd
        self._mm = mm
        self._mv = memoryview(mm)
        self._anchor = ctypes.c_char.from_buffer(mm)
        self._data_addr = ctypes.addressof(self._anchor) + HEADER_SIZE
        q = self._mv[:HEADER_SIZE].cast("Q")
        self._q = q
        e0, e1 = edge_words(edge_hex)
        q[Q_VERSION] = RING_VERSION
        q[Q_CAP] = capacity
        q[Q_PID] = pid
        q[Q_START] = start
        q[Q_EDGE] = e0
        q[Q_EDGE + 1] = e1
        q[Q_INST] = instance
        q[Q_HEAD] = 0
        q[Q_TAIL] = 0
        q[Q_MAGIC] = RING_MAGIC  # last: the header is complete
        try:
            # Publication: the final name is the registration marker. (The
            # rename and the receivers' directory listing are ordered by the
            # kernel, so the header is visible to whoever finds the name.)
            os.rename(tmp, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            self.close(unlink=False, mark_closed=False)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        self.registered = True

    # ----------------------------------------------------------------- write
    def _reserve(self, need: int) -> tuple[int, int] | None:
        """Room for a record of ``need`` bytes: its absolute position and its
        offset in the data area (a PAD record is written when it would not
        fit before the end), or ``None`` when the ring is full."""
        mv = self._mv
        assert mv is not None
        cap = self.capacity
        tail = self.tail
        if tail == self._full_tail and need >= self._full_need:
            state = mv[HEADER_SIZE + tail % cap + STATE_OFF]
            if state in (READY, WRITING):
                return None  # still full: the oldest frame is unclaimed
        head = self.head
        off = head % cap
        pad = cap - off if off + need > cap else 0
        if head + pad + need - tail > cap:
            self.reclaim()
            if head + pad + need - self.tail > cap:
                self._full_tail = self.tail
                self._full_need = need
                return None
        if pad:
            FRAME.pack_into(mv, HEADER_SIZE + off, pad, PAD, head, _NO_KEY)
            head += pad
            off = 0
        return head, off

    def _publish(self, new_head: int) -> None:
        # Everything written for the new records (their bytes, PAD records,
        # state bytes) is visible before the new head is.
        memory_fence()
        self.head = new_head
        q = self._q
        assert q is not None
        q[Q_HEAD] = new_head  # publication point

    def try_put(self, key_hash: bytes, frame: EncodedFrame, key: str) -> int | None:
        """Copy ``frame`` into the ring; the absolute position, or ``None``
        when the ring is full. The caller keeps frames larger than a quarter
        of the ring away."""
        mv = self._mv
        q = self._q
        if mv is None or q is None:
            return None
        need = (frame.total + (FRAME_HDR + FRAME_ALIGN - 1)) & ~(FRAME_ALIGN - 1)
        # The common case (room right at the head) inline, without the
        # _reserve/_publish calls: about 0.2 us of a 7 us put
        # (docs/benchmarks.md, issue 11).
        pos = self.head
        cap = self.capacity
        off = pos % cap
        if off + need > cap or pos + need - self.tail > cap:
            room = self._reserve(need)
            if room is None:
                return None
            pos, off = room
        base = HEADER_SIZE + off
        FRAME.pack_into(mv, base, need, WRITING, pos, key_hash)
        frame.write_into(
            mv[base + FRAME_HDR : base + need],
            self._data_addr + off + FRAME_HDR,
        )
        mv[base + STATE_OFF] = READY
        memory_fence()  # the frame before the head that publishes it
        self.head = pos + need
        q[Q_HEAD] = pos + need
        self.frames.append((pos, key, time.monotonic()))
        return pos

    def tombstone(self, key_hash: bytes) -> bool:
        """Publish a record that supersedes every earlier frame of the key in
        this ring (used when such a frame could not be retired). False when
        the ring has no room for it."""
        mv = self._mv
        if mv is None:
            return False
        room = self._reserve(FRAME_ALIGN)
        if room is None:
            return False
        pos, off = room
        FRAME.pack_into(mv, HEADER_SIZE + off, FRAME_ALIGN, RETIRED, pos, key_hash)
        self._publish(pos + FRAME_ALIGN)
        return True

    def reclaim(self) -> None:
        """Advance ``tail`` over finished records (DONE, RETIRED, PAD)."""
        mv = self._mv
        q = self._q
        if mv is None or q is None:
            return
        cap = self.capacity
        tail = self.tail
        while tail < self.head:
            off = tail % cap
            length, state, pos, _ = FRAME.unpack_from(mv, HEADER_SIZE + off)
            if pos != tail or length < FRAME_HDR or off + length > cap:
                break  # cannot happen unless the file was tampered with
            if state in (DONE, RETIRED, PAD):
                tail += length
            else:
                break
        if tail != self.tail:
            # The receivers' copies of these frames (made before they stored
            # DONE) are complete before the slots are written again.
            memory_fence()
            self.tail = tail
            q[Q_TAIL] = tail
            frames = self.frames
            while frames and frames[0][0] < tail:
                frames.popleft()

    def retire(self, pos: int, key_hash: bytes, wait_s: float = 0.05) -> int:
        """Withdraw the READY frame at ``pos``: RETIRED_NOW, NOT_READY (taken
        or withdrawn already) or LOCK_BUSY (the ring lock stayed busy for
        ``wait_s``; the frame may still be READY)."""
        mv = self._mv
        if mv is None or pos < self.tail or pos >= self.head:
            return NOT_READY
        off = HEADER_SIZE + pos % self.capacity
        if mv[off + STATE_OFF] != READY:
            return NOT_READY  # already taken: no lock needed
        if not _lock_within(self.fd, wait_s):
            return LOCK_BUSY
        try:
            _, state, fpos, kh = FRAME.unpack_from(mv, off)
            if fpos != pos or state != READY or kh != key_hash:
                return NOT_READY
            mv[off + STATE_OFF] = RETIRED
            return RETIRED_NOW
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def take_oldest(self, wait_s: float) -> tuple[int, str, bytes, RawFrame] | None:
        """Mark the oldest unclaimed frame SPILLING and return its position,
        key, key hash and bytes (to republish them elsewhere; then
        :meth:`end_spill`), or ``None`` when it is not READY any more or the
        ring lock stayed busy."""
        mv = self._mv
        if mv is None or not self.frames:
            return None
        pos, key, _ = self.frames[0]
        if pos < self.tail or pos >= self.head:
            return None
        off = HEADER_SIZE + pos % self.capacity
        if not _lock_within(self.fd, wait_s):
            return None
        try:
            length, state, fpos, kh = FRAME.unpack_from(mv, off)
            if fpos != pos or state != READY:
                return None
            data = bytes(mv[off + FRAME_HDR : off + length])
            mv[off + STATE_OFF] = SPILLING
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        return pos, key, kh, RawFrame(data)

    def end_spill(self, pos: int, moved: bool) -> None:
        """The frame :meth:`take_oldest` returned is now in a per-key segment
        (``moved``: RETIRED) or stays here (READY again). No lock: receivers
        never write a frame that is not READY."""
        mv = self._mv
        if mv is not None:
            memory_fence()  # the segment is published before RETIRED says so
            mv[HEADER_SIZE + pos % self.capacity + STATE_OFF] = (
                RETIRED if moved else READY
            )

    def unclaimed(self, pos: int) -> bool:
        """Whether the frame at ``pos`` is still waiting for a receiver."""
        mv = self._mv
        if mv is None or not self.tail <= pos < self.head:
            return False
        return mv[HEADER_SIZE + pos % self.capacity + STATE_OFF] in (READY, SPILLING)

    def oldest_age(self, now: float) -> float:
        """Seconds since the oldest frame not yet reclaimed was published."""
        frames = self.frames
        return now - frames[0][2] if frames else 0.0

    def used_bytes(self) -> int:
        return self.head - self.tail

    def close(self, unlink: bool = True, mark_closed: bool = True) -> None:
        """Drop the mapping. The owner also marks the ring closed and unlinks
        it; any other process (a forked child) only drops its mappings."""
        q = self._q
        if q is not None and mark_closed:
            q[Q_CLOSED] = 1
        if unlink and self.registered:
            self.registered = False
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.dir_fd)
        for attr in ("_q", "_mv"):
            v = getattr(self, attr)
            setattr(self, attr, None)
            if v is not None:
                v.release()
        self._anchor = None
        self._data_addr = 0
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
