# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the sending and the receiving side of one connector share: the
scope directory, the process that owns them, the counters, the watch on
the scope's other producers, and the names both sides derive from an edge
and a key."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from vllm_host_transport.config import HostTransportConfig
from vllm_host_transport.discovery import (
    HostTransportError,
    ProducerId,
    ScopeDir,
    hex_name,
)
from vllm_host_transport.liveness import Liveness

# This process's pid, kept current in forked children, so the hot paths can
# tell a connector inherited through a fork without a system call.
this_pid = os.getpid()


def _after_fork_in_child() -> None:
    global this_pid
    this_pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def edge_hex(from_stage: Any, to_stage: Any) -> str:
    return hex_name("edge", repr(from_stage), repr(to_stage))


_blake2b = hashlib.blake2b


def key_hash(key: str) -> bytes:
    """The 16-byte key hash stored in ring records and segment headers."""
    return _blake2b(key.encode(), digest_size=16).digest()


def seg_name(edge_hex: str, key: str) -> str:
    """Name of the per-key segment of (edge, key): a hash, never built from
    the key itself. Only computed when the per-key plane is used."""
    return _blake2b(
        edge_hex.encode() + b"\0" + key.encode(), digest_size=16, person=b"vhtseg"
    ).hexdigest()


class Shared:
    """One connector's scope and identity, shared by its two sides."""

    def __init__(
        self,
        config: HostTransportConfig,
        scope: ScopeDir,
        ident: ProducerId,
        stats: dict[str, int],
    ) -> None:
        self.config = config
        self.scope: ScopeDir | None = scope
        self.owner_pid = os.getpid()  # owns the rings and the membership
        self.ident = ident  # this process's identity
        self.stats = stats
        self.liveness = Liveness(scope, ident, stats, config.foreign_producer_ttl_s)
        self.closed = False

    def check_open(self) -> ScopeDir:
        scope = self.scope
        if self.closed or scope is None:
            raise HostTransportError("connector is closed")
        if self.owner_pid != this_pid:
            raise HostTransportError(
                f"connector belongs to process {self.owner_pid}; a forked "
                "child must create its own"
            )
        return scope
