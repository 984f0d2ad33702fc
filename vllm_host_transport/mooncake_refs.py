# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer's side of references over a Mooncake Store: one client per
master per process, and the read of one reference's payload.

Imported by :func:`vllm_host_transport.routed_experts.fetch` when a
reference names ``transport="mooncake"``; like that module it needs
neither vLLM nor torch (Mooncake's client only).

Joining and leaving a master (Mooncake's ``setup``, ``close``) hold the
interpreter lock, against a frozen master until it resumes: both run only
after the master answered a probe (``mooncake_probe.py``) within the
fetch's ``timeout_s`` (at least :data:`MIN_JOIN_TIMEOUT_S`). A master that
does not answer fails the fetch with :class:`RouteRefTransportError`, and
the next fetch asks again. Reads on a joined client (``get``,
``is_exist``) release the lock while they wait.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import numpy as np

from vllm_host_transport.mooncake_probe import describe_error, probe
from vllm_host_transport.routed_experts import (
    RoutedExpertsRef,
    RouteRefCorruptError,
    RouteRefMissingError,
    RouteRefTransportError,
)

#: The least time a fetch's first read from a master gives it to answer the
#: join probe (a child process's start counts in it).
MIN_JOIN_TIMEOUT_S = 1.0

_mooncake_clients: dict[str, Any] = {}
# Clients let go of while their master did not answer: closed once it does
# (closing one of a frozen master would freeze this process).
_unclosed: list[tuple[str, Any]] = []
_clients_lock = threading.Lock()


def close_clients() -> None:
    """Close this process's Mooncake clients (also run at exit); a client
    whose master does not answer a probe is left to the process's exit."""
    with _clients_lock:
        stores = list(_mooncake_clients.items()) + _unclosed
        _mooncake_clients.clear()
        _unclosed.clear()
    _close_answered(stores)


def _close_answered(stores: list[tuple[str, Any]]) -> None:
    answered: dict[str, bool] = {}
    for master, store in stores:
        if master not in answered:
            answered[master] = probe(master, **_probe_args()) is None
        if answered[master]:
            store.close()
        else:
            with _clients_lock:
                _unclosed.append((master, store))


def _probe_args(timeout_s: float = MIN_JOIN_TIMEOUT_S) -> dict[str, Any]:
    return {
        "timeout_s": max(timeout_s, MIN_JOIN_TIMEOUT_S),
        "protocol": os.environ.get("VLLM_MOONCAKE_PROTOCOL", "tcp"),
        "local_hostname": os.environ.get("VLLM_MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
    }


atexit.register(close_clients)


def _forget_after_fork() -> None:
    # A forked child opens its own clients: the parent's refuse to work in it.
    global _clients_lock
    _clients_lock = threading.Lock()
    _mooncake_clients.clear()
    _unclosed.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _mooncake(master: str, timeout_s: float) -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise RouteRefTransportError(
            f"fetching from a Mooncake Store needs its client ({e}): pip install "
            "mooncake-transfer-engine-non-cuda"
        ) from e
    args = _probe_args(timeout_s)
    # Another thread may be probing: wait for it no longer than a probe.
    if not _clients_lock.acquire(timeout=args["timeout_s"]):
        raise RouteRefTransportError(
            f"cannot join the Mooncake Store of master {master}: another "
            "thread of this process is still joining it"
        )
    try:
        store = _mooncake_clients.get(master)
        if store is None:
            why = probe(master, **args)
            if why is not None:
                raise RouteRefTransportError(
                    f"cannot join the Mooncake Store of master {master}: {why}"
                )
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
                    f"cannot join the Mooncake Store of master {master}: "
                    f"setup failed: {describe_error(rc)}"
                )
            _mooncake_clients[master] = store
        return store
    finally:
        _clients_lock.release()


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
    _close_answered([(master, store)])


def take_from_mooncake(ref: RoutedExpertsRef, timeout_s: float) -> np.ndarray:
    """The payload ``ref`` names, as this process's own bytes (unverified:
    the caller checks the checksum). ``timeout_s`` bounds joining the master
    (see the module docs)."""
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
        store = _mooncake(ref.location, timeout_s)
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
                f"the Mooncake Store of master {ref.location} cannot say whether "
                f"routes {ref.key} are there: {describe_error(exists)}"
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
