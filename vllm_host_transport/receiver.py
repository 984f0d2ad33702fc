# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The receiving side of a host-transport connector.

:class:`Receiver` takes a key's payload from the producers' rings it has
attached (found through the scope's stamp, re-read only when it changes) or
from a per-key segment, never waiting on another process's lock. Its state
is guarded by its own process-local lock. (A process next to the engine
takes a payload through the connector: :func:`.connector.receive_payload`.)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm_host_transport import perkey
from vllm_host_transport import ring as ringmod
from vllm_host_transport import shared as _pid
from vllm_host_transport.codec import FrameCodec
from vllm_host_transport.discovery import (
    Q_PK_TOKEN,
    Q_STAMP,
    RING_NAME_RE,
    HostTransportError,
    ProducerId,
    ScopeDir,
)
from vllm_host_transport.process_identity import ProcessWatch
from vllm_host_transport.ring_view import RingView
from vllm_host_transport.shared import Shared
from vllm_host_transport.shared import edge_hex as _edge_hex
from vllm_host_transport.shared import key_hash as _key_hash
from vllm_host_transport.shared import seg_name as _seg_name

_MAX_MISSED = 4096


@dataclass
class _RecvRing:
    view: RingView
    # None: a producer this process cannot check (another PID namespace),
    # never taken for dead.
    liveness: ProcessWatch | None


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


class Receiver:
    """See the module docs."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        config = shared.config
        self._stats = shared.stats
        self._lock = threading.Lock()
        self._edges: dict[tuple[Any, Any], _RecvEdge] = {}
        self._codec = FrameCodec(
            config.max_payload_bytes,
            config.large_leaf_bytes,
            config.allowed_struct_types,
        )
        self._attach_rings = ringmod.FENCE_AVAILABLE

    def get(
        self,
        from_stage: Any,
        to_stage: Any,
        key: str,
        descriptor: dict[str, Any] | None = None,
        borrow: bool = False,
    ) -> tuple[Any, int] | None:
        """See :meth:`HostTransportConnector.get`."""
        with self._lock:
            r = self._get_locked(from_stage, to_stage, key, descriptor, borrow)
        return None if r is ringmod.BUSY else r

    def get_with_deadline(
        self,
        from_stage: Any,
        to_stage: Any,
        key: str,
        descriptor: dict[str, Any] | None = None,
        deadline: float | None = None,
        poll_interval_s: float = 0.0002,
        borrow: bool = False,
        published: bool = False,
    ) -> tuple[Any, int] | None:
        """See :meth:`HostTransportConnector.get_with_deadline`."""
        while True:
            with self._lock:
                r = self._get_locked(from_stage, to_stage, key, descriptor, borrow)
            if r is None:
                if published:
                    return None  # not busy, not being moved: gone
            elif r is not ringmod.BUSY:
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
        borrow: bool = False,
    ) -> Any:
        shared = self._shared
        scope = shared.scope
        if scope is None or scope.q is None or shared.owner_pid != _pid.this_pid:
            shared.check_open()
            raise HostTransportError("connector is closed")
        edge_key = (from_stage, to_stage)
        edge = self._edges.get(edge_key)
        if edge is None:
            edge = _RecvEdge(_edge_hex(from_stage, to_stage))
            self._edges[edge_key] = edge
        # Fast path: nothing changed since this key was last missed. Reads of
        # mapped memory only: no lock, no directory scan, no system call.
        stamp = scope.q[Q_STAMP]
        token = edge.missed.get(key)
        if (
            token is not None
            and stamp == edge.seen_stamp
            and token == scope.q[Q_PK_TOKEN]
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
        token_now = scope.q[Q_PK_TOKEN]
        seg_name = _seg_name(edge.edge_hex, key)
        res = perkey.claim_segment(scope.fd, seg_name, kh, self._codec, borrow)
        if res is perkey.BUSY:
            return ringmod.BUSY
        if res is perkey.CORRUPT:
            self._stats["corrupt_frames"] += 1
        elif res is perkey.DEAD:
            self._stats["dead_producer_frames"] += 1
        elif res is not perkey.MISSING:
            self._stats["perkey_gets"] += 1
            edge.missed.pop(key, None)
            return res, self._codec.last_size
        if busy:
            return ringmod.BUSY
        edge.missed[key] = token_now
        edge.missed.move_to_end(key)
        if len(edge.missed) > _MAX_MISSED:
            edge.missed.popitem(last=False)
        # A miss may be a producer that died: what it left goes now.
        shared.liveness.check()
        return None

    def _claim(self, edge: _RecvEdge, r: _RecvRing, pos: int, kh: bytes) -> Any:
        view = r.view
        if r.liveness is not None and not r.liveness.alive():
            self._stats["dead_producer_frames"] += 1
            self._drop_ring(edge, r, prune=True)
            return None
        res = view.claim(pos, kh, self._codec)
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
        return res, self._codec.last_size

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
            producer = ProducerId.parse(m.group(2), m.group(3), m.group(5), m.group(6))
            inst = int(m.group(4), 16)
            liveness = producer.watch()
            if liveness is not None and not liveness.alive():
                liveness.close()
                self._stats["dead_producers_pruned"] += 1
                self._prune(scope, name)
                continue
            try:
                view = RingView(
                    scope.fd, name, edge.edge_hex, producer.pid, producer.start, inst
                )
            except (OSError, ValueError):
                if liveness is not None:
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
        if r.liveness is not None:
            r.liveness.close()
        self._stats["rings_released"] += 1
        if prune and self._shared.scope is not None:
            self._prune(self._shared.scope, name)

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

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            self.drop_mappings()

    def drop_mappings(self) -> None:
        """Release every attached ring (also a forked child's copies: only
        this process's mappings are closed)."""
        for redge in self._edges.values():
            for r in redge.rings:
                r.view.close()
                if r.liveness is not None:
                    r.liveness.close()
            redge.rings.clear()
        self._edges = {}

    def health(self, out: dict[str, Any]) -> None:
        out["rings_mapped"] = sum(len(e.rings) for e in self._edges.values())
