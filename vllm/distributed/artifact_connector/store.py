# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Backend-neutral contract for immutable artifact objects.

A store maps *keys* (64 lowercase hex characters, i.e. a 32-byte digest) to
immutable byte strings. It knows nothing about requests, tokens or routed
experts: that knowledge lives in ``request_core``. Every backend verifies a
checksum on every read and hands out values (``bytes`` or private numpy
buffers), never paths or live mappings.

Divergence (a put of *different* bytes under an existing key) is handled by
versioning: the new bytes become a new *version* of the key and the key's
current version; the previous version stays readable by exact reference
(``key`` + ``checksum``) while it is pinned. Nothing is overwritten in place.
See ``docs/design/artifact_connector.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

KEY_HEX_LEN = 64
KEY_NBYTES = KEY_HEX_LEN // 2
_KEY_RE = re.compile(r"[0-9a-f]{64}\Z")

Payload = bytes | bytearray | memoryview


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------
class ArtifactError(RuntimeError):
    """Base class of every Artifact Connector failure (store, envelope,
    coverage, buffer). Artifact mode fails closed: callers turn these into a
    request error, never into a partial or zero-filled result."""


class ArtifactStoreError(ArtifactError):
    """Base class of every artifact store failure."""


class InvalidKeyError(ArtifactStoreError, ValueError):
    """A key is not 64 lowercase hex characters."""


class StoreCapacityError(ArtifactStoreError):
    """The store cannot hold the objects without evicting pinned ones."""


class ObjectDivergenceError(ArtifactStoreError):
    """A put carried different bytes for an existing key (strict mode only),
    or a reader asked for a version of a key that has been superseded."""


class ObjectMissingError(ArtifactStoreError, KeyError):
    """The requested key (or key version) is not in the store."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise.
        return str(self.args[0]) if self.args else "object missing"


class ChecksumMismatchError(ArtifactStoreError):
    """Stored bytes do not match the checksum recorded at publication."""


class StoreClosedError(ArtifactStoreError):
    """The store was closed (or its backing storage disappeared)."""


class UnsafeStoreError(ArtifactStoreError):
    """The backing storage failed a safety check (location, owner, mode,
    symlink, unexpected entry)."""


class ReadOnlyStoreError(ArtifactStoreError):
    """A mutation was attempted through a reader."""


class ObjectSizeError(ArtifactStoreError):
    """An object's stored size is not the size the reader expects
    (:meth:`ObjectStore.get_split`). ``index`` is the object's position in
    the request."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


# --------------------------------------------------------------------------
# Keys and checksums
# --------------------------------------------------------------------------
def validate_key(key: str) -> str:
    """Return ``key`` if it is 64 lowercase hex characters, else raise
    :class:`InvalidKeyError`. Keys never reach the file system as names, but
    the hex-only rule is enforced everywhere so that no key can smuggle a
    path separator, a NUL or ``..`` into any backend."""
    if not isinstance(key, str) or _KEY_RE.match(key) is None:
        raise InvalidKeyError(
            f"artifact key must be {KEY_HEX_LEN} lowercase hex characters, "
            f"got {key!r:.80}"
        )
    return key


class ChecksumAlgorithm(enum.IntEnum):
    """Checksum algorithms a store may record. The id is persisted."""

    CRC32 = 1
    XXH3_64 = 2


_XXH3: Callable[[Payload], int] | None
# Streaming xxh3-64 state (``xxhash.xxh3_64``): one pass over a payload gives
# both the payload's digest and, after ``update(trailer)``, the digest of
# payload + trailer.
XXH3State: Any
try:  # A fork requirement (requirements/fork.txt); see default_checksum.
    import xxhash as _xxhash  # type: ignore[import-not-found,unused-ignore]

    _XXH3 = _xxhash.xxh3_64_intdigest
    XXH3State = _xxhash.xxh3_64
except ImportError:  # pragma: no cover - depends on the environment
    _XXH3 = None
    XXH3State = None


def available_checksums() -> tuple[ChecksumAlgorithm, ...]:
    """Checksum algorithms usable in this process."""
    if _XXH3 is not None:
        return (ChecksumAlgorithm.CRC32, ChecksumAlgorithm.XXH3_64)
    return (ChecksumAlgorithm.CRC32,)


def _require_xxhash() -> Callable[[Payload], int]:
    if _XXH3 is None:
        raise ArtifactStoreError(
            "artifact stores checksum with xxh3-64, which needs the 'xxhash' "
            "package (a requirement of this fork): pip install xxhash"
        )
    return _XXH3


def default_checksum() -> ChecksumAlgorithm:
    """xxh3-64 (about 4x faster than zlib's CRC-32 here). Raises a clear
    :class:`ArtifactStoreError` if ``xxhash`` is not installed; CRC-32 can
    still be chosen explicitly."""
    _require_xxhash()
    return ChecksumAlgorithm.XXH3_64


def checksum_function(algorithm: ChecksumAlgorithm) -> Callable[[Payload], int]:
    """The one-shot function ``bytes-like -> int`` of ``algorithm``."""
    if algorithm == ChecksumAlgorithm.CRC32:
        return zlib.crc32
    if algorithm == ChecksumAlgorithm.XXH3_64:
        return _require_xxhash()
    raise ArtifactStoreError(f"unknown checksum algorithm id {int(algorithm)}")


def compute_checksum(algorithm: ChecksumAlgorithm, data: Payload) -> int:
    """Checksum of ``data`` as an unsigned integer (< 2**64)."""
    return int(checksum_function(algorithm)(data))


# --------------------------------------------------------------------------
# Results and batches
# --------------------------------------------------------------------------
class PutStatus(enum.IntEnum):
    """What a put did for one key."""

    WRITTEN = 1  # the key was new
    IDENTICAL = 2  # the key existed with the same bytes; nothing written
    DIVERGED = 3  # the key existed with different bytes; new version stored


class ObjectRef(NamedTuple):
    """An exact reference to one version of an object (an immutable named
    tuple: cheap to create in bulk)."""

    key: str
    checksum: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PutResult:
    """Outcome of a (batched) put, one entry per input item, in order."""

    refs: tuple[ObjectRef, ...]
    statuses: tuple[PutStatus, ...]

    @property
    def num_written(self) -> int:
        return sum(1 for s in self.statuses if s == PutStatus.WRITTEN)

    @property
    def num_identical(self) -> int:
        return sum(1 for s in self.statuses if s == PutStatus.IDENTICAL)

    @property
    def num_diverged(self) -> int:
        return sum(1 for s in self.statuses if s == PutStatus.DIVERGED)


@dataclass(slots=True)
class StoreStats:
    """Counters exposed by every backend."""

    objects: int = 0  # live versions
    keys: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    pinned_keys: int = 0
    puts_written: int = 0
    puts_identical: int = 0
    divergences: int = 0
    evicted_objects: int = 0
    relocated_objects: int = 0
    checksum_failures: int = 0
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ObjectBatch:
    """Values of several objects, copied into one private buffer.

    ``view(i)`` is object ``i`` (in the order requested). The buffer belongs
    to the caller; nothing in it aliases store memory.
    """

    data: np.ndarray  # uint8, 1-D
    offsets: np.ndarray  # int64, one per object
    lengths: np.ndarray  # int64, one per object
    checksums: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def view(self, i: int) -> memoryview:
        off = int(self.offsets[i])
        return self.data.data[off : off + int(self.lengths[i])]

    def tobytes(self, i: int) -> bytes:
        return bytes(self.view(i))

    @classmethod
    def from_values(
        cls, values: Sequence[Payload], checksums: Sequence[int]
    ) -> ObjectBatch:
        lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
        offsets = np.zeros(len(values), np.int64)
        if len(values) > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        data = np.empty(int(lengths.sum()), np.uint8)
        for off, ln, v in zip(offsets.tolist(), lengths.tolist(), values):
            data[off : off + ln] = np.frombuffer(v, np.uint8)
        return cls(data, offsets, lengths, tuple(checksums))


@dataclass(frozen=True, slots=True)
class SplitBatch:
    """Result of :meth:`ObjectStore.get_split`: the objects' trailers (the
    last ``trailer_nbytes`` bytes of each, ``[n, trailer_nbytes]`` uint8, a
    private copy), their total lengths and checksums. The bodies were
    copied back to back into the caller's ``out`` buffer."""

    trailers: np.ndarray
    lengths: np.ndarray
    checksums: np.ndarray  # uint64


KeyOrRef = str | ObjectRef

# put_packed's fill callback: gets a writable uint8 buffer holding the
# objects back to back; returns their checksums (store algorithm, whole
# objects) if it computed them, else None.
FillFn = Callable[[np.ndarray], "np.ndarray | Sequence[int] | None"]


def validate_keys(keys: Sequence[str]) -> bytes:
    """Validate many keys at C speed; returns their 32-byte digests
    concatenated. Raises :class:`InvalidKeyError` naming the first bad key."""
    try:
        if set(map(type, keys)) <= {str} and set(map(len, keys)) <= {KEY_HEX_LEN}:
            joined = "".join(keys)
            raw = bytes.fromhex(joined)
            if raw.hex() == joined:
                return raw
    except ValueError:
        pass
    for k in keys:
        validate_key(k)
    raise InvalidKeyError("invalid artifact key")  # pragma: no cover


# --------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------
class ObjectStore(ABC):
    """Immutable-object store contract.

    * ``put``/``put_many`` publish objects atomically (all-or-nothing per
      object; a batch is published in one step where the backend can).
    * ``get``/``get_many``/``get_batch`` take keys (current version) or
      :class:`ObjectRef` (exact version) and verify checksums.
    * ``pin``/``unpin`` protect objects a live request needs from eviction.
    * Every method raises :class:`StoreClosedError` after ``close``.
    """

    @abstractmethod
    def put_many(
        self, items: Sequence[tuple[str, Payload]], *, pin: bool = False
    ) -> PutResult:
        """Publish ``(key, bytes)`` items; optionally pin them atomically."""

    def put_packed(
        self,
        keys: Sequence[str],
        lengths: Sequence[int] | np.ndarray,
        fill: FillFn,
        *,
        pin: bool = False,
    ) -> PutResult:
        """Publish ``len(keys)`` objects of the given ``lengths`` that
        ``fill`` writes back to back into a buffer the store provides (for
        the SHM backend: the arena itself, so the bytes are copied once).

        ``fill`` may return the objects' checksums, computed with
        :attr:`checksum_algorithm` over each whole object; the store then
        records them instead of hashing again. A wrong value can only make
        later reads fail with :class:`ChecksumMismatchError`, never return
        other bytes. ``fill`` must not keep the buffer (or views of it) after
        it returns: for the SHM backend it is the published arena memory.
        Same semantics as :meth:`put_many` otherwise."""
        lens = np.asarray(lengths, np.int64)
        if lens.shape != (len(keys),) or (lens < 0).any():
            raise ValueError("lengths must be one non-negative int per key")
        buf = np.empty(int(lens.sum()), np.uint8)
        sums = fill(buf)
        offs = np.concatenate(([0], np.cumsum(lens)))
        items = [
            (k, buf.data[int(offs[i]) : int(offs[i + 1])]) for i, k in enumerate(keys)
        ]
        res = self.put_many(items, pin=pin)
        if sums is not None and [int(x) for x in sums] != [
            r.checksum for r in res.refs
        ]:
            raise ArtifactStoreError("put_packed: fill returned wrong checksums")
        return res

    @property
    def checksum_algorithm(self) -> ChecksumAlgorithm:
        """The algorithm this store records and verifies."""
        return getattr(self, "_algo", ChecksumAlgorithm.CRC32)

    def put(self, key: str, data: Payload, *, pin: bool = False) -> ObjectRef:
        """Publish one object; see :meth:`put_many`."""
        return self.put_many([(key, data)], pin=pin).refs[0]

    @abstractmethod
    def exists(self, key: KeyOrRef) -> bool:
        """Whether the key (or the exact version) is readable now."""

    @abstractmethod
    def get_batch(self, keys: Sequence[KeyOrRef]) -> ObjectBatch:
        """Read several objects into one private buffer, verifying each
        checksum. Raises :class:`ObjectMissingError` if any is absent."""

    def get_split(
        self,
        keys: Sequence[KeyOrRef],
        trailer_nbytes: int,
        out: np.ndarray,
        body_nbytes: Sequence[int] | np.ndarray | None = None,
    ) -> SplitBatch:
        """Read objects, verifying checksums, and split each into a body
        (all but its last ``trailer_nbytes`` bytes), copied back to back
        into ``out`` (1-D, C-contiguous, writable uint8 whose size is the
        bodies' total), and a trailer (returned). ``body_nbytes`` gives the
        expected body sizes; a mismatch raises :class:`ObjectSizeError`
        before anything is copied. Backends override this to copy each byte
        once."""
        batch = self.get_batch(keys)
        lens = batch.lengths
        bodies = self._check_split(lens, trailer_nbytes, out, body_nbytes)
        n = len(batch)
        trailers = np.empty((n, trailer_nbytes), np.uint8)
        d = 0
        for i in range(n):
            o, b = int(batch.offsets[i]), int(bodies[i])
            out[d : d + b] = batch.data[o : o + b]
            trailers[i] = batch.data[o + b : o + b + trailer_nbytes]
            d += b
        return SplitBatch(trailers, lens, np.array(batch.checksums, np.uint64))

    @staticmethod
    def _check_split(
        lens: np.ndarray,
        trailer_nbytes: int,
        out: np.ndarray,
        body_nbytes: Sequence[int] | np.ndarray | None,
    ) -> np.ndarray:
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.ndim != 1
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError("out must be a writable 1-D C-contiguous uint8 array")
        if trailer_nbytes < 0:
            raise ValueError("trailer_nbytes must be >= 0")
        bodies = lens - trailer_nbytes
        if body_nbytes is not None:
            want = np.asarray(body_nbytes, np.int64)
            bad = want != bodies
            if bad.any():
                i = int(np.argmax(bad))
                raise ObjectSizeError(
                    f"object {i} has {int(lens[i])} bytes, expected "
                    f"{int(want[i]) + trailer_nbytes}",
                    i,
                )
        bad = bodies < 0
        if bad.any():
            i = int(np.argmax(bad))
            raise ObjectSizeError(
                f"object {i} has {int(lens[i])} bytes, less than its "
                f"{trailer_nbytes}-byte trailer",
                i,
            )
        if int(bodies.sum()) != out.shape[0]:
            raise ObjectSizeError(
                f"objects hold {int(bodies.sum())} body bytes, out holds "
                f"{out.shape[0]}",
                len(lens) - 1,
            )
        return bodies

    def get(self, key: KeyOrRef) -> bytes:
        """Read one object (a private copy), verifying its checksum."""
        return self.get_batch([key]).tobytes(0)

    def get_many(self, keys: Sequence[KeyOrRef]) -> list[bytes]:
        """Read several objects as separate ``bytes`` values."""
        batch = self.get_batch(keys)
        return [batch.tobytes(i) for i in range(len(batch))]

    @abstractmethod
    def pin(self, keys: Iterable[KeyOrRef]) -> None:
        """Protect the keys' current versions (or exact versions) from
        eviction. Pins are counted; raise if a key is missing."""

    @abstractmethod
    def unpin(self, keys: Iterable[KeyOrRef]) -> None:
        """Drop one pin per key; unknown keys are ignored."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """Counters (see :class:`StoreStats`)."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; idempotent."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ref_key(k: KeyOrRef) -> str:
    """The key of a key-or-ref, validated."""
    return validate_key(k.key if isinstance(k, ObjectRef) else k)


# --------------------------------------------------------------------------
# In-process reference backend (tests, single-process use)
# --------------------------------------------------------------------------
class InMemoryObjectStore(ObjectStore):
    """Reference backend with the same semantics as the SHM backend, kept in
    process memory. Capacity counts live versions; eviction drops unpinned
    versions oldest first."""

    def __init__(
        self,
        capacity_bytes: int = 8 << 30,
        *,
        on_divergence: str = "version",
        checksum: ChecksumAlgorithm | None = None,
    ) -> None:
        if on_divergence not in ("version", "raise"):
            raise ValueError("on_divergence must be 'version' or 'raise'")
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self._capacity = capacity_bytes
        self._policy = on_divergence
        self._algo = checksum or default_checksum()
        # key -> {checksum: bytes}, insertion order = age; current = last.
        self._objs: dict[str, dict[int, bytes]] = {}
        self._order: list[tuple[str, int]] = []
        self._pins: dict[str, int] = {}
        self._used = 0
        self._stats = StoreStats(capacity_bytes=capacity_bytes)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("artifact store is closed")

    def _resolve(self, k: KeyOrRef) -> tuple[str, int, bytes]:
        key = ref_key(k)
        versions = self._objs.get(key)
        if not versions:
            raise ObjectMissingError(f"artifact object {key} is missing")
        if isinstance(k, ObjectRef):
            data = versions.get(k.checksum)
            if data is None:
                raise ObjectMissingError(
                    f"artifact object {key} version {k.checksum:#x} is missing"
                )
            return key, k.checksum, data
        cs = next(reversed(versions))
        return key, cs, versions[cs]

    def put_many(
        self, items: Sequence[tuple[str, Payload]], *, pin: bool = False
    ) -> PutResult:
        self._check_open()
        prepared = []
        incoming = 0
        for key, data in items:
            validate_key(key)
            b = bytes(data)
            cs = compute_checksum(self._algo, b)
            versions = self._objs.get(key)
            if versions and cs in versions and versions[cs] == b:
                prepared.append((key, b, cs, PutStatus.IDENTICAL))
                continue
            status = PutStatus.DIVERGED if versions else PutStatus.WRITTEN
            if status == PutStatus.DIVERGED and self._policy == "raise":
                raise ObjectDivergenceError(
                    f"artifact object {key} already exists with different bytes"
                )
            prepared.append((key, b, cs, status))
            incoming += len(b)
        self._make_room(incoming, {k for k, *_ in prepared} if pin else set())
        refs, statuses = [], []
        for key, b, cs, status in prepared:
            if status != PutStatus.IDENTICAL:
                versions = self._objs.setdefault(key, {})
                versions.pop(cs, None)
                versions[cs] = b
                self._order.append((key, cs))
                self._used += len(b)
            else:
                # Identical re-put makes that version current again.
                versions = self._objs[key]
                versions[cs] = versions.pop(cs)
            if status == PutStatus.WRITTEN:
                self._stats.puts_written += 1
            elif status == PutStatus.IDENTICAL:
                self._stats.puts_identical += 1
            else:
                self._stats.divergences += 1
            refs.append(ObjectRef(key, cs, len(b)))
            statuses.append(status)
        if pin:
            self.pin(refs)
        return PutResult(tuple(refs), tuple(statuses))

    def _make_room(self, incoming: int, protect: set[str]) -> None:
        if self._used + incoming <= self._capacity:
            return
        pinned = sum(
            len(b)
            for k, vs in self._objs.items()
            if self._pins.get(k) or k in protect
            for b in vs.values()
        )
        if pinned + incoming > self._capacity:
            raise StoreCapacityError(
                f"artifact store full: {pinned} pinned bytes + {incoming} new "
                f"bytes exceed capacity {self._capacity}"
            )
        keep = []
        for key, cs in self._order:
            vs = self._objs.get(key)
            if vs is None or cs not in vs:
                continue
            if self._used + incoming > self._capacity and not (
                self._pins.get(key) or key in protect
            ):
                self._used -= len(vs.pop(cs))
                self._stats.evicted_objects += 1
                if not vs:
                    del self._objs[key]
            else:
                keep.append((key, cs))
        self._order = keep

    def exists(self, key: KeyOrRef) -> bool:
        self._check_open()
        try:
            self._resolve(key)
        except ObjectMissingError:
            return False
        return True

    def get_batch(self, keys: Sequence[KeyOrRef]) -> ObjectBatch:
        self._check_open()
        values, sums = [], []
        for k in keys:
            key, cs, data = self._resolve(k)
            if compute_checksum(self._algo, data) != cs:
                self._stats.checksum_failures += 1
                raise ChecksumMismatchError(f"artifact object {key} is corrupt")
            values.append(data)
            sums.append(cs)
        return ObjectBatch.from_values(values, sums)

    def pin(self, keys: Iterable[KeyOrRef]) -> None:
        self._check_open()
        resolved = [self._resolve(k)[0] for k in keys]
        for key in resolved:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[KeyOrRef]) -> None:
        self._check_open()
        for k in keys:
            key = ref_key(k)
            n = self._pins.get(key, 0)
            if n <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] = n - 1

    def stats(self) -> StoreStats:
        s = self._stats
        s.objects = sum(len(v) for v in self._objs.values())
        s.keys = len(self._objs)
        s.used_bytes = self._used
        s.pinned_keys = len(self._pins)
        return dataclasses.replace(s, extra=dict(s.extra))

    def close(self) -> None:
        self._closed = True
        self._objs.clear()
        self._order.clear()
