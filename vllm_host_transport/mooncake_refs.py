# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer's side of references over a Mooncake Store: one client per
master per process, and the read of one reference's payload.

Imported by :func:`vllm_host_transport.routed_experts.fetch` when a
reference names ``transport="mooncake"``; like that module it needs
neither vLLM nor torch (Mooncake's client only).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import numpy as np

from vllm_host_transport.routed_experts import (
    RoutedExpertsRef,
    RouteRefCorruptError,
    RouteRefMissingError,
    RouteRefTransportError,
)

_mooncake_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def close_clients() -> None:
    """Close this process's Mooncake clients (also run at exit)."""
    with _clients_lock:
        stores = list(_mooncake_clients.values())
        _mooncake_clients.clear()
    for store in stores:
        store.close()


atexit.register(close_clients)


def _forget_after_fork() -> None:
    # A forked child opens its own clients: the parent's refuse to work in it.
    global _clients_lock
    _clients_lock = threading.Lock()
    _mooncake_clients.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _mooncake(master: str) -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise RouteRefTransportError(
            f"fetching from a Mooncake Store needs its client ({e}): pip install "
            "mooncake-transfer-engine-non-cuda"
        ) from e
    with _clients_lock:
        store = _mooncake_clients.get(master)
        if store is None:
            store = MooncakeDistributedStore()
            rc = store.setup(
                os.environ.get("VLLM_MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
                "P2PHANDSHAKE",
                0,  # a reader contributes no memory to the pool
                int(os.environ.get("VLLM_MOONCAKE_BUFFER_BYTES", 256 << 20)),
                os.environ.get("VLLM_MOONCAKE_PROTOCOL", "tcp"),
                "",
                master,
            )
            if rc != 0:
                raise RouteRefTransportError(
                    f"cannot join the Mooncake Store of master {master} "
                    f"(setup returned {rc})"
                )
            _mooncake_clients[master] = store
        return store


def _forget_mooncake(master: str, store: Any) -> None:
    """Close this process's client of ``master`` after a failed read, so the
    next one joins afresh: a client that joined before a master restart, or
    holds a connection Mooncake left dead (its issue 4209), may keep
    failing where a new one reads."""
    with _clients_lock:
        current = _mooncake_clients.get(master)
        if current is None or id(current) != id(store):
            return  # another thread replaced it already
        del _mooncake_clients[master]
    store.close()


def take_from_mooncake(ref: RoutedExpertsRef) -> np.ndarray:
    """The payload ``ref`` names, as this process's own bytes (unverified:
    the caller checks the checksum)."""
    if ref.nbytes == 0:
        # No rows (routed_experts_prompt_start at the end): the engine puts
        # nothing, since Mooncake refuses empty objects; the reference alone
        # is the whole answer (its checksum is still verified).
        return np.empty(0, np.uint8)
    # A read that fails with the object present is tried once more on a
    # fresh client (see _forget_mooncake). One that fails with the master
    # silent is not: a client reconnects to a restarted master on its own,
    # and joining a master that is down takes Mooncake over a minute
    # (measured: a fetch then took 95 s instead of 4).
    for attempt in (1, 2):
        store = _mooncake(ref.location)
        data = store.get(ref.key)
        if data:
            break
        exists = store.is_exist(ref.key)
        if exists == 0:
            raise RouteRefMissingError(
                f"routes {ref.key} are not in the Mooncake Store of master "
                f"{ref.location}: removed after the engine's ref_ttl_s, evicted "
                "under memory pressure, or the engine stopped"
            )
        if exists < 0:
            raise RouteRefTransportError(
                f"the Mooncake Store of master {ref.location} cannot be reached "
                f"(is_exist returned {exists})"
            )
        _forget_mooncake(ref.location, store)
        if attempt == 2:
            raise RouteRefTransportError(
                f"routes {ref.key} are in the Mooncake Store of master "
                f"{ref.location} but cannot be read (also on a fresh client)"
            )
    if len(data) != ref.nbytes:
        raise RouteRefCorruptError(
            f"routes {ref.key}: {len(data)} bytes where the reference names "
            f"{ref.nbytes}"
        )
    return np.frombuffer(bytearray(data), np.uint8)
