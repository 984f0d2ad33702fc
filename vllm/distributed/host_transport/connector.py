# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host-transport connector: same-node payload hand-off by key.

Two data planes share one wire format (:mod:`.codec`):

* the host ring (:mod:`.ring`), one per (producer process, edge), allocated on
  the first put of that edge, for frames up to a quarter of its capacity;
* per-key segments (:mod:`.perkey`) for everything else: large frames, a full
  ring, a disabled ring (``host_ring_bytes=0``) or a ring that failed to set up.

Sender and receiver state are guarded by two separate process-local locks, so
a thread receiving is never queued behind a thread of the same process that is
sending (or waiting for a ring lock while sending).

A connector belongs to the process that created it: in a forked child it only
drops its mappings when closed or collected (it never marks, unlinks or
removes anything of its parent's), and ``put``/``get`` there fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.host_transport import perkey
from vllm.distributed.host_transport import ring as ringmod
from vllm.distributed.host_transport.codec import (
    EncodedFrame,
    FrameCodec,
    PayloadTooLarge,
    RawFrame,
)
from vllm.distributed.host_transport.config import SCOPE_ENV, HostTransportConfig
from vllm.distributed.host_transport.discovery import (
    RING_NAME_RE,
    HostTransportError,
    ScopeDir,
    check_platform,
    hex_name,
    self_identity,
)
from vllm.distributed.process_identity import ProcessWatch

logger = logging.getLogger(__name__)

# This process's pid, kept current in forked children, so the hot paths can
# tell a connector inherited through a fork without a system call.
_this_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _this_pid
    _this_pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)

_MAX_TRACKED_KEYS = 1 << 16
_BUSY = object()  # a retire found its lock busy
# A frame of ``size`` bytes takes (size + _FRAME_ROUND) & _FRAME_MASK ring
# bytes (record header included, 64-byte aligned).
_FRAME_ROUND = ringmod.FRAME_HDR + ringmod.FRAME_ALIGN - 1
_FRAME_MASK = ~(ringmod.FRAME_ALIGN - 1)
_MAX_MISSED = 4096
_DESC_VERSION = 1


def _edge_hex(from_stage: Any, to_stage: Any) -> str:
    return hex_name("edge", repr(from_stage), repr(to_stage))


_blake2b = hashlib.blake2b


def _key_hash(key: str) -> bytes:
    """The 16-byte key hash stored in ring records and segment headers."""
    return _blake2b(key.encode(), digest_size=16).digest()


def _seg_name(edge_hex: str, key: str) -> str:
    """Name of the per-key segment of (edge, key): a hash, never built from
    the key itself. Only computed when the per-key plane is used."""
    return _blake2b(
        edge_hex.encode() + b"\0" + key.encode(), digest_size=16, person=b"vhtseg"
    ).hexdigest()


@dataclass
class _SendEdge:
    edge_hex: str
    ring: ringmod.ProducerRing | None = None
    ring_failed: bool = False
    # Earlier versions on the ring whose retire found the ring lock busy:
    # superseded (receivers skip them) but still holding ring space; retried
    # on later puts of the edge.
    pending: list[_Placement] = field(default_factory=list)


@dataclass
class _RecvRing:
    view: ringmod.RingView
    liveness: ProcessWatch


@dataclass
class _RecvEdge:
    edge_hex: str
    seen_stamp: int = -1
    rings: list[_RecvRing] = field(default_factory=list)
    # key -> per-key token observed when that key was last missed.
    missed: OrderedDict[str, int] = field(default_factory=OrderedDict)
    # The last key polled and its hash: a receiver polls one key many times.
    last_key: str | None = None
    last_kh: bytes = b""


@dataclass
class _Placement:
    """Where this process published an unclaimed version of a key."""

    edge: tuple[Any, Any]
    key_hash: bytes
    seg_name: str  # empty for ring placements
    ring_pos: int | None  # None: per-key segment


class HostTransportConnector:
    """Hands payloads between processes of one node by (edge, key).

    ``put`` copies the payload before it returns; ``get`` returns an owned
    object (nothing refers to shared memory). One publisher per key; when
    several receivers compete for a key, exactly one gets it.
    """

    def __init__(self, config: HostTransportConfig | None = None) -> None:
        # Fields close() relies on come first, so close() is safe whatever
        # the constructor got to.
        self._closed = False
        self._scope: ScopeDir | None = None
        self._send_edges: dict[tuple[Any, Any], _SendEdge] = {}
        self._recv_edges: dict[tuple[Any, Any], _RecvEdge] = {}
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        # The process that owns the rings and the scope membership.
        self._owner_pid = os.getpid()
        check_platform()
        self.config = config if config is not None else HostTransportConfig()
        self.scope_name = self.config.resolved_scope()
        if self.config.scope is None and not os.environ.get(SCOPE_ENV):
            logger.info(
                "host transport: scope %r derived from this login session; a "
                "process of another session (e.g. a trainer launched "
                "separately) must set %s=%s or HostTransportConfig(scope=...) "
                "to reach it",
                self.scope_name,
                SCOPE_ENV,
                self.scope_name,
            )
        self._scope = ScopeDir(self.config.shm_root, self.scope_name)
        self._pid, self._start = self_identity()
        # Tells this connector's rings apart from other connectors' of the
        # same process (the ring name is its registration).
        self._instance = int.from_bytes(os.urandom(8), "little")
        self._send_codec = FrameCodec(
            self.config.max_payload_bytes, self.config.large_leaf_bytes
        )
        self._recv_codec = FrameCodec(
            self.config.max_payload_bytes,
            self.config.large_leaf_bytes,
            self.config.allowed_struct_types,
        )
        self._ring_enabled = self.config.ring_enabled and ringmod.FENCE_AVAILABLE
        self._attach_rings = ringmod.FENCE_AVAILABLE
        if not ringmod.FENCE_AVAILABLE:
            logger.warning(
                "host transport: no memory fence on this CPU (%s; libatomic.so.1 "
                "not found): the host ring is off, payloads use per-key "
                "segments, and rings of other producers are not read (run "
                "them with host_ring_bytes=0 too)",
                ringmod.platform.machine(),
            )
        self._ring_wait_s = self.config.ring_wait_s
        self._spill_age_s = self.config.ring_spill_age_s
        self._max_payload = self.config.max_payload_bytes
        # Insertion-ordered: the oldest tracked key is evicted first.
        self._placements: dict[str, list[_Placement]] = {}
        self._logged_edges: set[str] = set()
        self._stats = {
            "ring_puts": 0,
            "ring_gets": 0,
            "fallbacks": 0,
            "fallback_too_large": 0,
            "fallback_ring_full": 0,
            "fallback_ring_unavailable": 0,
            "perkey_puts": 0,
            "perkey_gets": 0,
            "put_failures": 0,
            "corrupt_frames": 0,
            "dead_producer_frames": 0,
            "dead_producers_pruned": 0,
            "serializer_fallbacks": 0,
            "discovery_scans": 0,
            "rings_attached": 0,
            "rings_released": 0,
            "retired": 0,
            "retire_deferred": 0,
            "tombstones": 0,
            "ring_waits": 0,
            "ring_wait_timeouts": 0,
            "ring_spilled": 0,
        }

    # ------------------------------------------------------------ lifecycle
    @property
    def scope_dir(self) -> str:
        if self._scope is None:
            raise HostTransportError("connector is closed")
        return self._scope.path

    def close(self) -> None:
        """Release everything; unlinks this connector's rings, and the scope
        directory when it is the last connector of the scope. Idempotent. In
        a forked child it only drops the child's mappings."""
        if getattr(self, "_closed", True) and getattr(self, "_scope", None) is None:
            return
        self._closed = True
        if os.getpid() != self._owner_pid:
            self._drop_mappings()
            return
        with self._send_lock:
            had_ring = False
            for edge in self._send_edges.values():
                if edge.ring is not None:
                    edge.ring.close(unlink=True)
                    edge.ring = None
                    had_ring = True
            self._send_edges.clear()
            if had_ring and self._scope is not None:
                with contextlib.suppress(Exception):
                    self._scope.advance_stamp()
        with self._recv_lock:
            for redge in self._recv_edges.values():
                for r in redge.rings:
                    r.view.close()
                    r.liveness.close()
                redge.rings.clear()
            self._recv_edges.clear()
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.close(teardown=True)

    def _drop_mappings(self) -> None:
        """Close this process's copies of the mappings and descriptors (a
        forked child): nothing shared is written, unlinked or locked, and the
        process-local locks are not taken (a parent thread may have held one
        at the fork)."""
        for edge in self._send_edges.values():
            if edge.ring is not None:
                edge.ring.close(unlink=False, mark_closed=False)
                edge.ring = None
        self._send_edges = {}
        for redge in self._recv_edges.values():
            for r in redge.rings:
                r.view.close()
                r.liveness.close()
        self._recv_edges = {}
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.close(teardown=False)

    def __enter__(self) -> HostTransportConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # No contextlib here: module globals may be gone at interpreter exit.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    def _check_open(self) -> ScopeDir:
        scope = self._scope
        if self._closed or scope is None:
            raise HostTransportError("connector is closed")
        if self._owner_pid != _this_pid:
            raise HostTransportError(
                f"connector belongs to process {self._owner_pid}; a forked "
                "child must create its own"
            )
        return scope

    # ------------------------------------------------------------------ put
    def put(
        self, from_stage: Any, to_stage: Any, key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Publish ``data`` under ``key`` on edge ``from_stage -> to_stage``.

        Returns ``(ok, size, descriptor)``; failures are ``(False, 0, None)``.
        The payload is fully copied when this returns.
        """
        try:
            with self._send_lock:
                return self._put_locked(from_stage, to_stage, key, data)
        except PayloadTooLarge as e:
            logger.warning("host transport: put %r rejected: %s", key, e)
        except Exception:
            logger.exception("host transport: put %r failed", key)
        self._stats["put_failures"] += 1
        return False, 0, None

    def _put_locked(
        self, from_stage: Any, to_stage: Any, key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        scope = self._scope
        if self._closed or scope is None or self._owner_pid != _this_pid:
            scope = self._check_open()  # raises
        if type(key) is not str and not isinstance(key, str):
            raise TypeError("key must be a str")
        edge_key = (from_stage, to_stage)
        edge = self._send_edges.get(edge_key)
        if edge is None:
            edge = _SendEdge(_edge_hex(from_stage, to_stage))
            self._send_edges[edge_key] = edge
        codec = self._send_codec
        before = codec.serial_fallbacks
        frame = codec.encode(data)
        stats = self._stats
        if codec.serial_fallbacks != before:
            stats["serializer_fallbacks"] += 1
        size = frame.total
        if size > self._max_payload:
            raise PayloadTooLarge(f"payload of {size} bytes is too large")
        kh = _key_hash(key)
        if edge.pending:
            self._retry_pending(edge)
        placements = self._placements
        previous = placements.pop(key, None)
        # Withdraw the earlier unclaimed versions on this edge before the new
        # one is visible. A ring frame whose retire finds the ring lock busy
        # stays READY: the new version must then be a later record of the same
        # ring (a receiver takes a key's latest record), or a tombstone there
        # must supersede it. A busy segment lock means a receiver is taking
        # that segment now; the new version then replaces it in place.
        stuck_ring = stuck_segment = False
        rest: list[_Placement] = []
        if previous:
            for p in previous:
                if p.edge != edge_key:
                    rest.append(p)
                elif self._retire(scope, p) is _BUSY:
                    if p.ring_pos is None:
                        stuck_segment = True
                    else:
                        stuck_ring = True
                        edge.pending.append(p)
                        stats["retire_deferred"] += 1

        pos: int | None = None
        ring: ringmod.ProducerRing | None = None
        if self._ring_enabled and not stuck_segment:
            ring = edge.ring
            if ring is None:
                ring = self._ensure_ring(scope, edge)
            if ring is None:
                stats["fallbacks"] += 1
                stats["fallback_ring_unavailable"] += 1
            elif (size + _FRAME_ROUND) & _FRAME_MASK > ring.capacity >> 2:
                stats["fallbacks"] += 1
                stats["fallback_too_large"] += 1
            else:
                pos = ring.try_put(kh, frame, key)
                if pos is None:
                    pos = self._make_room(scope, edge, ring, kh, frame, key)
                if pos is None:
                    stats["fallbacks"] += 1
                    stats["fallback_ring_full"] += 1
        if pos is None and stuck_ring:
            assert edge.ring is not None  # a stuck frame lives on this ring
            if not edge.ring.tombstone(kh):
                placements[key] = previous or []
                raise HostTransportError(
                    "the earlier version could not be withdrawn (ring lock busy, "
                    "ring full); the new one was not published"
                )
            stats["tombstones"] += 1

        seg_name = ""
        if pos is not None:
            stats["ring_puts"] += 1
            desc = {
                "v": _DESC_VERSION,
                "plane": "ring",
                "ring": ring.name if ring is not None else "",
                "pos": pos,
                "size": size,
            }
        else:
            seg_name = _seg_name(edge.edge_hex, key)
            self._write_segment(scope, seg_name, kh, frame)
            stats["perkey_puts"] += 1
            desc = {"v": _DESC_VERSION, "plane": "key", "size": size}
        rest.append(_Placement(edge_key, kh, seg_name, pos))
        placements[key] = rest
        if len(placements) > _MAX_TRACKED_KEYS:
            del placements[next(iter(placements))]
        return True, size, desc

    def _write_segment(
        self,
        scope: ScopeDir,
        seg_name: str,
        kh: bytes,
        frame: EncodedFrame | RawFrame,
    ) -> None:
        ok = perkey.write_segment(scope.fd, seg_name, kh, frame, self._pid, self._start)
        if not ok:
            raise HostTransportError("segment lock stayed busy")
        scope.bump_pk_token()

    def _make_room(
        self,
        scope: ScopeDir,
        edge: _SendEdge,
        ring: ringmod.ProducerRing,
        kh: bytes,
        frame: EncodedFrame,
        key: str,
    ) -> int | None:
        """The ring is full: move frames older than ``ring_spill_age_s`` to
        per-key segments, then wait up to ``ring_wait_s`` for receivers to
        free space, and put ``frame``. ``None``: still full."""
        if self._spill_aged(scope, edge, ring):
            pos = ring.try_put(kh, frame, key)
            if pos is not None:
                return pos
        wait = self._ring_wait_s
        if wait <= 0 or ring.tail == ring.wait_failed_tail:
            return None
        self._stats["ring_waits"] += 1
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            os.sched_yield()
            ring.reclaim()
            pos = ring.try_put(kh, frame, key)
            if pos is not None:
                return pos
        ring.wait_failed_tail = ring.tail
        self._stats["ring_wait_timeouts"] += 1
        return None

    def _spill_aged(
        self, scope: ScopeDir, edge: _SendEdge, ring: ringmod.ProducerRing
    ) -> bool:
        """Move unclaimed frames older than ``ring_spill_age_s``, oldest
        first, from the (full) ring to per-key segments, where they stay
        deliverable. Returns whether any moved."""
        now = time.monotonic()
        moved = False
        while ring.frames and now - ring.frames[0][2] >= self._spill_age_s:
            taken = ring.take_oldest(wait_s=0.0)
            if taken is None:
                break  # claimed meanwhile (reclaim will free it) or lock busy
            pos, key, kh, raw = taken
            superseded = [p for p in edge.pending if p.ring_pos == pos]
            if superseded:
                # A later version exists: withdrawn for good, not moved.
                edge.pending.remove(superseded[0])
                self._stats["retired"] += 1
            else:
                seg_name = _seg_name(edge.edge_hex, key)
                self._write_segment(scope, seg_name, kh, raw)
                for p in self._placements.get(key, ()):
                    if p.ring_pos == pos and self._send_edges.get(p.edge) is edge:
                        p.ring_pos = None
                        p.seg_name = seg_name
                self._stats["ring_spilled"] += 1
            ring.reclaim()
            moved = True
        return moved

    def _retry_pending(self, edge: _SendEdge) -> None:
        if edge.ring is None:
            edge.pending.clear()
            return
        still = []
        for p in edge.pending:
            assert p.ring_pos is not None
            res = edge.ring.retire(p.ring_pos, p.key_hash, wait_s=0.0)
            if res == ringmod.LOCK_BUSY:
                still.append(p)
            elif res == ringmod.RETIRED_NOW:
                self._stats["retired"] += 1
        if len(still) != len(edge.pending):
            edge.ring.reclaim()
        edge.pending = still

    def _ensure_ring(
        self, scope: ScopeDir, edge: _SendEdge
    ) -> ringmod.ProducerRing | None:
        if edge.ring is not None:
            return edge.ring
        if edge.ring_failed:
            return None
        try:
            ring = ringmod.ProducerRing(
                scope.fd,
                edge.edge_hex,
                self.config.host_ring_bytes,
                self._pid,
                self._start,
                self._instance,
            )
        except OSError as e:
            self._ring_setup_failed(edge, f"ring setup failed: {e}")
            return None
        try:
            scope.advance_stamp()
        except Exception as e:
            ring.close(unlink=True)
            self._ring_setup_failed(edge, f"stamp update failed: {e!r}")
            return None
        edge.ring = ring
        return ring

    def _ring_setup_failed(self, edge: _SendEdge, why: str) -> None:
        edge.ring_failed = True
        if edge.edge_hex not in self._logged_edges:
            self._logged_edges.add(edge.edge_hex)
            logger.warning(
                "host transport: %s; edge %s uses per-key segments",
                why,
                edge.edge_hex,
            )

    def _retire(self, scope: ScopeDir, p: _Placement) -> Any:
        """Withdraw one earlier placement: True if it was still unclaimed,
        False if not, ``_BUSY`` if its lock stayed busy (it may still be
        there)."""
        if p.ring_pos is not None:
            edge = self._send_edges.get(p.edge)
            if edge is None or edge.ring is None:
                return False
            res = edge.ring.retire(p.ring_pos, p.key_hash)
            if res == ringmod.LOCK_BUSY:
                return _BUSY
            if res == ringmod.RETIRED_NOW:
                self._stats["retired"] += 1
                edge.ring.reclaim()
                return True
            return False
        res = perkey.remove_segment(scope.fd, p.seg_name)
        if res is perkey.BUSY:
            return _BUSY
        if res:
            self._stats["retired"] += 1
        return bool(res)

    # -------------------------------------------------------------- cleanup
    def cleanup(self, key: str) -> bool:
        """Retire this process's unclaimed payload for ``key`` (any edge)."""
        with self._send_lock:
            scope = self._scope
            if scope is None or os.getpid() != self._owner_pid:
                return False
            placements = self._placements.pop(key, None)
            if not placements:
                return False
            found = False
            for p in placements:
                res = self._retire(scope, p)
                if res is _BUSY:
                    found = self._supersede_busy(p) or found
                else:
                    found = res or found
            return found

    def _supersede_busy(self, p: _Placement) -> bool:
        """A placement whose lock stayed busy: a ring frame gets a tombstone
        (receivers skip it) and a deferred retire; a segment is being taken by
        a receiver right now."""
        if p.ring_pos is None:
            return False
        edge = self._send_edges.get(p.edge)
        if edge is None or edge.ring is None:
            return False
        edge.pending.append(p)
        self._stats["retire_deferred"] += 1
        if edge.ring.tombstone(p.key_hash):
            self._stats["tombstones"] += 1
            return True
        return False

    def cleanup_prefix(self, prefix: str) -> int:
        """Retire every unclaimed key ``prefix + <digits>``; returns how many."""
        pattern = re.compile(re.escape(prefix) + r"[0-9]+")
        with self._send_lock:
            keys = [k for k in self._placements if pattern.fullmatch(k)]
        return sum(1 for k in keys if self.cleanup(k))

    # ------------------------------------------------------------------ get
    def get(
        self,
        from_stage: Any,
        to_stage: Any,
        key: str,
        descriptor: dict[str, Any] | None = None,
    ) -> tuple[Any, int] | None:
        """Take the payload for ``key``: ``(obj, size)`` or ``None`` when it is
        not there (yet) or gone. Never waits on another process's lock."""
        with self._recv_lock:
            r = self._get_locked(from_stage, to_stage, key, descriptor)
        return None if r is ringmod.BUSY else r

    def get_with_deadline(
        self,
        from_stage: Any,
        to_stage: Any,
        key: str,
        descriptor: dict[str, Any] | None = None,
        deadline: float | None = None,
        poll_interval_s: float = 0.0002,
    ) -> tuple[Any, int] | None:
        """Poll for ``key`` until ``deadline`` (``time.monotonic()`` seconds).

        Locks held by other processes are only ever tried, never waited on,
        so this returns ``None`` once the deadline has passed."""
        while True:
            with self._recv_lock:
                r = self._get_locked(from_stage, to_stage, key, descriptor)
            if r is not None and r is not ringmod.BUSY:
                return r
            if deadline is None or time.monotonic() >= deadline:
                return None
            time.sleep(poll_interval_s)

    def _get_locked(
        self,
        from_stage: Any,
        to_stage: Any,
        key: str,
        descriptor: dict[str, Any] | None,
    ) -> Any:
        scope = self._scope
        if scope is None or scope.q is None or self._owner_pid != _this_pid:
            self._check_open()
            raise HostTransportError("connector is closed")
        edge_key = (from_stage, to_stage)
        edge = self._recv_edges.get(edge_key)
        if edge is None:
            edge = _RecvEdge(_edge_hex(from_stage, to_stage))
            self._recv_edges[edge_key] = edge
        # Fast path: nothing changed since this key was last missed. Reads of
        # mapped memory only: no lock, no directory scan, no system call.
        stamp = scope.q[8]
        token = edge.missed.get(key)
        if (
            token is not None
            and stamp == edge.seen_stamp
            and token == scope.q[16]
            and descriptor is None
        ):
            for r in edge.rings:
                q = r.view.q
                if q is None or q[ringmod.Q_HEAD] != r.view.cursor:
                    break
            else:
                return None

        if stamp != edge.seen_stamp:
            self._discover(scope, edge, stamp)
        if key == edge.last_key:
            kh = edge.last_kh
        else:
            kh = _key_hash(key)
            edge.last_key = key
            edge.last_kh = kh
        busy = False
        rings = edge.rings
        if len(rings) > 1:
            rings = list(rings)  # _claim may drop a ring
            if descriptor is not None and descriptor.get("plane") == "ring":
                # The ring the descriptor names is looked at first. (A ring
                # frame is only ever taken through the index, which knows the
                # key's latest record, so a stale descriptor cannot deliver
                # an old version.)
                name = descriptor.get("ring")
                rings.sort(key=lambda r: r.view.name != name)
        for r in rings:
            view = r.view
            q = view.q
            if q is not None and q[ringmod.Q_HEAD] != view.cursor:
                bad = view.scan()
                if bad:
                    self._stats["corrupt_frames"] += bad
            pos = view.index.get(kh)
            if pos is None:
                continue
            res = self._claim(edge, r, pos, kh)
            if res is ringmod.BUSY:
                busy = True
            elif res is not None:
                edge.missed.pop(key, None)
                return res
        # Per-key plane.
        token_now = scope.q[16]
        seg_name = _seg_name(edge.edge_hex, key)
        res = perkey.claim_segment(scope.fd, seg_name, kh, self._recv_codec)
        if res is perkey.BUSY:
            return ringmod.BUSY
        if res is perkey.CORRUPT:
            self._stats["corrupt_frames"] += 1
        elif res is perkey.DEAD:
            self._stats["dead_producer_frames"] += 1
        elif res is not perkey.MISSING:
            self._stats["perkey_gets"] += 1
            edge.missed.pop(key, None)
            return res, self._recv_codec.last_size
        if busy:
            return ringmod.BUSY
        edge.missed[key] = token_now
        edge.missed.move_to_end(key)
        if len(edge.missed) > _MAX_MISSED:
            edge.missed.popitem(last=False)
        return None

    def _claim(self, edge: _RecvEdge, r: _RecvRing, pos: int, kh: bytes) -> Any:
        view = r.view
        if not r.liveness.alive():
            self._stats["dead_producer_frames"] += 1
            self._drop_ring(edge, r, prune=True)
            return None
        res = view.claim(pos, kh, self._recv_codec)
        if res is ringmod.BUSY:
            return res
        if view.index.get(kh) == pos:
            del view.index[kh]
        if res is ringmod.GONE:
            return None
        if res is ringmod.CORRUPT:
            self._stats["corrupt_frames"] += 1
            return None
        self._stats["ring_gets"] += 1
        return res, self._recv_codec.last_size

    # ------------------------------------------------------------ discovery
    def _discover(self, scope: ScopeDir, edge: _RecvEdge, stamp: int) -> None:
        """Re-read the directory: attach new rings of this edge, release rings
        that were closed, prune registrations of dead producers."""
        self._stats["discovery_scans"] += 1
        prefix = f"ring-{edge.edge_hex}-"
        try:
            names = {n for n in scope.list_rings() if n.startswith(prefix)}
        except OSError:
            return
        if not self._attach_rings:
            names = set()  # no fence on this CPU: rings are not read
        for r in list(edge.rings):
            if r.view.name not in names or r.view.closed:
                self._drop_ring(edge, r, prune=False)
        known = {r.view.name for r in edge.rings}
        for name in names - known:
            m = RING_NAME_RE.match(name)
            if m is None:
                continue
            pid, start, inst = int(m.group(2)), int(m.group(3)), int(m.group(4), 16)
            liveness = ProcessWatch(pid, start)
            if not liveness.alive():
                liveness.close()
                self._stats["dead_producers_pruned"] += 1
                self._prune(scope, name)
                continue
            try:
                view = ringmod.RingView(scope.fd, name, edge.edge_hex, pid, start, inst)
            except (OSError, ValueError):
                liveness.close()
                continue
            edge.rings.append(_RecvRing(view, liveness))
            self._stats["rings_attached"] += 1
        edge.seen_stamp = stamp

    def _drop_ring(self, edge: _RecvEdge, r: _RecvRing, prune: bool) -> None:
        if r in edge.rings:
            edge.rings.remove(r)
        name = r.view.name
        r.view.close()
        r.liveness.close()
        self._stats["rings_released"] += 1
        if prune and self._scope is not None:
            self._prune(self._scope, name)

    def _prune(self, scope: ScopeDir, name: str) -> None:
        """Remove the registration of a producer proven dead (it cannot do it
        any more). Live producers' rings are never touched."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=scope.fd)
        # Only tried (the receive path never waits on another process): if
        # the stamp is busy, other receivers notice the death themselves at
        # their next claim.
        with contextlib.suppress(OSError, HostTransportError):
            scope.advance_stamp(wait=False)

    # --------------------------------------------------------------- health
    def health(self) -> dict[str, Any]:
        """Counters and state (a snapshot)."""
        out: dict[str, Any] = dict(self._stats)
        out["closed"] = self._closed
        out["scope"] = self.scope_name if hasattr(self, "scope_name") else None
        out["host_ring_bytes"] = self.config.host_ring_bytes
        out["rings_owned"] = sum(
            1 for e in self._send_edges.values() if e.ring is not None
        )
        with self._send_lock:
            rings = [e.ring for e in self._send_edges.values() if e.ring is not None]
            now = time.monotonic()
            if self._owner_pid == _this_pid:
                for ring in rings:
                    ring.reclaim()
            out["ring_bytes_in_use"] = sum(ring.used_bytes() for ring in rings)
            # Age of the oldest frame no receiver has taken yet (0: none).
            out["oldest_unclaimed_age_s"] = max(
                (ring.oldest_age(now) for ring in rings), default=0.0
            )
            out["pending_retires"] = sum(
                len(e.pending) for e in self._send_edges.values()
            )
        wanted = out["ring_puts"] + out["fallbacks"]
        # Share of the puts that wanted the ring and went per-key.
        out["fallback_rate"] = out["fallbacks"] / wanted if wanted else 0.0
        out["rings_mapped"] = sum(len(e.rings) for e in self._recv_edges.values())
        return out
