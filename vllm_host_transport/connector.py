# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host-transport connector: same-node payload hand-off by key.

Two data planes share one wire format (:mod:`.frame`):

* the host ring (:mod:`.ring`), one per (producer process, edge), allocated on
  the first put of that edge, for frames up to a quarter of its capacity;
* per-key segments (:mod:`.perkey`) for everything else: large frames, a full
  ring, a disabled ring (``host_ring_bytes=0``) or a ring that failed to set up.

The connector is a facade over its two sides, each with its own state and
process-local lock (:class:`.sender.Sender`, :class:`.receiver.Receiver`),
so a thread receiving is never queued behind a thread of the same process
that is sending (or waiting for a ring lock while sending).

A process next to the engine (for example a trainer) that knows the
deployment scope, the edge and the key of a finished request can take its
payload::

    from vllm_host_transport import (
        HostTransportConfig, HostTransportConnector, receive_payload)

    with HostTransportConnector(HostTransportConfig(scope="job-42")) as conn:
        obj = receive_payload(conn, "engine", "trainer", "req_17_0",
                              timeout_s=5.0)

The producer publishes with ``conn.put("engine", "trainer", key, payload)``.

A connector belongs to the process that created it: in a forked child it only
drops its mappings when closed or collected (it never marks, unlinks or
removes anything of its parent's), and ``put``/``get`` there fail.

What waits is bounded: a connector's unclaimed payloads go with its
``close`` whoever else keeps the scope open, at most
:data:`.sender.MAX_TRACKED_KEYS` of them are kept (the oldest is withdrawn
beyond it), and what a killed producer left is removed by the next
connector to join the scope or receive from it (:mod:`.liveness`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_host_transport import ring as ringmod
from vllm_host_transport.config import SCOPE_ENV, HostTransportConfig
from vllm_host_transport.discovery import (
    HostTransportError,
    ScopeDir,
    check_platform,
    self_identity,
)
from vllm_host_transport.readmany import ReadablePublisher
from vllm_host_transport.receiver import Receiver
from vllm_host_transport.sender import MAX_TRACKED_KEYS, Sender
from vllm_host_transport.shared import Shared

# A child of vLLM's "vllm" logger (a name only: nothing is imported), so in a
# vLLM process these lines go where vLLM's own go.
logger = logging.getLogger("vllm.host_transport.connector")


class HostTransportConnector:
    """Hands payloads between processes of one node by (edge, key).

    ``put`` copies the payload before it returns; ``get`` returns an owned
    object (nothing refers to shared memory). One publisher per key; when
    several receivers compete for a key, exactly one gets it.
    """

    def __init__(self, config: HostTransportConfig | None = None) -> None:
        # Fields close() relies on come first, so close() is safe whatever
        # the constructor got to.
        self._shared: Shared | None = None
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        self._readables: ReadablePublisher | None = None
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
        scope = ScopeDir(
            self.config.shm_root,
            self.scope_name,
            fallback=self.config.scope_fallback,
            create=self.config.create_scope,
        )
        if scope.squatted is not None:
            logger.warning(
                "host transport: the directory of scope %r cannot be used: %s. "
                "Another local user may have created it first. Using the fresh "
                "private scope %r (%s) instead; remove the old directory (as "
                "its owner or root) to return to the usual one",
                self.scope_name,
                scope.squatted,
                scope.scope,
                scope.path,
            )
            self.scope_name = scope.scope
        self._shared = Shared(
            self.config, scope, self_identity(), dict.fromkeys(_STATS, 0)
        )
        # What killed producers left here goes before anything else is done.
        self._shared.liveness.check()
        if not ringmod.FENCE_AVAILABLE:
            logger.warning(
                "host transport: no memory fence on this CPU (%s; libatomic.so.1 "
                "not found): the host ring is off, payloads use per-key "
                "segments, and rings of other producers are not read (run "
                "them with host_ring_bytes=0 too)",
                ringmod.platform.machine(),
            )
        self._sender = Sender(self._shared)
        self._receiver = Receiver(self._shared)
        self._readables = ReadablePublisher(
            self._shared,
            self._sender.ensure_registered,
            MAX_TRACKED_KEYS,
            self.config.max_payload_bytes,
        )

    # ------------------------------------------------------------ lifecycle
    @property
    def scope_dir(self) -> str:
        shared = self._shared
        if shared is None or shared.scope is None:
            raise HostTransportError("connector is closed")
        return shared.scope.path

    def close(self) -> None:
        """Release everything: withdraws this connector's payloads that no
        receiver took (its rings and per-key segments) and its read-many
        objects, and removes the
        scope directory when it is the last connector of the scope.
        Idempotent. In a forked child it only drops the child's mappings."""
        shared = getattr(self, "_shared", None)
        if shared is None or shared.scope is None:
            return
        shared.closed = True
        sender, receiver = self._sender, self._receiver
        teardown = os.getpid() == shared.owner_pid
        if not teardown:
            # Nothing shared is written, unlinked or locked in a forked child.
            if sender is not None:
                sender.drop_mappings()
            if receiver is not None:
                receiver.drop_mappings()
        else:
            # Read-many objects first: the registration (sender.close)
            # names their producer to a sweep until they are gone.
            if self._readables is not None:
                self._readables.close()
            if sender is not None:
                sender.close()
            if receiver is not None:
                receiver.close()
        shared.liveness.close(wait=teardown)  # it uses the scope's descriptor
        scope, shared.scope = shared.scope, None
        scope.close(teardown=teardown)

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

    def _send_side(self) -> Sender:
        if self._sender is None:  # the constructor failed
            raise HostTransportError("connector is closed")
        return self._sender

    def _receive_side(self) -> Receiver:
        if self._receiver is None:  # the constructor failed
            raise HostTransportError("connector is closed")
        return self._receiver

    # ------------------------------------------------------------ the sides
    def put(
        self, from_stage: Any, to_stage: Any, key: str, data: Any
    ) -> tuple[bool, int, dict[str, Any] | None]:
        """Publish ``data`` under ``key`` on edge ``from_stage -> to_stage``.

        Returns ``(ok, size, descriptor)``; failures are ``(False, 0, None)``.
        The payload is fully copied when this returns.
        """
        sender = self._sender or self._send_side()
        return sender.put(from_stage, to_stage, key, data)

    def cleanup(self, key: str) -> bool:
        """Retire this process's unclaimed payload for ``key`` (any edge)."""
        return self._send_side().cleanup(key)

    def cleanup_prefix(self, prefix: str) -> int:
        """Retire every unclaimed key ``prefix + <digits>``; returns how many."""
        return self._send_side().cleanup_prefix(prefix)

    def taken(self) -> list[str]:
        """Keys of this connector's payloads that receivers have taken since
        the last call (or that are gone otherwise); they are not tracked any
        more. Costs a look at each tracked payload (and one listing of the
        scope when some are per-key): call it now and then, not per put."""
        sender = self._send_side()
        sender.heartbeat()
        return sender.taken()

    # ----------------------------------------------------- read-many objects
    def put_readable(self, key: str, parts: Sequence[Any]) -> bool:
        """Publish the concatenation of ``parts`` (bytes, memoryviews,
        C-contiguous numpy arrays) as the read-many object ``key``: any
        number of processes read byte ranges of it
        (:func:`.readmany.open_readable`) until this connector withdraws it
        or closes, the driver removes it (:func:`.readmany.remove_readable`)
        or the last of its readers releases it. Visible whole or not at
        all. False (logged once per kind of failure; counted in
        ``health()``) when it could not be published: a full mount, larger
        than ``max_payload_bytes``, a closed connector, or ``key`` published
        already (one publication per key: withdraw it first)."""
        if self._readables is None:
            return False
        return self._readables.put(key, parts)

    def withdraw_readable(self, key: str) -> bool:
        """Remove this connector's read-many object ``key`` now: True if
        this call removed it. Readers that have it open keep reading it."""
        readables = self._readables
        return readables is not None and readables.withdraw(key)

    def readables_gone(self, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` whose read-many object of this connector is no
        longer there (released by its readers, removed by the driver or a
        sweep); they are not tracked any more. One listing of the scope:
        call it now and then (the engine: once a second), not per key."""
        readables = self._readables
        if readables is None:
            return []
        sender = self._sender
        if sender is not None:
            sender.heartbeat()
        return readables.gone(keys)

    def remove_dead(self) -> int:
        """Remove what producers of the scope that died since the last look
        left (their rings, per-key segments, registrations); returns how many
        such producers there were. Joining the scope and every receive that
        misses do the same; a producer that receives nothing calls this now
        and then (cheap while nobody died: a pidfd poll per producer)."""
        shared = self._shared
        if shared is None or shared.owner_pid != os.getpid():
            return 0  # a forked child touches nothing of its parent's
        if self._sender is not None:
            self._sender.heartbeat()
        return shared.liveness.check()

    def get(
        self,
        from_stage: Any,
        to_stage: Any,
        key: str,
        descriptor: dict[str, Any] | None = None,
        *,
        borrow: bool = False,
    ) -> tuple[Any, int] | None:
        """Take the payload for ``key``: ``(obj, size)`` or ``None`` when it is
        not there (yet) or gone. Never waits on another process's lock.

        With ``borrow``, large numpy arrays of a payload taken from a per-key
        segment are views of the claimed segment, mapped privately, instead
        of copies (nothing else can reach it once claimed; writes stay
        private); ring payloads are copied as always."""
        receiver = self._receiver or self._receive_side()
        return receiver.get(from_stage, to_stage, key, descriptor, borrow)

    def get_with_deadline(
        self,
        from_stage: Any,
        to_stage: Any,
        key: str,
        descriptor: dict[str, Any] | None = None,
        deadline: float | None = None,
        poll_interval_s: float = 0.0002,
        *,
        borrow: bool = False,
        published: bool = False,
    ) -> tuple[Any, int] | None:
        """Poll for ``key`` until ``deadline`` (``time.monotonic()`` seconds).

        Locks held by other processes are only ever tried, never waited on,
        so this returns ``None`` once the deadline has passed. ``borrow``: see
        :meth:`get`. ``published``: the caller knows that the key's only put
        completed before this call (it learned the key from the producer
        afterwards), so a miss is final and ``None`` comes at once; only a
        busy lock or a frame being moved between the planes is waited for."""
        return self._receive_side().get_with_deadline(
            from_stage,
            to_stage,
            key,
            descriptor,
            deadline,
            poll_interval_s,
            borrow,
            published,
        )

    # --------------------------------------------------------------- health
    def health(self) -> dict[str, Any]:
        """Counters and state (a snapshot)."""
        shared = self._shared
        out: dict[str, Any] = dict(shared.stats) if shared is not None else {}
        out["closed"] = shared is None or shared.closed
        out["scope"] = getattr(self, "scope_name", None)
        out["host_ring_bytes"] = self.config.host_ring_bytes
        sender, receiver = self._sender, self._receiver
        if sender is not None:
            sender.health(out)
        wanted = out.get("ring_puts", 0) + out.get("fallbacks", 0)
        # Share of the puts that wanted the ring and went per-key.
        out["fallback_rate"] = out.get("fallbacks", 0) / wanted if wanted else 0.0
        if receiver is not None:
            receiver.health(out)
        return out


def receive_payload(
    conn: HostTransportConnector,
    from_stage: Any,
    to_stage: Any,
    key: str,
    timeout_s: float = 0.0,
    descriptor: dict[str, Any] | None = None,
) -> Any | None:
    """Take the payload published under ``key`` on ``from_stage -> to_stage``.

    Waits up to ``timeout_s`` seconds (0: a single attempt) and returns the
    owned object, or ``None`` when nothing arrived in time. Exactly one
    receiver gets a given publication.
    """
    deadline = time.monotonic() + max(timeout_s, 0.0)
    r = conn.get_with_deadline(
        from_stage, to_stage, key, descriptor=descriptor, deadline=deadline
    )
    return None if r is None else r[0]


# The counters of ``health()``, shared by both sides.
_STATS = (
    "ring_puts",
    "ring_gets",
    "fallbacks",
    "fallback_too_large",
    "fallback_ring_full",
    "fallback_ring_unavailable",
    "perkey_puts",
    "perkey_gets",
    "put_failures",
    "put_no_space",
    "corrupt_frames",
    "dead_producer_frames",
    "dead_producers_pruned",
    "serializer_fallbacks",
    "discovery_scans",
    "rings_attached",
    "rings_released",
    "retired",
    "retire_deferred",
    "tombstones",
    "ring_waits",
    "ring_wait_timeouts",
    "ring_spilled",
    "evicted",
    "dead_producers_swept",
    "dead_segments_removed",
    "readable_puts",
    "readable_put_failures",
    "readables_withdrawn",
    "readables_evicted",
    "dead_readables_removed",
)
