# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Backend-neutral contract for immutable artifact objects.

A store maps *keys* (64 lowercase hex characters: a 32-byte digest) to
immutable byte strings. It knows nothing about requests, tokens or routed
experts; that lives in ``request_core``. Two roles:

* :class:`ObjectStoreWriter` (one per store, owned by the publishing
  worker): ``put_batch`` publishes many objects at once, ``retain`` /
  ``release`` protect objects a live request attempt needs from eviction,
  ``lookup`` resolves keys to exact versions.
* :class:`ObjectStoreReader` (any process of the same user): ``read_into``
  verifies every object's checksum, lets the caller check what it read,
  and only then copies the requested bytes into the caller's buffer.

Divergence (a put of *different* bytes under an existing key) stores the
new bytes as a new *version* that becomes the key's current one; the old
version stays readable by exact reference (:class:`ObjectRef`, key plus
checksum) while it is retained. Nothing is overwritten in place.
See ``docs/design/artifact_connector.md``.
"""

from __future__ import annotations

import enum
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash  # type: ignore[import-not-found,unused-ignore]

KEY_HEX_LEN = 64
KEY_NBYTES = KEY_HEX_LEN // 2
_KEY_RE = re.compile(r"[0-9a-f]{64}\Z")

#: Checksum of every stored object (xxh3-64, ``bytes-like -> int``).
checksum = xxhash.xxh3_64_intdigest


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------
class ArtifactError(RuntimeError):
    """Base class of every Artifact Connector failure. Artifact mode fails
    closed: callers turn these into a request error, never into a partial
    or zero-filled result."""


class ArtifactStoreError(ArtifactError):
    """Base class of every artifact store failure."""


class InvalidKeyError(ArtifactStoreError, ValueError):
    """A key is not 64 lowercase hex characters."""


class StoreCapacityError(ArtifactStoreError):
    """The store cannot take the objects without evicting retained ones, or
    the file system under it is full."""


class ObjectMissingError(ArtifactStoreError, KeyError):
    """The requested key (or exact version) is not in the store."""

    def __str__(self) -> str:  # KeyError would quote the message.
        return str(self.args[0]) if self.args else "object missing"


class ChecksumMismatchError(ArtifactStoreError):
    """Stored bytes do not match the checksum recorded at publication."""


class ObjectSizeError(ArtifactStoreError):
    """A read asked for bytes outside an object."""


class StoreClosedError(ArtifactStoreError):
    """The store was closed, or its backing storage disappeared."""


class UnsafeStoreError(ArtifactStoreError):
    """The backing storage failed a safety check (location, owner, mode,
    symlink, unexpected entry)."""


class StoreIOError(ArtifactStoreError):
    """The backing storage failed for a reason other than capacity."""


# --------------------------------------------------------------------------
# Keys and values
# --------------------------------------------------------------------------
def validate_key(key: str) -> str:
    """Return ``key`` if it is 64 lowercase hex characters, else raise
    :class:`InvalidKeyError`. Keys never become file names, but the rule
    keeps path separators, NULs and ``..`` out of every backend."""
    if not isinstance(key, str) or _KEY_RE.match(key) is None:
        raise InvalidKeyError(
            f"artifact key must be {KEY_HEX_LEN} lowercase hex characters, "
            f"got {key!r:.80}"
        )
    return key


def keys_to_bytes(keys: Sequence[str]) -> bytes:
    """The keys' 32-byte digests concatenated; raises
    :class:`InvalidKeyError` naming the first bad key."""
    joined = "".join(keys) if all(type(k) is str for k in keys) else None
    if joined is not None and len(joined) == KEY_HEX_LEN * len(keys):
        try:
            raw = bytes.fromhex(joined)
        except ValueError:
            raw = b""
        # fromhex accepts upper case; the round trip insists on lower case.
        if raw.hex() == joined:
            return raw
    for k in keys:
        validate_key(k)
    raise InvalidKeyError("invalid artifact key")  # pragma: no cover


class PutStatus(enum.IntEnum):
    """What a put did for one key."""

    WRITTEN = 1  # the key was new
    IDENTICAL = 2  # the key had these bytes already; nothing written
    DIVERGED = 3  # the key had different bytes; a new version was stored


class ObjectRef(NamedTuple):
    """An exact reference to one version of an object."""

    key: str
    checksum: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PutResult:
    """Outcome of ``put_batch``, one entry per input object, in order."""

    refs: tuple[ObjectRef, ...]
    statuses: tuple[PutStatus, ...]

    def count(self, status: PutStatus) -> int:
        return sum(1 for s in self.statuses if s == status)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of a store (writer: authoritative; reader: what it saw)."""

    objects: int = 0  # live versions
    keys: int = 0
    used_bytes: int = 0  # arenas (spare included) + index log
    capacity_bytes: int = 0
    retained_keys: int = 0
    retainers: int = 0
    puts_written: int = 0
    puts_identical: int = 0
    divergences: int = 0
    evicted_objects: int = 0
    relocated_objects: int = 0
    checksum_failures: int = 0
    arenas_started: int = 0
    arenas_started_on_demand: int = 0  # no spare was ready: a put paid it
    log_compactions: int = 0
    stores_collected: int = 0
    stores_recreated: int = 0  # removed behind the writer, started again
    arenas_lost: int = 0  # arena files deleted behind the writer
    space_evictions: int = 0  # evictions because /dev/shm itself was full
    space_compactions: int = 0  # index log compactions, likewise
    # backend mooncake: objects mirrored into the shared tier, pulled from
    # it (computed by other engines), its writes that failed, and shared
    # objects that failed their checks (authentication included)
    shared_puts: int = 0
    shared_pulls: int = 0
    shared_failures: int = 0
    shared_rejected: int = 0


#: ``put_batch``'s fill callback: gets a writable uint8 buffer for the
#: objects back to back; returns their checksums (:data:`checksum` over each
#: whole object) if it computed them, else ``None`` and the store hashes.
FillFn = Callable[[np.ndarray], "np.ndarray | None"]

#: ``read_into``'s check callback: gets the objects' trailers ``[n, T]`` and
#: lengths after every checksum passed and before anything is copied; it
#: raises to abort the read with the caller's buffer untouched.
CheckFn = Callable[[np.ndarray, np.ndarray], None]


# --------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------
class ObjectStoreWriter(ABC):
    """The writing side of a store. Thread-safe: the worker's publication
    thread puts, retains, releases, looks up and runs the upkeep while the
    engine's thread reads ``stats``; implementations serialise their
    methods (the ``/dev/shm`` writer with one lock)."""

    @abstractmethod
    def put_batch(
        self,
        keys: Sequence[str],
        lengths: np.ndarray,
        fill: FillFn,
        *,
        owners: Sequence[str] | None = None,
    ) -> PutResult:
        """Publish ``len(keys)`` objects of the given ``lengths`` that
        ``fill`` writes back to back into store memory (copied once). The
        batch becomes visible to readers at once, complete; with ``owners``
        object ``i`` is retained for ``owners[i]`` (see :meth:`retain`).
        ``fill`` must not keep the buffer after it returns."""

    @abstractmethod
    def retain(self, owner: str, keys: Iterable[str]) -> None:
        """Protect every version of ``keys`` from eviction until
        ``release(owner)``. Keys not published yet are protected from the
        moment they are (a sibling may publish them later)."""

    @abstractmethod
    def release(self, owner: str) -> int:
        """Drop everything ``owner`` retained; returns how many keys it held.
        Unknown owners are a no-op."""

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> list[ObjectRef | None]:
        """The current version of each key (``None`` where absent)."""

    def maintain(self) -> None:  # noqa: B027 - optional hook
        """Slow upkeep, for the owner's idle moments (default: none)."""

    def mirroring(self, keys: Sequence[str]) -> list[threading.Event]:
        """Events to wait for, briefly and boundedly, before an
        acknowledgement naming ``keys`` leaves (set once they are visible
        to the other engines it may send to them); default: none, as
        :meth:`put_batch` makes them visible."""
        return []

    def pull(self, tag: str, keys: Sequence[str], wake: Callable[[], None]) -> bool:
        """Start copying into this store those of ``keys`` it lacks that a
        tier behind it holds; returns False when a copy started (``wake``
        is called from another thread when it ends, and :meth:`pulled` then
        names ``tag``), True when it ended at once (nothing to do, or no
        tier to ask now). Default: no tier behind the store."""
        return True

    def pulled(self) -> list[str]:
        """The tags of the pulls that ended since the last call: what the
        tier had of their keys is in this store now."""
        return []

    @abstractmethod
    def stats(self) -> StoreStats:
        """Counters (see :class:`StoreStats`)."""

    @abstractmethod
    def close(self) -> None:
        """Release resources and remove the store's storage; idempotent."""


class ObjectStoreReader(ABC):
    """The reading side of a store (any process of the store's user). Not
    thread-safe: one thread uses it (the scheduler's route reader)."""

    @abstractmethod
    def read_into(
        self,
        keys: Sequence[str],
        checksums: np.ndarray,
        out: np.ndarray,
        spans: np.ndarray,
        *,
        trailer_nbytes: int = 0,
        check: CheckFn | None = None,
    ) -> None:
        """Read the exact versions ``(keys[i], checksums[i])``: verify each
        object's checksum, hand the objects' last ``trailer_nbytes`` bytes
        and lengths to ``check``, then copy ``spans[i] = (offset in object
        i, nbytes, offset in out)`` into ``out`` (1-D, writable,
        C-contiguous uint8). Every failure raises a typed error before
        ``out`` is written. (Columns rather than :class:`ObjectRef` objects:
        a 32k-token request reads 2,048 objects.)"""

    @abstractmethod
    def close(self) -> None:
        """Release mappings and descriptors; idempotent."""
