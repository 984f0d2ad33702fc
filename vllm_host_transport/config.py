# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Configuration of the same-node host transport."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import msgspec

KIB = 1024
MIB = 1024 * KIB

DEFAULT_HOST_RING_BYTES = 4 * MIB
MIN_HOST_RING_BYTES = 4 * KIB
MAX_HOST_RING_BYTES = 64 * MIB

#: Environment variable a launcher sets to give every process of one deployment
#: the same scope (and therefore the same shared-memory directory).
SCOPE_ENV = "VLLM_HOST_TRANSPORT_SCOPE"


@dataclass(frozen=True)
class HostTransportConfig:
    """Settings of one host-transport connector."""

    host_ring_bytes: int = DEFAULT_HOST_RING_BYTES
    """Capacity of each per-(producer, edge) host ring in bytes. 0 disables the
    ring for this connector's puts (everything goes through per-key segments);
    otherwise it must lie between 4 KiB and 64 MiB and be a multiple of 64."""

    scope: str | None = None
    """Deployment scope. Every process that should see each other's payloads
    uses the same scope. ``None`` reads ``VLLM_HOST_TRANSPORT_SCOPE`` and, when
    that is unset, derives one from the session id of the calling process
    (``sid-<getsid>``, logged at start-up): a process of another login session,
    such as a trainer launched separately, derives a different one and must be
    given the producer's scope. Set it explicitly (or through the environment
    variable) for an R3 hand-off."""

    scope_fallback: bool = False
    """What to do when the scope's directory exists but is not this user's
    private directory (another local user created it first, or it has group
    or other access, or is a symlink): ``False`` refuses it
    (``ScopeSquattedError``); ``True`` uses a fresh private scope instead,
    ``<scope>~<16 random hex>`` (``connector.scope_name``), and logs a
    warning naming the squatted directory and its owner. Only a producer
    that hands its scope name to its consumers (as a routed-experts
    reference does) can use it: the others would not find the new scope."""

    create_scope: bool = True
    """``False``: join the scope only if its directory exists (a consumer of
    a scope it learned from a producer: a stale or foreign name must not
    create a directory); a missing one raises ``ScopeMissingError``."""

    shm_root: str = "/dev/shm"
    """Directory of the shared-memory mount that holds the scope directory."""

    max_payload_bytes: int = 1 << 30
    """Largest payload (and largest single array) accepted by ``put``. Larger
    arrays are rejected before any copy of them is made."""

    large_leaf_bytes: int = 64 * KIB
    """Tensor leaves of at least this size get their own allocation on receipt;
    smaller leaves share one owned buffer."""

    ring_wait_s: float = 0.001
    """Longest a ``put`` waits for ring space when the ring is full (receivers
    behind) before it falls back to a per-key segment. A wait that runs out is
    not repeated until the oldest frame moves, so a ring nobody drains costs
    one wait, not one per put. 0: never wait."""

    ring_spill_age_s: float = 1.0
    """When the ring is full, unclaimed frames older than this are moved to
    per-key segments (still deliverable) to make room: one frame nobody claims
    (a crashed consumer, a key nobody asks for) cannot wedge the ring."""

    foreign_producer_ttl_s: float = 3600.0
    """A producer of another PID namespace (another container sharing
    ``/dev/shm``) cannot be checked from here; what it left is removed
    once its registration has not been refreshed for this long (a producer
    refreshes it at most once a minute while it puts, or when
    ``taken()``/``remove_dead()`` is called). At least 300."""

    allowed_struct_types: tuple[Any, ...] = ()
    """``msgspec.Struct`` classes this connector may rebuild from a received
    frame. A frame naming any other struct type is refused (``None`` plus
    ``health()["corrupt_frames"]``); nothing is ever imported by a name read
    from shared memory. Senders need no configuration."""

    def __post_init__(self) -> None:
        ring = self.host_ring_bytes
        if not isinstance(ring, int) or isinstance(ring, bool):
            raise TypeError("host_ring_bytes must be an int")
        if ring != 0 and not (MIN_HOST_RING_BYTES <= ring <= MAX_HOST_RING_BYTES):
            raise ValueError(
                "host_ring_bytes must be 0 (disabled) or between "
                f"{MIN_HOST_RING_BYTES} and {MAX_HOST_RING_BYTES}, got {ring}"
            )
        if ring % 64:
            raise ValueError("host_ring_bytes must be a multiple of 64")
        if self.max_payload_bytes <= 0:
            raise ValueError("max_payload_bytes must be positive")
        if self.large_leaf_bytes <= 0:
            raise ValueError("large_leaf_bytes must be positive")
        if not (self.ring_wait_s >= 0 and self.ring_spill_age_s >= 0):
            raise ValueError("ring_wait_s and ring_spill_age_s must be >= 0")
        if not self.foreign_producer_ttl_s >= 300:
            raise ValueError("foreign_producer_ttl_s must be at least 300")
        if not isinstance(self.allowed_struct_types, tuple) or not all(
            isinstance(c, type) and issubclass(c, msgspec.Struct)
            for c in self.allowed_struct_types
        ):
            raise TypeError("allowed_struct_types must be a tuple of Struct classes")
        if not isinstance(self.scope_fallback, bool):
            raise TypeError("scope_fallback must be a bool")
        if self.scope is not None and not self.scope:
            raise ValueError("scope must be a non-empty string or None")

    @property
    def ring_enabled(self) -> bool:
        return self.host_ring_bytes > 0

    def resolved_scope(self) -> str:
        """The scope this connector uses (explicit, environment, derived)."""
        if self.scope is not None:
            return self.scope
        env = os.environ.get(SCOPE_ENV)
        if env:
            return env
        return f"sid-{os.getsid(0)}"
