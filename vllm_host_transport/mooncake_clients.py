# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer process's Mooncake clients: one per master, joined only after
the master answered a probe, closed at exit; and the registered staging
buffers the range reads (``mooncake_refs.py``) keep per client.

Joining and leaving a master (Mooncake's ``setup``, ``close``) hold the
interpreter lock, against a frozen master until it resumes: both run only
after the master answered a probe (``mooncake_probe.py``) within the
call's ``timeout_s`` (at least :data:`MIN_JOIN_TIMEOUT_S`). A master that
does not answer fails the call with :class:`RouteRefTransportError`, and
the next call asks again. Needs neither vLLM nor torch (Mooncake's client
only).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import numpy as np

from vllm_host_transport.mooncake_probe import describe_error, probe
from vllm_host_transport.routed_experts import RouteRefTransportError

#: The least time a fetch's first read from a master gives it to answer the
#: join probe (a child process's start counts in it).
MIN_JOIN_TIMEOUT_S = 1.0

_mooncake_clients: dict[str, Any] = {}
# Clients let go of while their master did not answer: closed once it does
# (closing one of a frozen master would freeze this process).
_unclosed: list[tuple[str, Any]] = []
_clients_lock = threading.Lock()
# Registered staging buffers of the range reads not in use, by client:
# id(client) -> (client, buffers).
_staging: dict[int, tuple[Any, list[np.ndarray]]] = {}
_staging_lock = threading.Lock()


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
    global _clients_lock, _staging_lock
    _clients_lock = threading.Lock()
    _staging_lock = threading.Lock()
    _mooncake_clients.clear()
    _unclosed.clear()
    _staging.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def joined(master: str, timeout_s: float) -> Any:
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


def forget(master: str, store: Any) -> None:
    """Close this process's client of ``master`` after a failed read, so the
    next one joins afresh: a client that joined before a master restart, or
    holds a connection Mooncake left dead (its issue 4209), may keep
    failing where a new one reads."""
    with _clients_lock:
        current = _mooncake_clients.get(master)
        if current is None or id(current) != id(store):
            return  # another thread replaced it already
        del _mooncake_clients[master]
    with _staging_lock:
        _staging.pop(id(store), None)  # registered with the client that goes
    _close_answered([(master, store)])


#: Staging buffers kept per client between reads, and the largest kept.
_STAGING_KEEP = 2
_STAGING_KEEP_BYTES = 256 << 20


def staging_take(store: Any, nbytes: int) -> np.ndarray:
    """A staging buffer of at least ``nbytes`` registered with ``store``."""
    with _staging_lock:
        held = _staging.get(id(store))
        free = held[1] if held is not None and held[0] is store else []
        fits = [i for i, b in enumerate(free) if b.nbytes >= nbytes]
        if fits:
            return free.pop(min(fits, key=lambda i: free[i].nbytes))
    buf = np.empty(max(nbytes, 1 << 20), np.uint8)
    rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RouteRefTransportError(
            f"Mooncake's client cannot register a {buf.nbytes}-byte read "
            f"buffer: {describe_error(rc)}"
        )
    return buf


def staging_put(location: str, store: Any, buf: np.ndarray | None) -> None:
    """Give a staging buffer back for the next read on ``store`` while that
    is still this process's client of ``location`` (else let it go: one
    forgotten is closed, or left to the exit, with its registrations)."""
    if buf is None:
        return
    with _staging_lock:
        if id(_mooncake_clients.get(location)) != id(store):
            return
        free = _staging.setdefault(id(store), (store, []))[1]
        if buf.nbytes <= _STAGING_KEEP_BYTES and len(free) < _STAGING_KEEP:
            free.append(buf)
            return
    store.unregister_buffer(buf.ctypes.data)
