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
    FrameCodec,
    PayloadTooLarge,
)
from vllm.distributed.host_transport.config import HostTransportConfig
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

_MAX_TRACKED_KEYS = 1 << 16
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
        check_platform()
        self.config = config if config is not None else HostTransportConfig()
        self.scope_name = self.config.resolved_scope()
        self._scope = ScopeDir(self.config.shm_root, self.scope_name)
        self._pid, self._start = self_identity()
        self._send_codec = FrameCodec(
            self.config.max_payload_bytes, self.config.large_leaf_bytes
        )
        self._recv_codec = FrameCodec(
            self.config.max_payload_bytes, self.config.large_leaf_bytes
        )
        self._ring_enabled = self.config.ring_enabled
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
        }

    # ------------------------------------------------------------ lifecycle
    @property
    def scope_dir(self) -> str:
        if self._scope is None:
            raise HostTransportError("connector is closed")
        return self._scope.path

    def close(self) -> None:
        """Release everything; unlinks this process's rings. Idempotent."""
        if getattr(self, "_closed", True) and getattr(self, "_scope", None) is None:
            return
        self._closed = True
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
            scope.close()

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
        if self._closed or scope is None:
            raise HostTransportError("connector is closed")
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
        placements = self._placements
        previous = placements.pop(key, None)

        pos: int | None = None
        if self._ring_enabled:
            ring = edge.ring
            if ring is None:
                ring = self._ensure_ring(scope, edge)
            if ring is not None:
                pos = ring.try_put(kh, frame)
                if pos is None:
                    stats["fallbacks"] += 1
                    if ringmod.frame_size(size) > ring.capacity // 4:
                        stats["fallback_too_large"] += 1
                    else:
                        stats["fallback_ring_full"] += 1
            else:
                stats["fallbacks"] += 1
                stats["fallback_ring_unavailable"] += 1

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
            ok = perkey.write_segment(
                scope.fd, seg_name, kh, frame, self._pid, self._start
            )
            if not ok:
                raise HostTransportError("segment lock stayed busy")
            scope.bump_pk_token()
            stats["perkey_puts"] += 1
            desc = {"v": _DESC_VERSION, "plane": "key", "size": size}

        # Retire the earlier unclaimed version (after the new one is out, so a
        # receiver that sees both prefers the newer one).
        if previous:
            for p in previous:
                if p.edge != edge_key:
                    continue
                self._retire(scope, p, keep_segment=pos is None)
            rest = [p for p in previous if p.edge != edge_key]
            rest.append(_Placement(edge_key, kh, seg_name, pos))
        else:
            rest = [_Placement(edge_key, kh, seg_name, pos)]
        placements[key] = rest
        if len(placements) > _MAX_TRACKED_KEYS:
            del placements[next(iter(placements))]
        return True, size, desc

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

    def _retire(self, scope: ScopeDir, p: _Placement, keep_segment: bool) -> bool:
        """Withdraw one earlier placement; True if it was still unclaimed."""
        if p.ring_pos is not None:
            edge = self._send_edges.get(p.edge)
            if edge is None or edge.ring is None:
                return False
            done = edge.ring.retire(p.ring_pos, p.key_hash)
            if done:
                self._stats["retired"] += 1
                edge.ring.reclaim()
            return done
        if keep_segment:
            # The new version replaced the segment file in place.
            return False
        done = perkey.remove_segment(scope.fd, p.seg_name)
        if done:
            self._stats["retired"] += 1
        return done

    # -------------------------------------------------------------- cleanup
    def cleanup(self, key: str) -> bool:
        """Retire this process's unclaimed payload for ``key`` (any edge)."""
        with self._send_lock:
            scope = self._scope
            if scope is None:
                return False
            placements = self._placements.pop(key, None)
            if not placements:
                return False
            found = False
            for p in placements:
                found = self._retire(scope, p, keep_segment=False) or found
            return found

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
        if scope is None or scope.q is None:
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
        # A descriptor names the ring slot directly.
        if descriptor is not None and descriptor.get("plane") == "ring":
            name = descriptor.get("ring")
            pos = descriptor.get("pos")
            for r in edge.rings:
                if r.view.name == name and isinstance(pos, int):
                    res = self._claim(edge, r, pos, kh)
                    if res is ringmod.BUSY:
                        busy = True
                    elif res is not None:
                        edge.missed.pop(key, None)
                        return res
                    break
        rings = edge.rings
        for r in list(rings) if len(rings) > 1 else rings:
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
        for r in list(edge.rings):
            if r.view.name not in names or r.view.closed:
                self._drop_ring(edge, r, prune=False)
        known = {r.view.name for r in edge.rings}
        for name in names - known:
            m = RING_NAME_RE.match(name)
            if m is None:
                continue
            pid, start = int(m.group(2)), int(m.group(3))
            liveness = ProcessWatch(pid, start)
            if not liveness.alive():
                liveness.close()
                self._stats["dead_producers_pruned"] += 1
                self._prune(scope, name)
                continue
            try:
                view = ringmod.RingView(scope.fd, name, edge.edge_hex, pid, start)
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
        with contextlib.suppress(OSError, HostTransportError):
            scope.advance_stamp()

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
        out["ring_bytes_in_use"] = sum(
            e.ring.used_bytes() for e in self._send_edges.values() if e.ring
        )
        out["rings_mapped"] = sum(len(e.rings) for e in self._recv_edges.values())
        return out
