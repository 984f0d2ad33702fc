# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Handing finished requests' routes out by reference (engine core).

For a request with ``routed_experts_format="ref"`` the route reader does
not return the array to the scheduler: it hands it to :class:`RouteRefs`,
which puts it into the node's host transport under a fresh random key (in
the scope the consumer named, ``ref_scope``) and gives back the
:class:`~vllm_host_transport.routed_experts.RoutedExpertsRef` that the
request's output carries instead. The array never crosses the engine's
output socket or the API server.

What nobody fetches is bounded: a payload leaves after ``ref_ttl_s``, the
oldest ones leave while more than ``ref_max_bytes`` wait, and everything
left goes when the engine stops (the transport removes its segments). A
payload that was fetched is gone already; retiring it again is a no-op.
Used by the route reader's thread only; counters are read by the engine's.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass

import numpy as np

from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger
from vllm_host_transport import (
    HostTransportConfig,
    HostTransportConnector,
    HostTransportError,
)
from vllm_host_transport.routed_experts import EDGE, RoutedExpertsRef, checksum_hex

logger = init_logger(__name__)


class RouteRefPublishError(ArtifactError):
    """Routes could not be handed to the host transport."""


@dataclass(slots=True)
class _Waiting:
    key: str
    nbytes: int
    expires: float


class RouteRefs:
    """See the module docs."""

    def __init__(self, scope: str | None, max_bytes: int, ttl_s: float) -> None:
        self._max_bytes = max_bytes
        self._ttl_s = ttl_s
        # Payloads never seen to go, oldest first.
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self.waiting_bytes = 0
        self.published = 0
        self.expired = 0
        try:
            self._conn = HostTransportConnector(HostTransportConfig(scope=scope))
        except (HostTransportError, OSError, ValueError) as e:
            raise RouteRefPublishError(
                f"cannot open the host transport for routed-experts references "
                f"(ref_scope {scope!r}): {e}"
            ) from e
        self.scope = self._conn.scope_name

    def publish(self, rows: np.ndarray, prompt_start: int) -> RoutedExpertsRef:
        """Put ``rows`` (an owned ``[rows, layers, top_k]`` array) under a
        fresh key; returns its reference."""
        self.expire()
        rows = np.ascontiguousarray(rows)
        if rows.nbytes > self._max_bytes:
            raise RouteRefPublishError(
                f"routes of {rows.nbytes} bytes exceed ref_max_bytes "
                f"({self._max_bytes}); raise it in --artifact-config"
            )
        while self._waiting and self.waiting_bytes + rows.nbytes > self._max_bytes:
            self._retire(self._waiting.popleft())
        key = secrets.token_hex(16)
        try:
            ok, _, _ = self._conn.put(EDGE[0], EDGE[1], key, rows)
        except HostTransportError as e:
            raise RouteRefPublishError(f"the host transport failed: {e}") from e
        if not ok:
            raise RouteRefPublishError(
                f"the host transport (scope {self.scope!r}) refused a "
                f"{rows.nbytes}-byte payload; see the engine log"
            )
        self._waiting.append(_Waiting(key, rows.nbytes, time.monotonic() + self._ttl_s))
        self.waiting_bytes += rows.nbytes
        self.published += 1
        return RoutedExpertsRef(
            transport="host",
            location=self.scope,
            key=key,
            shape=(rows.shape[0], rows.shape[1], rows.shape[2]),
            dtype=rows.dtype.name,
            nbytes=rows.nbytes,
            checksum=checksum_hex(rows.reshape(-1).view(np.uint8)),
            prompt_start=prompt_start,
        )

    def counters(self) -> dict[str, int]:
        """For the metrics (read from the engine thread: plain ints)."""
        return {
            "waiting_bytes": self.waiting_bytes,
            "published": self.published,
            "expired": self.expired,
        }

    def expire(self) -> None:
        """Retire the payloads past their TTL."""
        now = time.monotonic()
        while self._waiting and self._waiting[0].expires <= now:
            self._retire(self._waiting.popleft())

    def _retire(self, w: _Waiting) -> None:
        self.waiting_bytes -= w.nbytes
        if self._conn.cleanup(w.key):  # False: fetched already
            self.expired += 1

    def close(self) -> None:
        self._waiting.clear()
        self.waiting_bytes = 0
        self._conn.close()
