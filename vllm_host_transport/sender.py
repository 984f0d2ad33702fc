# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sending side of a host-transport connector: publishing a payload
under (edge, key) on the edge's host ring or in a per-key segment,
withdrawing earlier unclaimed versions, spilling aged ring frames to
segments when the ring is full, and keeping what waits bounded: at most
``MAX_TRACKED_KEYS`` unclaimed keys (the oldest is withdrawn beyond it),
and nothing left behind by ``close``. State is guarded by its own
process-local lock, so a thread receiving is never queued behind a sending
one."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_host_transport import perkey
from vllm_host_transport import ring as ringmod
from vllm_host_transport import shared as _pid
from vllm_host_transport.codec import FrameCodec
from vllm_host_transport.discovery import HostTransportError, ScopeDir
from vllm_host_transport.frame import EncodedFrame, PayloadTooLarge, RawFrame
from vllm_host_transport.liveness import member_name
from vllm_host_transport.shared import Shared
from vllm_host_transport.shared import edge_hex as _edge_hex
from vllm_host_transport.shared import key_hash as _key_hash
from vllm_host_transport.shared import seg_name as _seg_name

# A child of vLLM's "vllm" logger (a name only: nothing is imported), so in a
# vLLM process these lines go where vLLM's own go.
#: How often a producer refreshes its registration's mtime at most (see
#: ``Sender._heartbeat``).
HEARTBEAT_S = 60.0

# A put that failed for want of room in the file system.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

logger = logging.getLogger("vllm.host_transport.sender")

#: Most keys with a payload no receiver is known to have taken; past it the
#: oldest is withdrawn (``health()["evicted"]``).
MAX_TRACKED_KEYS = 1 << 16
_BUSY = object()  # a retire found its lock busy
# A frame of ``size`` bytes takes (size + _FRAME_ROUND) & _FRAME_MASK ring
# bytes (record header included, 64-byte aligned).
_FRAME_ROUND = ringmod.FRAME_HDR + ringmod.FRAME_ALIGN - 1
_FRAME_MASK = ~(ringmod.FRAME_ALIGN - 1)
_DESC_VERSION = 1


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
class _Placement:
    """Where this process published an unclaimed version of a key."""

    edge: tuple[Any, Any]
    key_hash: bytes
    seg_name: str  # empty for ring placements
    ring_pos: int | None  # None: per-key segment


class Sender:
    """See the module docs."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        config = self._config = shared.config
        self._stats = shared.stats
        self._lock = threading.Lock()
        self._edges: dict[tuple[Any, Any], _SendEdge] = {}
        # Insertion-ordered: the oldest tracked key is evicted first.
        self._placements: dict[str, list[_Placement]] = {}
        self._logged_edges: set[str] = set()
        # Tells this connector's rings apart from other connectors' of the
        # same process (the ring name is its registration).
        self._instance = int.from_bytes(os.urandom(8), "little")
        # Registration in the scope (see .liveness), made before the first
        # payload.
        self._member: str | None = None
        self._heartbeat_at = 0.0
        self._codec = FrameCodec(config.max_payload_bytes, config.large_leaf_bytes)
        self._ring_enabled = config.ring_enabled and ringmod.FENCE_AVAILABLE
        self._ring_wait_s = config.ring_wait_s
        self._spill_age_s = config.ring_spill_age_s
        self._max_payload = config.max_payload_bytes
        self._no_space_logged = False

    def put(
        self, from_stage: Any, to_stage: Any, key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """See :meth:`HostTransportConnector.put`."""
        try:
            with self._lock:
                return self._put_locked(from_stage, to_stage, key, data)
        except PayloadTooLarge as e:
            logger.warning("host transport: put %r rejected: %s", key, e)
        except OSError as e:
            if e.errno not in _NO_SPACE:
                logger.exception("host transport: put %r failed", key)
            else:
                # An expected condition on a shared node, not a bug: said
                # once per connector (the caller reports each failure).
                self._stats["put_no_space"] += 1
                if not self._no_space_logged:
                    self._no_space_logged = True
                    logger.warning(
                        "host transport: put %r failed: /dev/shm is full (%s); "
                        "further puts that find it full fail without a log "
                        "line (counted in health()['put_no_space'])",
                        key,
                        e.strerror,
                    )
        except Exception:
            logger.exception("host transport: put %r failed", key)
        self._stats["put_failures"] += 1
        return False, 0, None

    def _put_locked(
        self, from_stage: Any, to_stage: Any, key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        shared = self._shared
        scope = shared.scope
        if shared.closed or scope is None or shared.owner_pid != _pid.this_pid:
            scope = shared.check_open()  # raises
        if type(key) is not str and not isinstance(key, str):
            raise TypeError("key must be a str")
        if self._member is None:
            self._register(scope)
        elif time.monotonic() - self._heartbeat_at >= HEARTBEAT_S:
            self._heartbeat(scope)
        edge_key = (from_stage, to_stage)
        edge = self._edges.get(edge_key)
        if edge is None:
            edge = _SendEdge(_edge_hex(from_stage, to_stage))
            self._edges[edge_key] = edge
        codec = self._codec
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
        # The oldest is withdrawn, not just forgotten: an untracked payload
        # would never be removed while the scope stays open.
        if len(placements) > MAX_TRACKED_KEYS and self._cleanup_locked(
            scope, next(iter(placements))
        ):
            stats["evicted"] += 1
        return True, size, desc

    def _register(self, scope: ScopeDir) -> None:
        name = member_name(self._shared.ident, self._instance)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(name, flags, 0o600, dir_fd=scope.fd))
        self._member = name
        self._heartbeat_at = time.monotonic()
        # Receivers re-list the scope's producers; if the stamp cannot move
        # now, they find this one at its next move.
        with contextlib.suppress(OSError, HostTransportError):
            scope.advance_stamp()

    def _heartbeat(self, scope: ScopeDir) -> None:
        """Refresh the registration's mtime: how a process of another PID
        namespace, which cannot check this one, tells it still runs (see
        ``HostTransportConfig.foreign_producer_ttl_s``)."""
        self._heartbeat_at = time.monotonic()
        if self._member is not None:
            try:
                os.utime(self._member, dir_fd=scope.fd, follow_symlinks=False)
            except FileNotFoundError:
                # Taken for gone by a process that could not check (idle
                # past its TTL): registered again, so it is seen to run.
                with contextlib.suppress(OSError):
                    self._register(scope)
            except OSError:
                pass

    def ensure_registered(self) -> None:
        """Register this producer in the scope before its first read-many
        object (as before a first payload), or refresh a minute-old
        registration: what tells a looker whose leftovers they are."""
        with self._lock:
            scope = self._shared.check_open()
            if self._member is None:
                self._register(scope)
            elif time.monotonic() - self._heartbeat_at >= HEARTBEAT_S:
                self._heartbeat(scope)

    def heartbeat(self) -> None:
        """Refresh the registration if the last refresh is a minute old."""
        if time.monotonic() - self._heartbeat_at < HEARTBEAT_S:
            return
        with self._lock:
            scope = self._shared.scope
            if scope is not None and os.getpid() == self._shared.owner_pid:
                self._heartbeat(scope)

    def _write_segment(
        self,
        scope: ScopeDir,
        seg_name: str,
        kh: bytes,
        frame: EncodedFrame | RawFrame,
    ) -> None:
        ok = perkey.write_segment(scope.fd, seg_name, kh, frame, self._shared.ident)
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
                ring.end_spill(pos, moved=True)
                self._stats["retired"] += 1
            else:
                seg_name = _seg_name(edge.edge_hex, key)
                try:
                    self._write_segment(scope, seg_name, kh, raw)
                except BaseException:
                    ring.end_spill(pos, moved=False)  # still deliverable here
                    raise
                ring.end_spill(pos, moved=True)
                for p in self._placements.get(key, ()):
                    if p.ring_pos == pos and self._edges.get(p.edge) is edge:
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
                self._config.host_ring_bytes,
                self._shared.ident.pid,
                self._shared.ident.start,
                self._instance,
                self._shared.ident.origin,
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
            edge = self._edges.get(p.edge)
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
        """See :meth:`HostTransportConnector.cleanup`."""
        with self._lock:
            scope = self._shared.scope
            if scope is None or os.getpid() != self._shared.owner_pid:
                return False
            return self._cleanup_locked(scope, key)

    def _cleanup_locked(self, scope: ScopeDir, key: str) -> bool:
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

    def taken(self) -> list[str]:
        """See :meth:`HostTransportConnector.taken`."""
        with self._lock:
            scope = self._shared.scope
            if scope is None or os.getpid() != self._shared.owner_pid:
                return []
            names: set[str] | None = None
            gone = []
            for key, placements in self._placements.items():
                for p in placements:
                    if p.ring_pos is not None:
                        edge = self._edges.get(p.edge)
                        ring = edge.ring if edge is not None else None
                        if ring is not None and ring.unclaimed(p.ring_pos):
                            break
                    else:
                        if names is None:  # one listing, not a stat per key
                            names = set(os.listdir(scope.fd))
                        if p.seg_name + ".seg" in names:
                            break
                else:
                    gone.append(key)
            for key in gone:
                del self._placements[key]
            return gone

    def _supersede_busy(self, p: _Placement) -> bool:
        """A placement whose lock stayed busy: a ring frame gets a tombstone
        (receivers skip it) and a deferred retire; a segment is being taken by
        a receiver right now."""
        if p.ring_pos is None:
            return False
        edge = self._edges.get(p.edge)
        if edge is None or edge.ring is None:
            return False
        edge.pending.append(p)
        self._stats["retire_deferred"] += 1
        if edge.ring.tombstone(p.key_hash):
            self._stats["tombstones"] += 1
            return True
        return False

    def cleanup_prefix(self, prefix: str) -> int:
        """See :meth:`HostTransportConnector.cleanup_prefix`."""
        pattern = re.compile(re.escape(prefix) + r"[0-9]+")
        with self._lock:
            keys = [k for k in self._placements if pattern.fullmatch(k)]
        return sum(1 for k in keys if self.cleanup(k))

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Withdraw every payload of this side that no receiver took (the
        segments; the rings are unlinked with theirs) and its registration
        (the owner process): what a connector published does not outlive
        it, whoever else keeps the scope open."""
        with self._lock:
            scope = self._shared.scope
            if scope is not None:
                for placements in self._placements.values():
                    for p in placements:
                        if p.ring_pos is None:
                            with contextlib.suppress(OSError):
                                perkey.remove_segment(scope.fd, p.seg_name)
            self._placements.clear()
            changed = False
            for edge in self._edges.values():
                if edge.ring is not None:
                    edge.ring.close(unlink=True)
                    edge.ring = None
                    changed = True
            self._edges.clear()
            member, self._member = self._member, None
            if member is not None and scope is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(member, dir_fd=scope.fd)
                changed = True
            if changed and scope is not None:
                with contextlib.suppress(Exception):
                    scope.advance_stamp()

    def drop_mappings(self) -> None:
        """A forked child's copies only: nothing shared is touched, and the
        lock is not taken (a parent thread may have held it at the fork)."""
        for edge in self._edges.values():
            if edge.ring is not None:
                edge.ring.close(unlink=False, mark_closed=False)
                edge.ring = None
        self._edges = {}

    def health(self, out: dict[str, Any]) -> None:
        out["rings_owned"] = sum(1 for e in self._edges.values() if e.ring is not None)
        with self._lock:
            rings = [e.ring for e in self._edges.values() if e.ring is not None]
            now = time.monotonic()
            if self._shared.owner_pid == _pid.this_pid:
                for ring in rings:
                    ring.reclaim()
            out["ring_bytes_in_use"] = sum(ring.used_bytes() for ring in rings)
            # Age of the oldest frame no receiver has taken yet (0: none).
            out["oldest_unclaimed_age_s"] = max(
                (ring.oldest_age(now) for ring in rings), default=0.0
            )
            out["pending_retires"] = sum(len(e.pending) for e in self._edges.values())
