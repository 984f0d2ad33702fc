# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed experts by reference: what a trainer imports to fetch them.

An engine serving ``routed_experts_format="ref"`` does not put a finished
request's routes into its response. It hands the array to the host
transport of its node under a fresh random key and returns a
:class:`RoutedExpertsRef` instead (``choices[i].routed_experts_ref`` over
HTTP, ``CompletionOutput.routed_experts_ref`` offline). A process of the
same user on that node turns the reference into the array::

    from vllm_host_transport.routed_experts import fetch

    routes = fetch(choice["routed_experts_ref"])   # [tokens, layers, top_k]

This module needs numpy, msgspec, xxhash and the transport's own modules,
never vLLM or torch, so a trainer with another vLLM (or none) imports it.
References of an engine serving ``ref_transport: mooncake`` name a Mooncake
Store's master instead; fetching those also needs Mooncake's client
(``mooncake-transfer-engine-non-cuda``), and works from any host that
reaches the master (``VLLM_MOONCAKE_LOCAL_HOSTNAME``: this host's address
for Mooncake's transfers, default ``127.0.0.1``).

A host-transport payload is handed over once: the first ``fetch`` takes
it, a second one finds it gone (at once: a reference is handed out only
after its payload is in place, so a miss is final); a Mooncake payload can
be read until it is removed. Payloads nobody fetches are removed by the
engine after its ``ref_ttl_s``, when more than ``ref_max_bytes`` or
65,536 of them wait, and when it stops (a killed engine's by the next
engine or ``fetch`` in its scope; Mooncake may also evict them under memory
pressure); ``fetch`` then raises :class:`RouteRefMissingError`. A payload
whose bytes do not match the reference raises
:class:`RouteRefCorruptError`, a transport that cannot be reached (or a
scope directory another user took) :class:`RouteRefTransportError`.
``fetch`` raises nothing but these :class:`RouteRefError` subclasses, and
never returns a partial array.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import xxhash  # type: ignore[import-not-found,unused-ignore]

#: The host-transport edge an engine hands routes on: (from, to).
EDGE = ("vllm-engine", "routed-experts")
#: Transports a reference can name.
TRANSPORTS = ("host", "mooncake")
#: dtypes routes come in.
DTYPES = ("uint8", "int16", "uint16", "int32")
_KEY_RE = re.compile(r"[0-9a-f]{32}\Z")
_CHECKSUM_RE = re.compile(r"[0-9a-f]{16}\Z")
_SHA256_RE = re.compile(r"([0-9a-f]{64})?\Z")
_MASTER_RE = re.compile(r"[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}\Z")
# Longest host scope a reference may name (its own plus fallbacks' suffixes).
_MAX_SCOPE_CHARS = 1024


class RouteRefError(RuntimeError):
    """Base class of every failure to turn a reference into routes."""


class RouteRefInvalidError(RouteRefError, ValueError):
    """The reference is malformed (not one an engine gave out)."""


class RouteRefMissingError(RouteRefError):
    """The payload is not there: fetched already, removed after the
    engine's TTL or byte bound, or the engine stopped."""


class RouteRefCorruptError(RouteRefError):
    """The payload's bytes do not match the reference."""


class RouteRefTransportError(RouteRefError):
    """The transport the reference names cannot be reached (a Mooncake
    master down, a client that cannot join it, a host-transport scope whose
    directory is not this user's private one)."""


class RoutedExpertsRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a finished request's routes wait, and what they are.

    ``fetch`` returns ``shape`` (``[rows, layers, top_k]`` of ``dtype``):
    row ``i`` holds the experts of token ``prompt_start + i`` of the
    request's prompt plus output. The stored payload (``nbytes``, xxh3-64
    ``checksum``, and over Mooncake its ``sha256``) may hold more rows than
    returned (the frontend cut the request at a stop string or an abort
    after the engine computed more)."""

    transport: str
    """``host``: the host transport of the engine's node; ``mooncake``: a
    Mooncake Store."""
    location: str
    """``host``: the scope the payload waits in (``<ref_scope>~<16 hex>``
    when the engine found its scope's directory taken by another user and
    fell back to a fresh private one); ``mooncake``: the master's
    ``host:port``."""
    key: str
    """The payload's key: 32 random hex characters, nothing derived from
    the request."""
    shape: tuple[int, int, int]
    dtype: str
    nbytes: int
    checksum: str
    prompt_start: int = 0
    sha256: str = ""
    """SHA-256 of the payload, hex: set on references over Mooncake, whose
    objects anyone who reaches the master could replace (xxh3-64 catches
    corruption, not crafted collisions); empty on the host transport (a
    private directory of the user). A reference without it (an engine
    before this field) is checked by ``checksum`` alone; a client before
    it ignores the field."""

    def to_json(self) -> dict[str, Any]:
        """The reference as JSON values (what HTTP responses carry)."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_json(cls, obj: Any) -> RoutedExpertsRef:
        """A reference from :meth:`to_json`'s dict (or its JSON text),
        checked field by field."""
        try:
            if isinstance(obj, str | bytes):
                ref = msgspec.json.decode(obj, type=cls)
            else:
                ref = msgspec.convert(obj, cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise RouteRefInvalidError(f"not a routed-experts reference: {e}") from e
        ref.check()
        return ref

    def check(self) -> None:
        """Raise :class:`RouteRefInvalidError` unless every field is one an
        engine could have written."""
        if self.transport not in TRANSPORTS:
            raise RouteRefInvalidError(
                f"unknown transport {self.transport!r}; this client knows "
                f"{', '.join(TRANSPORTS)}"
            )
        if self.transport == "mooncake" and not _MASTER_RE.match(self.location):
            raise RouteRefInvalidError("a Mooncake location must be host:port")
        if not 0 < len(self.location) <= _MAX_SCOPE_CHARS or "\0" in self.location:
            raise RouteRefInvalidError(
                f"a location must be 1 to {_MAX_SCOPE_CHARS} characters, no NUL"
            )
        if not isinstance(self.key, str) or not _KEY_RE.match(self.key):
            raise RouteRefInvalidError("key must be 32 lowercase hex characters")
        if not isinstance(self.checksum, str) or not _CHECKSUM_RE.match(self.checksum):
            raise RouteRefInvalidError("checksum must be 16 lowercase hex characters")
        if not _SHA256_RE.match(self.sha256):
            raise RouteRefInvalidError("sha256 must be empty or 64 lowercase hex")
        if self.dtype not in DTYPES:
            raise RouteRefInvalidError(f"dtype must be one of {', '.join(DTYPES)}")
        rows, layers, top_k = self.shape
        row_nbytes = layers * top_k * np.dtype(self.dtype).itemsize
        if min(rows, layers, top_k) < 0 or layers == 0 or top_k == 0:
            raise RouteRefInvalidError(f"bad shape {list(self.shape)}")
        if self.nbytes < rows * row_nbytes or self.nbytes % row_nbytes:
            raise RouteRefInvalidError(
                f"{self.nbytes} stored bytes cannot hold {rows} rows of "
                f"{row_nbytes} bytes"
            )
        if self.prompt_start < 0:
            raise RouteRefInvalidError("prompt_start must be >= 0")


def checksum_hex(data: Any) -> str:
    """The checksum a reference carries: xxh3-64 of the payload, hex."""
    return xxhash.xxh3_64_hexdigest(data)


def sha256_hex(data: Any) -> str:
    """The digest a reference over Mooncake carries: SHA-256 of the
    payload, hex."""
    return hashlib.sha256(data).hexdigest()


#: Most host-transport scopes whose connectors ``fetch`` keeps open; the
#: least recently used idle one is closed beyond it.
MAX_CONNECTORS = 16


class _Open:
    """A connector ``fetch`` keeps, and how many fetches use it now."""

    __slots__ = ("conn", "users")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.users = 0


_connectors: collections.OrderedDict[str, _Open] = collections.OrderedDict()
_connectors_lock = threading.Lock()


def close() -> None:
    """Let go of the transports ``fetch`` opened (also run at exit): the
    last process to leave a host-transport scope removes it."""
    with _connectors_lock:
        conns = [o.conn for o in _connectors.values()]
        _connectors.clear()
    for conn in conns:
        conn.close()
    if "vllm_host_transport.mooncake_refs" in sys.modules:
        sys.modules["vllm_host_transport.mooncake_refs"].close_clients()


atexit.register(close)


def _forget_after_fork() -> None:
    # A forked child (a data-loader worker) opens its own: the parent's
    # connectors and clients refuse to work in it.
    global _connectors_lock
    _connectors_lock = threading.Lock()
    _connectors.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


@contextlib.contextmanager
def _connector(scope: str) -> Iterator[Any]:
    """A connector of ``scope`` for one fetch. It only joins a scope whose
    directory exists (``ScopeMissingError`` otherwise: nothing is created
    for a stale or foreign name); at most :data:`MAX_CONNECTORS` are kept,
    the least recently used idle ones closed beyond it."""
    from vllm_host_transport import HostTransportConfig, HostTransportConnector

    with _connectors_lock:
        entry = _connectors.get(scope)
        if entry is None:
            entry = _Open(
                HostTransportConnector(
                    HostTransportConfig(scope=scope, create_scope=False)
                )
            )
            _connectors[scope] = entry
        _connectors.move_to_end(scope)
        entry.users += 1
        excess = len(_connectors) - MAX_CONNECTORS
        idle = [s for s, o in _connectors.items() if o.users == 0][: max(excess, 0)]
        closing = [_connectors.pop(s).conn for s in idle]
    for conn in closing:
        conn.close()
    try:
        yield entry.conn
    finally:
        with _connectors_lock:
            entry.users -= 1


def fetch(
    ref: RoutedExpertsRef | dict[str, Any] | str, timeout_s: float = 1.0
) -> np.ndarray:
    """The routes behind ``ref`` as a ``[rows, layers, top_k]`` array of
    this process's own, verified against its checksum. A host-transport
    payload is taken (a second fetch of the same reference raises
    :class:`RouteRefMissingError`, at once). ``timeout_s``: the longest a
    host fetch waits for a lock another process holds on the payload (a
    competing consumer, the engine moving it); for a Mooncake reference,
    the longest the process's first read from that master (and the first
    after a retry) waits for the master to answer the probe that precedes
    joining it (at least 1 s). Raises only
    :class:`RouteRefError` subclasses."""
    if isinstance(ref, RoutedExpertsRef):
        # msgspec does not validate a Struct built in code: its fields go
        # through the same typed decoding as a reference read from JSON.
        try:
            ref = msgspec.to_builtins(ref)
        except (TypeError, ValueError) as e:
            raise RouteRefInvalidError(f"not a routed-experts reference: {e}") from e
    ref = RoutedExpertsRef.from_json(ref)
    if ref.transport == "mooncake":
        # Imported here: mooncake_refs imports this module's types.
        from vllm_host_transport.mooncake_refs import take_from_mooncake

        raw = take_from_mooncake(ref, timeout_s)
    else:
        raw = _take_from_host(ref, timeout_s)
    if checksum_hex(raw) != ref.checksum:
        raise RouteRefCorruptError(f"routes {ref.key}: checksum mismatch")
    if ref.sha256 and sha256_hex(raw) != ref.sha256:
        raise RouteRefCorruptError(
            f"routes {ref.key}: SHA-256 mismatch (the stored object was replaced)"
        )
    rows, layers, top_k = ref.shape
    stored = raw.view(ref.dtype).reshape(-1, layers, top_k)
    return stored[:rows] if rows < stored.shape[0] else stored


def _take_from_host(ref: RoutedExpertsRef, timeout_s: float) -> np.ndarray:
    from vllm_host_transport import HostTransportError, ScopeMissingError

    try:
        # Copied out, never borrowed: a mapping of the claimed segment would
        # keep its pages charged to /dev/shm for as long as the trainer
        # holds the array, outside every engine's bound (r5 M6).
        # Published: the engine handed the reference out after its put.
        with _connector(ref.location) as conn:
            got = conn.get_with_deadline(
                EDGE[0],
                EDGE[1],
                ref.key,
                deadline=time.monotonic() + timeout_s,
                published=True,
            )
    except ScopeMissingError:
        got = None  # the engine and every other process left the scope
    except (HostTransportError, OSError) as e:
        raise RouteRefTransportError(
            f"host-transport scope {ref.location!r} cannot be used: {e}"
        ) from e
    if got is None:
        raise RouteRefMissingError(
            f"routes {ref.key} are not in host-transport scope {ref.location!r}: "
            "fetched already, removed after the engine's ref_ttl_s or "
            "ref_max_bytes, or the engine stopped"
        )
    payload, _ = got
    if not isinstance(payload, np.ndarray) or payload.nbytes != ref.nbytes:
        raise RouteRefCorruptError(
            f"routes {ref.key}: the payload is not the {ref.nbytes}-byte array "
            "the reference names"
        )
    if not payload.flags.writeable:
        # The transport hands arrays out read-only (leaves of one payload
        # may share a buffer); this payload is one array in memory of this
        # process's own, so the trainer may write it.
        try:
            payload.flags.writeable = True
        except ValueError:
            payload = payload.copy()
    return np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
