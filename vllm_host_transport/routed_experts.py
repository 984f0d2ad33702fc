# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed experts by reference: what a trainer imports to read them.

An engine serving ``routed_experts_format="ref"`` does not put a finished
request's routes into its response. It stores them once, under a fresh
random key, in the host transport of its node (or a Mooncake Store) and
returns a :class:`RoutedExpertsRef` instead (``choices[i].routed_experts_ref``
over HTTP, ``CompletionOutput.routed_experts_ref`` offline). Any number of
processes read it, each only the slice it needs::

    from vllm_host_transport.routed_experts import fetch
    from vllm_host_transport.routes_reader import read, read_batch, release

    routes = fetch(ref)                      # [tokens, layers, top_k], whole
    mine = read(ref, tokens=slice(0, 512), layers=range(12, 24), dtype="int64")
    release([ref])                           # the driver, once every rank read

This module needs numpy, msgspec, xxhash and the transport's own modules,
never vLLM or torch, so a trainer with another vLLM (or none) imports it.
References of an engine serving ``ref_transport: mooncake`` name a Mooncake
Store's master instead; reading those also needs Mooncake's client
(``mooncake-transfer-engine-non-cuda``), and works from any host that
reaches the master (``VLLM_MOONCAKE_LOCAL_HOSTNAME``: this host's address
for Mooncake's transfers, default ``127.0.0.1``).

A payload can be read until it is released (:func:`~.routes_reader.release`
by the driver, or by the last of ``readers`` ranks), its weight version is
retired (``ref_versions_kept``), its ``ref_ttl_s`` passes, more than
``ref_max_bytes`` or 65,536 of them wait (oldest first), or the engine
stops; a read after that raises :class:`RouteRefMissingError` at once. A
payload whose bytes do not match the reference raises
:class:`RouteRefCorruptError`, a transport that cannot be reached (or a
scope directory another user took) :class:`RouteRefTransportError`.
Reads raise nothing but these :class:`RouteRefError` subclasses, and never
return a partial array.
"""

from __future__ import annotations

import atexit
import re
import sys
from typing import Any

import msgspec
import numpy as np

from vllm_host_transport.routes_format import FORMAT, EncodedRoutes

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
#: Largest header a reference may name (a 1M-token request of 128 layers
#: with SHA-256 chunk digests takes 4 MiB).
MAX_HEADER_NBYTES = 16 << 20


class RouteRefError(RuntimeError):
    """Base class of every failure to turn a reference into routes."""


class RouteRefInvalidError(RouteRefError, ValueError):
    """The reference is malformed (not one an engine gave out)."""


class RouteRefMissingError(RouteRefError):
    """The payload is not there: released, retired with its weight version,
    removed after the engine's TTL or byte bound, or the engine stopped."""


class RouteRefCorruptError(RouteRefError):
    """The payload's bytes do not match the reference."""


class RouteRefTransportError(RouteRefError):
    """The transport the reference names cannot be reached (a Mooncake
    master down, a client that cannot join it, a host-transport scope whose
    directory is not this user's private one)."""


class RoutedExpertsRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a finished request's routes wait, and what they are.

    Reads return rows of ``shape`` (``[rows, layers, top_k]`` of ``dtype``):
    row ``i`` holds the experts of token ``prompt_start + i`` of the
    request's prompt plus output. The stored object (``routes_format.py``:
    a header of ``header_nbytes`` bytes, then ``nbytes`` bytes of
    layer-major routes) may hold more rows than returned (the frontend cut
    the request at a stop string or an abort after the engine computed
    more). ``checksum`` (xxh3-64) and, over Mooncake, ``sha256`` are the
    header's, which holds a digest of every chunk of the body."""

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
    """Bytes of the stored body (every stored row)."""
    checksum: str
    prompt_start: int = 0
    sha256: str = ""
    """SHA-256 of the header, hex: set on references over Mooncake, whose
    objects anyone who reaches the master could replace (xxh3-64 catches
    corruption, not crafted collisions; the header's chunk digests are
    SHA-256 there too); empty on the host transport (a private directory of
    the user)."""
    format: int = 1
    """The stored form (``routes_format.FORMAT``). A reference without it
    comes from an engine before read-many references (a whole array, taken
    once), which this client does not read."""
    header_nbytes: int = 0
    block_rows: int = 0
    """Rows per digested chunk of the body."""
    weight_version: str = ""
    """The engine's weight version when the request's rows were computed
    (``update_weight_version``; ``"default"`` when never set). If a weight
    update came while the request ran, its rows span versions; this names
    the versions in row order, joined by ``","``."""
    key_space: str = ""
    """The engine's ``key_space`` (routes shared through a Mooncake Store),
    empty without one."""

    @classmethod
    def for_payload(
        cls,
        payload: EncodedRoutes,
        *,
        transport: str,
        location: str,
        key: str,
        prompt_start: int = 0,
        weight_version: str = "",
        key_space: str = "",
    ) -> RoutedExpertsRef:
        """The reference to ``payload`` (``routes_format.encode``'s) stored
        under ``key`` at ``location``: what an engine hands out."""
        layers, rows, top_k = payload.body.shape
        return cls(
            transport=transport,
            location=location,
            key=key,
            shape=(rows, layers, top_k),
            dtype=payload.body.dtype.name,
            nbytes=payload.body.nbytes,
            checksum=payload.header_digest_hex("xxh3_64"),
            prompt_start=prompt_start,
            sha256=(
                payload.header_digest_hex("sha256")
                if payload.digest == "sha256"
                else ""
            ),
            format=FORMAT,
            header_nbytes=len(payload.header),
            block_rows=payload.block_rows,
            weight_version=weight_version,
            key_space=key_space,
        )

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
        if self.transport == "mooncake" and not self.sha256:
            # Objects anyone who reaches the master could replace are read
            # only against a digest no one can forge bytes to.
            raise RouteRefInvalidError("a Mooncake reference must carry sha256")
        if self.dtype not in DTYPES:
            raise RouteRefInvalidError(f"dtype must be one of {', '.join(DTYPES)}")
        if self.format != FORMAT:
            raise RouteRefInvalidError(
                f"a reference of stored form {self.format}, this client reads "
                f"{FORMAT}: the engine and the trainer need the same release of "
                "vllm_host_transport"
            )
        rows, layers, top_k = self.shape
        row_nbytes = layers * top_k * np.dtype(self.dtype).itemsize
        if min(rows, layers, top_k) < 0 or layers == 0 or top_k == 0:
            raise RouteRefInvalidError(f"bad shape {list(self.shape)}")
        if self.nbytes < rows * row_nbytes or self.nbytes % row_nbytes:
            raise RouteRefInvalidError(
                f"{self.nbytes} stored bytes cannot hold {rows} rows of "
                f"{row_nbytes} bytes"
            )
        if not 0 < self.header_nbytes <= MAX_HEADER_NBYTES or self.header_nbytes % 64:
            raise RouteRefInvalidError(
                f"header_nbytes must be a multiple of 64 up to {MAX_HEADER_NBYTES}"
            )
        if not 0 < self.block_rows < 1 << 31:
            raise RouteRefInvalidError("block_rows must be positive")
        if self.prompt_start < 0:
            raise RouteRefInvalidError("prompt_start must be >= 0")

    @property
    def stored_rows(self) -> int:
        rows, layers, top_k = self.shape
        return self.nbytes // (layers * top_k * np.dtype(self.dtype).itemsize)


def close() -> None:
    """Let go of the Mooncake clients this process joined to read (also run
    at exit). Host-transport reads hold nothing between calls."""
    if "vllm_host_transport.mooncake_clients" in sys.modules:
        sys.modules["vllm_host_transport.mooncake_clients"].close_clients()


def as_ref(ref: RoutedExpertsRef | dict[str, Any] | str | bytes) -> RoutedExpertsRef:
    """``ref`` (a reference, its JSON dict or text) checked field by field:
    a :class:`RoutedExpertsRef` built in code goes through the same typed
    decoding as one read from JSON (msgspec does not validate a Struct
    built by its constructor)."""
    if isinstance(ref, RoutedExpertsRef):
        try:
            ref = msgspec.to_builtins(ref)
        except (TypeError, ValueError) as e:
            raise RouteRefInvalidError(f"not a routed-experts reference: {e}") from e
    return RoutedExpertsRef.from_json(ref)


def fetch(
    ref: RoutedExpertsRef | dict[str, Any] | str, timeout_s: float = 10.0
) -> np.ndarray:
    """The routes behind ``ref``, whole: a ``[rows, layers, top_k]`` array
    of this process's own, every chunk verified (``routes_reader.read``
    with no selection). The payload stays for other readers until it is
    released. ``timeout_s``: for a Mooncake reference, the longest the read
    takes, joining the master included (a host read never waits). Raises
    only :class:`RouteRefError` subclasses."""
    from vllm_host_transport.routes_reader import read

    return read(ref, timeout_s=timeout_s)


atexit.register(close)
