# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Handing finished requests' routes out by reference (engine core).

For a request with ``routed_experts_format="ref"`` the route reader does
not return the array to the scheduler: it hands it to :class:`RouteRefs`,
which puts it under a fresh random key where the consumer fetches it and
gives back the :class:`~vllm_host_transport.routed_experts.RoutedExpertsRef`
that the request's output carries instead. The array never crosses the
engine's output socket or the API server. Two places (``ref_transport``):

* ``host``: this node's host transport, in the scope ``ref_scope``
  (:class:`_HostSink`); a consumer takes the payload once;
* ``mooncake``: a Mooncake Store (:class:`_MooncakeSink`): consumers on any
  host that reaches its master read it until it is removed.

What nobody fetches is bounded: a payload leaves after ``ref_ttl_s``, the
oldest ones leave while more than ``ref_max_bytes`` or
:data:`MAX_WAITING_REFS` wait, and everything left goes when the engine
stops (a killed engine's host payloads are removed by the next engine or
fetch in the scope, see ``vllm_host_transport/liveness.py``). When a host
put fails because ``/dev/shm`` itself is full (the engines of a node share
it), this engine's oldest unfetched payloads that have a per-key segment of
their own (those in the preallocated ring free nothing) are removed, only
until the free space covers the new payload, and the put is tried again,
at most :data:`_MAX_SPACE_RETRIES` times; a removal that frees nothing ends
it. The expiry
pass (:meth:`RouteRefs.expire`, every second) also learns which host
payloads were fetched, so ``waiting_bytes`` counts only what really waits.
Retiring a payload that was fetched is a no-op. Used by the hand-off thread
only (``route_handoff.py``); counters are read by the engine's.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.config.artifact_sizing import DEFAULT_REF_MAX_BYTES
from vllm.distributed.artifact_connector.shm.space import free_bytes
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger
from vllm_host_transport import (
    HostTransportConfig,
    HostTransportConnector,
    HostTransportError,
)
from vllm_host_transport.discovery import collect_abandoned_scopes
from vllm_host_transport.routed_experts import (
    EDGE,
    RoutedExpertsRef,
    checksum_hex,
    sha256_hex,
)

if TYPE_CHECKING:
    from vllm.config.artifact import ArtifactConfig

logger = init_logger(__name__)

#: Most references whose payloads wait at once; the oldest is removed beyond
#: it (counted as expired), like beyond ``ref_max_bytes``.
MAX_WAITING_REFS = 1 << 16


class RouteRefPublishError(ArtifactError):
    """Routes could not be handed out by reference."""


class _NoSpaceError(RouteRefPublishError):
    """The file system under the host transport is full (``/dev/shm``,
    shared with the other engines of the node)."""


#: A failed host put with less than this beyond the payload free in
#: ``/dev/shm`` is taken for a full file system (the transport reports no
#: cause): a payload's frame and segment header take a few hundred bytes,
#: and tmpfs allocates whole pages.
_NO_SPACE_SLACK = 64 << 10
#: Puts tried again after making room in a full ``/dev/shm``.
_MAX_SPACE_RETRIES = 3


class _HostSink:
    """The host transport of this node."""

    transport = "host"

    def __init__(self, scope: str | None) -> None:
        try:
            # A squatted scope directory is replaced by a fresh private scope,
            # which every reference names: the consumer needs nothing else.
            self._conn = HostTransportConnector(
                HostTransportConfig(scope=scope, scope_fallback=True)
            )
        except (HostTransportError, OSError, ValueError) as e:
            raise RouteRefPublishError(
                f"cannot open the host transport for routed-experts references "
                f"(ref_scope {scope!r}): {e}"
            ) from e
        self.location = self._conn.scope_name
        # Scopes whose producers were all killed (their engines' scopes
        # derive from session ids no later engine shares) go when an engine
        # starts on the node; a scope with any connector in it is kept.
        root, own = os.path.split(self._conn.scope_dir)
        try:
            removed = collect_abandoned_scopes(root, keep=own)
        except OSError as e:
            logger.warning("could not collect abandoned host-transport scopes: %s", e)
        else:
            if removed:
                logger.info(
                    "removed host-transport scopes of killed engines: %s", removed
                )

    def put(self, key: str, rows: np.ndarray) -> bool:
        """Returns whether the payload took a per-key segment of its own
        (removing it gives its bytes back to ``/dev/shm``; a ring frame's
        are preallocated)."""
        try:
            ok, _, desc = self._conn.put(EDGE[0], EDGE[1], key, rows)
        except HostTransportError as e:
            raise RouteRefPublishError(f"the host transport failed: {e}") from e
        if not ok:
            error = RouteRefPublishError
            with contextlib.suppress(HostTransportError):  # closed meanwhile
                free = free_bytes(self._conn.scope_dir)
                if free < rows.nbytes + _NO_SPACE_SLACK:
                    error = _NoSpaceError
            raise error(
                f"the host transport (scope {self.location!r}) refused a "
                f"{rows.nbytes}-byte payload"
                + ("; /dev/shm is full" if error is _NoSpaceError else "")
                + "; see the engine log"
            )
        return desc is not None and desc.get("plane") == "key"

    def free_bytes(self) -> int:
        try:
            return free_bytes(self._conn.scope_dir)
        except HostTransportError:
            return 0

    def retire(self, key: str) -> bool:
        return self._conn.cleanup(key)

    def taken(self) -> list[str]:
        """Keys fetched since the last call."""
        return self._conn.taken()

    def upkeep(self) -> None:
        # What killed engines of this scope left (none of ours).
        self._conn.remove_dead()

    def close(self) -> None:
        self._conn.close()  # withdraws every payload not fetched yet


class _MooncakeSink:
    """A Mooncake Store, reached through its master."""

    transport = "mooncake"

    def __init__(self, cfg: ArtifactConfig) -> None:
        from vllm.distributed.artifact_connector.mooncake import client

        self.location = str(cfg.mooncake_master)
        try:
            self._store: Any = client.acquire(cfg)
        except client.MooncakeUnavailableError as e:
            raise RouteRefPublishError(str(e)) from e
        # In this engine's own segment: a reference lives as long as the
        # engine that handed it out, not as long as whichever engine's
        # segment Mooncake would pick (on another node, maybe).
        self._placement = client.own_segment(self._store)

    def put(self, key: str, rows: np.ndarray) -> bool:
        if not rows.nbytes:
            # Mooncake refuses empty objects (-600); a reference to no rows
            # is fetched from the reference alone (routed_experts.fetch).
            return False
        rc = self._store.put(key, rows.reshape(-1).view(np.uint8).data, self._placement)
        if rc != 0:
            raise RouteRefPublishError(
                f"the Mooncake Store (master {self.location}) refused a "
                f"{rows.nbytes}-byte payload (put returned {rc})"
            )
        return False  # never in /dev/shm

    def retire(self, key: str) -> bool:
        # Fails while a reader's lease holds the object; Mooncake's own
        # eviction still bounds what stays. (An empty payload was never put;
        # its remove fails, harmlessly.)
        return self._store.remove(key) == 0

    def taken(self) -> list[str]:
        # A Mooncake payload can be read any number of times: it waits until
        # its TTL whether it was read or not.
        return []

    def upkeep(self) -> None:
        pass

    def close(self) -> None:
        from vllm.distributed.artifact_connector.mooncake import client

        client.release(self._store)


@dataclass(slots=True)
class _Waiting:
    key: str
    nbytes: int
    expires: float
    own_segment: bool  # a per-key segment: removing it frees /dev/shm


class RouteRefs:
    """See the module docs."""

    def __init__(self, cfg: ArtifactConfig) -> None:
        # Set from the node by verify_artifact_config when left unset.
        self._max_bytes = cfg.ref_max_bytes or DEFAULT_REF_MAX_BYTES
        self._ttl_s = cfg.ref_ttl_s
        # Payloads never seen to go, by key, oldest first.
        self._waiting: collections.OrderedDict[str, _Waiting] = (
            collections.OrderedDict()
        )
        self.waiting_bytes = 0
        self.published = 0
        self.expired = 0
        self.space_evictions = 0  # removed early because /dev/shm was full
        self._sink: _HostSink | _MooncakeSink = (
            _MooncakeSink(cfg)
            if cfg.ref_transport == "mooncake"
            else _HostSink(cfg.ref_scope)
        )

    def publish(self, rows: np.ndarray, prompt_start: int) -> RoutedExpertsRef:
        """Put ``rows`` (an owned ``[rows, layers, top_k]`` array) under a
        fresh key; returns its reference."""
        rows = np.ascontiguousarray(rows)
        if rows.nbytes > self._max_bytes:
            raise RouteRefPublishError(
                f"routes of {rows.nbytes} bytes exceed ref_max_bytes "
                f"({self._max_bytes}); raise it in --artifact-config"
            )
        waiting = self._waiting
        while waiting and (
            self.waiting_bytes + rows.nbytes > self._max_bytes
            or len(waiting) >= MAX_WAITING_REFS
        ):
            self._retire(waiting.popitem(last=False)[1])
        key = secrets.token_hex(16)
        retries = 0
        while True:
            try:
                own_segment = self._sink.put(key, rows)
                break
            except _NoSpaceError as e:
                # /dev/shm is full (other engines, other files): this
                # engine's oldest unfetched payloads that hold space of
                # their own go first, as beyond ref_max_bytes.
                if retries == _MAX_SPACE_RETRIES or not self._make_room(rows.nbytes):
                    raise RouteRefPublishError(
                        f"{e}, and removing this engine's unfetched references "
                        "cannot make room for it; give /dev/shm more room or "
                        "size the engines that share it (engines_per_node, "
                        "$VLLM_ENGINES_PER_NODE)"
                    ) from e
                retries += 1
        flat = rows.reshape(-1).view(np.uint8)
        waiting[key] = _Waiting(
            key, rows.nbytes, time.monotonic() + self._ttl_s, own_segment
        )
        self.waiting_bytes += rows.nbytes
        self.published += 1
        return RoutedExpertsRef(
            transport=self._sink.transport,
            location=self._sink.location,
            key=key,
            shape=(rows.shape[0], rows.shape[1], rows.shape[2]),
            dtype=rows.dtype.name,
            nbytes=rows.nbytes,
            checksum=checksum_hex(flat),
            prompt_start=prompt_start,
            # Over Mooncake (objects anyone who reaches the master may
            # replace) a collision-resistant digest too; the host transport's
            # files are the user's own.
            sha256=sha256_hex(flat) if self._sink.transport == "mooncake" else "",
        )

    def _make_room(self, nbytes: int) -> bool:
        """Remove this engine's oldest unfetched payloads that have a
        segment of their own until ``/dev/shm`` has room for ``nbytes`` more;
        stops at the first removal that frees nothing (the payload was
        fetched meanwhile, or a trainer still maps it). Returns whether there
        is room now."""
        sink = self._sink
        if not isinstance(sink, _HostSink):
            return False
        self._forget_taken()
        need = nbytes + _NO_SPACE_SLACK
        free = sink.free_bytes()
        for w in [w for w in self._waiting.values() if w.own_segment]:
            if free >= need:
                break
            del self._waiting[w.key]
            self._retire(w)
            self.space_evictions += 1
            now = sink.free_bytes()
            if now <= free:
                return False
            free = now
        return free >= need

    def _forget_taken(self) -> None:
        waiting = self._waiting
        for key in self._sink.taken():
            w = waiting.pop(key, None)
            if w is not None:
                self.waiting_bytes -= w.nbytes

    def counters(self) -> dict[str, int]:
        """For the metrics (read from the engine thread: plain ints)."""
        return {
            "waiting_bytes": self.waiting_bytes,
            "published": self.published,
            "expired": self.expired,
        }

    def expire(self) -> None:
        """The periodic pass: forget the payloads that were fetched, retire
        those past their TTL, and remove what killed engines left."""
        waiting = self._waiting
        self._forget_taken()
        now = time.monotonic()
        while waiting:
            w = next(iter(waiting.values()))
            if w.expires > now:
                break
            del waiting[w.key]
            self._retire(w)
        self._sink.upkeep()

    def retire(self, key: str) -> None:
        """Remove one handed-out payload now: its request ended without the
        reference (it came past the request's deadline)."""
        w = self._waiting.pop(key, None)
        if w is not None:
            self.waiting_bytes -= w.nbytes
            self._sink.retire(key)

    def _retire(self, w: _Waiting) -> None:
        self.waiting_bytes -= w.nbytes
        if self._sink.retire(w.key):  # False: fetched already
            self.expired += 1

    def close(self) -> None:
        """Remove everything still waiting (the engine stops)."""
        if self._sink.transport == "mooncake":
            for key in self._waiting:
                self._sink.retire(key)
        self._waiting.clear()
        self.waiting_bytes = 0
        self._sink.close()
