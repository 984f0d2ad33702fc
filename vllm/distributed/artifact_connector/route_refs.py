# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Handing finished requests' routes out by reference (engine core).

For a request with ``routed_experts_format="ref"`` the route reader does
not return the array to the scheduler: it hands it to :class:`RouteRefs`,
which stores it once under a fresh random key, in the stored form trainer
ranks read slices of (``vllm_host_transport/routes_format.py``: a header
of chunk digests, then the routes layer-major), and gives back the
:class:`~vllm_host_transport.routed_experts.RoutedExpertsRef` that the
request's output carries instead. The array never crosses the engine's
output socket or the API server. Two places (``ref_transport``):

* ``host``: this node's host transport, in the scope ``ref_scope``
  (:class:`_HostSink`: a read-many object, ``vllm_host_transport/readmany.py``);
* ``mooncake``: a Mooncake Store (``route_sink_mooncake.py``), read from
  any host that reaches its master.

Any number of consumers read a payload until it goes: released by the
driver or the last of its readers (``routes_reader.release``), its weight
version retired (``ref_versions_kept`` versions stay), ``ref_ttl_s``
passed, the oldest beyond ``ref_max_bytes`` or :data:`MAX_WAITING_REFS`,
and everything left when the engine stops (a killed engine's host payloads
are removed by the next engine in the scope, see
``vllm_host_transport/liveness.py``). When a host put fails because
``/dev/shm`` itself is full (the engines of a node share it), this engine's
oldest payloads are removed, only until the free space covers the new
payload, and the put is tried again, at most :data:`_MAX_SPACE_RETRIES`
times; a removal that frees nothing ends it. The expiry pass
(:meth:`RouteRefs.expire`, every second) also learns which payloads readers
released, so ``waiting_bytes`` counts only what really waits. Used by the
hand-off thread only (``route_handoff.py``); counters are read by the
engine's.
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
from vllm_host_transport.routed_experts import RoutedExpertsRef
from vllm_host_transport.routes_format import encode

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

    def put(self, key: str, parts: list[memoryview], nbytes: int) -> bool:
        """Store the concatenation of ``parts`` (``nbytes``) under ``key``,
        readable by any process of the user until removed. Returns True: its
        bytes are a file of their own in ``/dev/shm`` (removing it frees
        them)."""
        try:
            ok = self._conn.put_readable(key, parts)
        except HostTransportError as e:
            raise RouteRefPublishError(f"the host transport failed: {e}") from e
        if not ok:
            error = RouteRefPublishError
            with contextlib.suppress(HostTransportError):  # closed meanwhile
                free = free_bytes(self._conn.scope_dir)
                if free < nbytes + _NO_SPACE_SLACK:
                    error = _NoSpaceError
            raise error(
                f"the host transport (scope {self.location!r}) refused a "
                f"{nbytes}-byte payload"
                + ("; /dev/shm is full" if error is _NoSpaceError else "")
                + "; see the engine log"
            )
        return True

    def free_bytes(self) -> int:
        try:
            return free_bytes(self._conn.scope_dir)
        except HostTransportError:
            return 0

    def retire(self, key: str) -> bool:
        return self._conn.withdraw_readable(key)

    def gone(self, keys: list[str]) -> list[str]:
        """Which of ``keys`` readers (or the driver) removed."""
        return self._conn.readables_gone(keys)

    def upkeep(self) -> None:
        # What killed engines of this scope left (none of ours).
        self._conn.remove_dead()

    def close(self) -> None:
        self._conn.close()  # withdraws every payload still there


@dataclass(slots=True)
class _Waiting:
    key: str
    nbytes: int
    expires: float
    own_segment: bool  # a file of its own: removing it frees /dev/shm
    weight_version: str  # the newest version of its rows


class RouteRefs:
    """See the module docs."""

    def __init__(self, cfg: ArtifactConfig) -> None:
        # Set from the node by verify_artifact_config when left unset.
        self._max_bytes = cfg.ref_max_bytes or DEFAULT_REF_MAX_BYTES
        self._ttl_s = cfg.ref_ttl_s
        self._key_space = cfg.key_space or ""
        # Payloads not seen to go, by key, oldest first.
        self._waiting: collections.OrderedDict[str, _Waiting] = (
            collections.OrderedDict()
        )
        self.waiting_bytes = 0
        self.published = 0
        self.expired = 0
        self.space_evictions = 0  # removed early because /dev/shm was full
        self.version_retired = 0  # removed with their weight version
        if cfg.ref_transport == "mooncake":
            from vllm.distributed.artifact_connector.route_sink_mooncake import (
                MooncakeRefSink,
            )

            self._sink: Any = MooncakeRefSink(cfg)
        else:
            self._sink = _HostSink(cfg.ref_scope)
        # Objects anyone who reaches a Mooncake master could replace carry
        # SHA-256 digests; the host transport's files are the user's own.
        self._digest = "sha256" if self._sink.transport == "mooncake" else "xxh3_64"

    def publish(
        self, rows: np.ndarray, prompt_start: int, weight_version: str = ""
    ) -> RoutedExpertsRef:
        """Store ``rows`` (an owned ``[rows, layers, top_k]`` array) under a
        fresh key; returns its reference. ``weight_version``: the versions
        the rows were computed under (``","``-joined, in row order)."""
        if rows.nbytes > self._max_bytes:
            raise RouteRefPublishError(
                f"routes of {rows.nbytes} bytes exceed ref_max_bytes "
                f"({self._max_bytes}); raise it in --artifact-config"
            )
        payload = encode(rows, self._digest)
        waiting = self._waiting
        while waiting and (
            self.waiting_bytes + payload.nbytes > self._max_bytes
            or len(waiting) >= MAX_WAITING_REFS
        ):
            self._retire(waiting.popitem(last=False)[1])
        key = secrets.token_hex(16)
        retries = 0
        while True:
            try:
                own_segment = self._sink.put(key, payload.parts, payload.nbytes)
                break
            except _NoSpaceError as e:
                # /dev/shm is full (other engines, other files): this
                # engine's oldest payloads go first, as beyond ref_max_bytes.
                if retries == _MAX_SPACE_RETRIES or not self._make_room(payload.nbytes):
                    raise RouteRefPublishError(
                        f"{e}, and removing this engine's waiting references "
                        "cannot make room for it; give /dev/shm more room or "
                        "size the engines that share it (engines_per_node, "
                        "$VLLM_ENGINES_PER_NODE)"
                    ) from e
                retries += 1
        newest = weight_version.rsplit(",", 1)[-1]
        waiting[key] = _Waiting(
            key,
            payload.nbytes,
            time.monotonic() + self._ttl_s,
            own_segment,
            newest,
        )
        self.waiting_bytes += payload.nbytes
        self.published += 1
        return RoutedExpertsRef.for_payload(
            payload,
            transport=self._sink.transport,
            location=self._sink.location,
            key=key,
            prompt_start=prompt_start,
            weight_version=weight_version,
            key_space=self._key_space,
        )

    def _make_room(self, nbytes: int) -> bool:
        """Remove this engine's oldest payloads that have a file of their
        own until ``/dev/shm`` has room for ``nbytes`` more; stops at the
        first removal that frees nothing (released meanwhile, or a reader
        still has it open). Returns whether there is room now."""
        sink = self._sink
        if not isinstance(sink, _HostSink):
            return False
        self._forget_gone()
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

    def _forget_gone(self) -> None:
        waiting = self._waiting
        for key in self._sink.gone(list(waiting)):
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
        """The periodic pass: forget the payloads readers released, retire
        those past their TTL, and remove what killed engines left."""
        waiting = self._waiting
        self._forget_gone()
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

    def retire_versions(self, kept: tuple[str, ...]) -> None:
        """Remove every payload whose rows' newest weight version is not in
        ``kept`` (the engine moved past it)."""
        for w in [w for w in self._waiting.values() if w.weight_version not in kept]:
            del self._waiting[w.key]
            self.waiting_bytes -= w.nbytes
            if self._sink.retire(w.key):
                self.version_retired += 1

    def _retire(self, w: _Waiting) -> None:
        self.waiting_bytes -= w.nbytes
        if self._sink.retire(w.key):  # False: released already
            self.expired += 1

    def close(self) -> None:
        """Remove everything still waiting (the engine stops)."""
        if self._sink.transport == "mooncake":  # the host sink's close does
            for key in self._waiting:
                self._sink.retire(key)
        self._waiting.clear()
        self.waiting_bytes = 0
        self._sink.close()
