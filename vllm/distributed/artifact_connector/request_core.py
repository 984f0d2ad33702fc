# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Request-level artifact logic: keys, object envelopes, ordered coverage and
materialisation of a request's ``[N - 1, num_layers, top_k]`` array.

A request with ``N`` tokens has ``R = N - 1`` rows (the last sampled token is
never forwarded). Rows are cut at the prefix cache's hash-block granularity
(``hash_block_size``, ``B``): rows ``[b*B, (b+1)*B)`` form the *full block*
``b``, keyed by the request's KV block hash ``block_hashes[b]``; the last
``R % B`` rows form the *tail*, keyed by the hash of exactly those tokens
computed with the prefix cache's own function
(:func:`vllm.v1.core.kv_cache_utils.hash_block_tokens`), the parent block
hash and the block's extra keys, plus its token count.

An object is ``payload || trailer``: the rows in C order, then a fixed
64-byte trailer (the envelope) with schema version, dtype, shape, token
range, the object's key and a checksum of the payload.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm.distributed.artifact_connector.store import (
    KEY_NBYTES,
    ArtifactError,
    ObjectBatch,
    ObjectRef,
    ObjectStore,
    validate_key,
)

SCHEMA_VERSION = 1
ENVELOPE_MAGIC = b"VART"
ENVELOPE = struct.Struct("<4sHBBHHIIQ32sB3x")
ENVELOPE_NBYTES = ENVELOPE.size  # 64
FLAG_TAIL = 1
_CHECKSUM_CRC32 = 1

_DTYPE_CODES: dict[np.dtype, int] = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 2}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}

_ENV_DTYPE = np.dtype(
    {
        "names": [
            "magic",
            "schema",
            "dtype",
            "flags",
            "layers",
            "top_k",
            "start",
            "rows",
            "checksum",
            "key",
            "algo",
        ],
        "formats": ["V4", "<u2", "u1", "u1", "<u2", "<u2", "<u4", "<u4", "<u8"]
        + ["V32", "u1"],
        "offsets": [0, 4, 6, 7, 8, 10, 12, 16, 20, 28, 60],
        "itemsize": 64,
    }
)


class EnvelopeError(ArtifactError):
    """An object's envelope does not match what the request expects (schema,
    dtype, shape, token range or key) or its payload checksum fails."""


class CoverageError(ArtifactError):
    """The objects of a request do not cover ``[0, N - 1)`` exactly once, in
    order (gap, overlap, missing hash, wrong count)."""


# --------------------------------------------------------------------------
# Row format
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class RowSpec:
    """Shape and dtype of one row (one executed token)."""

    num_layers: int
    top_k: int
    dtype: np.dtype

    def __post_init__(self) -> None:
        dt = np.dtype(self.dtype)
        object.__setattr__(self, "dtype", dt)
        if dt not in _DTYPE_CODES:
            raise ValueError(f"artifact rows must be uint8 or uint16, got {dt}")
        if not (0 < self.num_layers < 1 << 16 and 0 < self.top_k < 1 << 16):
            raise ValueError("num_layers and top_k must be in [1, 65535]")

    @classmethod
    def for_experts(cls, num_layers: int, top_k: int, num_experts: int) -> RowSpec:
        """uint8 when expert ids fit, else uint16."""
        if num_experts <= 0 or num_experts > 1 << 16:
            raise ValueError(f"unsupported number of experts {num_experts}")
        dt = np.uint8 if num_experts <= 256 else np.uint16
        return cls(num_layers, top_k, np.dtype(dt))

    @property
    def row_shape(self) -> tuple[int, int]:
        return (self.num_layers, self.top_k)

    @property
    def row_nbytes(self) -> int:
        return self.num_layers * self.top_k * self.dtype.itemsize

    def object_nbytes(self, num_rows: int) -> int:
        return num_rows * self.row_nbytes + ENVELOPE_NBYTES

    def check_rows(self, rows: np.ndarray) -> None:
        """Raise :class:`EnvelopeError` unless ``rows`` is ``[n, L, K]`` of
        this dtype."""
        if (
            rows.dtype != self.dtype
            or rows.ndim != 3
            or rows.shape[1:]
            != (
                self.num_layers,
                self.top_k,
            )
        ):
            raise EnvelopeError(
                f"rows must be [n, {self.num_layers}, {self.top_k}] {self.dtype}, "
                f"got {list(rows.shape)} {rows.dtype}"
            )


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class KeySpace:
    """Everything besides the block identity that goes into a key.

    ``namespace`` is per engine instance (and DP rank); ``weight_version``
    names the model weights (bump it on every weight update). Keys differ
    whenever any of these differ, so objects of another engine, another
    schema or older weights can never be served.
    """

    namespace: str
    weight_version: str
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError("KeySpace.namespace must be a non-empty string")
        if not isinstance(self.weight_version, str):
            raise ValueError("KeySpace.weight_version must be a string")
        prefix = b"vllm-artifact\x00%d\x00%d:%s\x00%d:%s\x00" % (
            self.schema_version,
            len(self.namespace),
            self.namespace.encode(),
            len(self.weight_version),
            self.weight_version.encode(),
        )
        object.__setattr__(self, "_base", hashlib.sha256(prefix))

    def _derive(self, kind: bytes, block_hash: bytes, num_tokens: int) -> str:
        if not isinstance(block_hash, bytes | bytearray) or not block_hash:
            raise CoverageError("block hash must be non-empty bytes")
        h = self._base.copy()  # type: ignore[attr-defined]
        h.update(kind + struct.pack("<II", len(block_hash), num_tokens) + block_hash)
        return h.hexdigest()

    def block_key(self, block_hash: bytes, block_size: int) -> str:
        """Key of a full hash block (``block_size`` rows)."""
        return self._derive(b"F", block_hash, block_size)

    def tail_key(self, tail_hash: bytes, num_tokens: int) -> str:
        """Key of a partial tail of ``num_tokens`` rows whose tokens hash to
        ``tail_hash`` (see :func:`tail_block_hash`)."""
        return self._derive(b"T", tail_hash, num_tokens)


def tail_block_hash(
    hash_fn: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    tail_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """Hash of a partial block, computed exactly like a full KV block hash
    (same function, parent chaining and extra keys: LoRA, multimodal, cache
    salt, prompt embeds) but over the tail's tokens only. Call
    ``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys`` for the
    tail's token range to get ``extra_keys``."""
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    if not tail_token_ids:
        raise CoverageError("a tail block needs at least one token")
    return bytes(
        hash_block_tokens(hash_fn, parent_block_hash, tail_token_ids, extra_keys)  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------
# Coverage
# --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Segment:
    """One object in a request's coverage: rows ``[start, start + num_rows)``."""

    key: str
    start: int
    num_rows: int
    is_tail: bool

    @property
    def end(self) -> int:
        return self.start + self.num_rows


def num_full_blocks(num_rows: int, block_size: int) -> int:
    return num_rows // block_size


def plan_coverage(
    keyspace: KeySpace,
    block_size: int,
    num_rows: int,
    block_hashes: Sequence[bytes],
    tail_hash: bytes | None = None,
    *,
    first_row: int = 0,
) -> list[Segment]:
    """Ordered objects covering rows ``[first_row, num_rows)``.

    ``block_hashes[b]`` is the KV hash of full block ``b`` (the request's
    ``block_hashes`` at ``hash_block_size`` granularity; extra entries are
    ignored). ``tail_hash`` is required iff ``num_rows % block_size``.
    ``first_row`` must be block aligned.
    """
    if block_size <= 0:
        raise CoverageError(f"block size must be positive, got {block_size}")
    if num_rows < 0 or first_row < 0 or first_row > num_rows:
        raise CoverageError(
            f"invalid row range [{first_row}, {num_rows}) for a request"
        )
    if first_row % block_size:
        raise CoverageError(
            f"coverage must start on a block boundary, got row {first_row} "
            f"with block size {block_size}"
        )
    n_full = num_rows // block_size
    if len(block_hashes) < n_full:
        raise CoverageError(
            f"request has {num_rows} rows ({n_full} full blocks of {block_size}) "
            f"but only {len(block_hashes)} block hashes"
        )
    segs = [
        Segment(
            keyspace.block_key(block_hashes[b], block_size),
            b * block_size,
            block_size,
            False,
        )
        for b in range(first_row // block_size, n_full)
    ]
    tail = num_rows - n_full * block_size
    if tail:
        if tail_hash is None:
            raise CoverageError(
                f"request has a {tail}-row tail after {n_full} full blocks but "
                "no tail hash"
            )
        segs.append(
            Segment(keyspace.tail_key(tail_hash, tail), n_full * block_size, tail, True)
        )
    elif tail_hash is not None:
        raise CoverageError("tail hash given but the rows end on a block boundary")
    return segs


def check_coverage(segments: Sequence[Segment], num_rows: int) -> None:
    """Raise :class:`CoverageError` unless ``segments`` cover ``[0,
    num_rows)`` in order, without gap or overlap, with only the last one a
    tail."""
    pos = 0
    for i, s in enumerate(segments):
        if s.start != pos:
            kind = "gap" if s.start > pos else "overlap"
            raise CoverageError(
                f"artifact coverage has a {kind} at row {pos} (object {i} starts "
                f"at row {s.start})"
            )
        if s.num_rows <= 0:
            raise CoverageError(f"object {i} covers no rows")
        if s.is_tail and i != len(segments) - 1:
            raise CoverageError(f"tail object {i} is not the last object")
        pos = s.end
    if pos != num_rows:
        raise CoverageError(
            f"artifact objects cover rows [0, {pos}) but the request has "
            f"{num_rows} rows"
        )


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------
def _key_bytes(keys: Sequence[str]) -> np.ndarray:
    return np.frombuffer(bytes.fromhex("".join(keys)), np.uint8).reshape(
        len(keys), KEY_NBYTES
    )


def encode_segments(
    spec: RowSpec,
    segments: Sequence[Segment],
    rows: np.ndarray,
    rows_start: int,
) -> list[tuple[str, memoryview]]:
    """Encode objects for ``segments`` from ``rows`` (rows ``[rows_start,
    rows_start + len(rows))``). Returns ``(key, bytes)`` items ready for
    :meth:`ObjectStore.put_many`. Objects of equal size are built with one
    vectorised copy into one buffer; the only per-object work is the payload
    checksum."""
    spec.check_rows(rows)
    if not segments:
        return []
    for s in segments:
        validate_key(s.key)
        if (
            s.start < rows_start
            or s.end > rows_start + rows.shape[0]
            or s.num_rows <= 0
        ):
            raise EnvelopeError(
                f"segment rows [{s.start}, {s.end}) are not inside the given "
                f"rows [{rows_start}, {rows_start + rows.shape[0]})"
            )
    out: list[tuple[str, memoryview]] = []
    i = 0
    flat = np.ascontiguousarray(rows).reshape(rows.shape[0], -1).view(np.uint8)
    while i < len(segments):
        # Group a run of contiguous segments of equal size.
        j = i + 1
        while (
            j < len(segments)
            and segments[j].num_rows == segments[i].num_rows
            and segments[j].start == segments[j - 1].end
            and segments[j].is_tail == segments[i].is_tail
        ):
            j += 1
        out.extend(_encode_run(spec, segments[i:j], flat, rows_start))
        i = j
    return out


def _encode_run(
    spec: RowSpec, segs: Sequence[Segment], flat: np.ndarray, rows_start: int
) -> list[tuple[str, memoryview]]:
    n = len(segs)
    r = segs[0].num_rows
    p = r * spec.row_nbytes
    size = p + ENVELOPE_NBYTES
    buf = np.empty((n, size), np.uint8)
    lo = segs[0].start - rows_start
    buf[:, :p] = flat[lo : lo + n * r].reshape(n, p)
    env = np.zeros(n, _ENV_DTYPE)
    env["magic"] = np.frombuffer(ENVELOPE_MAGIC, "V4")[0]
    env["schema"] = SCHEMA_VERSION
    env["dtype"] = _DTYPE_CODES[spec.dtype]
    env["flags"] = FLAG_TAIL if segs[0].is_tail else 0
    env["layers"] = spec.num_layers
    env["top_k"] = spec.top_k
    env["start"] = np.fromiter((s.start for s in segs), np.uint32, n)
    env["rows"] = r
    env["algo"] = _CHECKSUM_CRC32
    env_u8 = env.view(np.uint8).reshape(n, ENVELOPE_NBYTES)
    env_u8[:, 28:60] = _key_bytes([s.key for s in segs])
    crc = zlib.crc32
    env["checksum"] = np.fromiter(
        (crc(buf[k, :p].data) for k in range(n)), np.uint64, n
    )
    buf[:, p:] = env_u8
    return [(s.key, buf[k].data) for k, s in enumerate(segs)]


# --------------------------------------------------------------------------
# Decoding and materialisation
# --------------------------------------------------------------------------
def decode_object(
    data: bytes | memoryview | np.ndarray,
    spec: RowSpec,
    expected: Segment | None = None,
    *,
    verify_checksum: bool = True,
) -> tuple[Segment, np.ndarray]:
    """Validate one object and return its segment and a private copy of its
    rows ``[n, L, K]``."""
    raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    if raw.ndim != 1 or raw.shape[0] < ENVELOPE_NBYTES:
        raise EnvelopeError("artifact object is shorter than its envelope")
    env = raw[-ENVELOPE_NBYTES:].copy().view(_ENV_DTYPE)
    seg = _check_envelopes(env, spec, raw.shape[0:1], [expected] if expected else None)[
        0
    ]
    payload = raw[:-ENVELOPE_NBYTES]
    if verify_checksum and zlib.crc32(payload.data) != int(env["checksum"][0]):
        raise EnvelopeError(f"artifact object {seg.key} failed its payload checksum")
    rows = payload.copy().view(spec.dtype).reshape(seg.num_rows, *spec.row_shape)
    return seg, rows


def _check_envelopes(
    env: np.ndarray,
    spec: RowSpec,
    lengths: Sequence[int] | np.ndarray,
    expected: Sequence[Segment] | None,
) -> list[Segment]:
    """Vectorised envelope validation; returns the decoded segments."""
    n = env.shape[0]
    lengths = np.asarray(lengths, np.int64)
    bad = env["magic"] != np.frombuffer(ENVELOPE_MAGIC, "V4")[0]
    if bad.any():
        raise EnvelopeError(f"object {int(np.argmax(bad))} is not an artifact object")
    bad = env["schema"] != SCHEMA_VERSION
    if bad.any():
        i = int(np.argmax(bad))
        raise EnvelopeError(
            f"object {i} has schema version {int(env['schema'][i])}, this engine "
            f"reads version {SCHEMA_VERSION}"
        )
    bad = (
        (env["dtype"] != _DTYPE_CODES[spec.dtype])
        | (env["layers"] != spec.num_layers)
        | (env["top_k"] != spec.top_k)
    )
    if bad.any():
        i = int(np.argmax(bad))
        code = int(env["dtype"][i])
        raise EnvelopeError(
            f"object {i} holds [{int(env['layers'][i])}, {int(env['top_k'][i])}] "
            f"{_CODE_DTYPES.get(code, code)} rows, expected "
            f"[{spec.num_layers}, {spec.top_k}] {spec.dtype}"
        )
    want_len = env["rows"].astype(np.int64) * spec.row_nbytes + ENVELOPE_NBYTES
    bad = (want_len != lengths) | (env["rows"] == 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise EnvelopeError(
            f"object {i} has {int(lengths[i])} bytes, its envelope describes "
            f"{int(want_len[i])}"
        )
    keys_u8 = env.view(np.uint8).reshape(n, ENVELOPE_NBYTES)[:, 28:60]
    if expected is not None:
        if len(expected) != n:
            raise CoverageError(f"expected {len(expected)} objects, got {n}")
        exp_start = np.fromiter((s.start for s in expected), np.int64, n)
        exp_rows = np.fromiter((s.num_rows for s in expected), np.int64, n)
        exp_tail = np.fromiter((s.is_tail for s in expected), np.bool_, n)
        bad = (
            (env["start"] != exp_start)
            | (env["rows"] != exp_rows)
            | (((env["flags"] & FLAG_TAIL) != 0) != exp_tail)
        )
        if bad.any():
            i = int(np.argmax(bad))
            raise EnvelopeError(
                f"object {i} covers rows [{int(env['start'][i])}, "
                f"{int(env['start'][i]) + int(env['rows'][i])}), expected "
                f"[{expected[i].start}, {expected[i].end})"
            )
        bad = (keys_u8 != _key_bytes([s.key for s in expected])).any(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            raise EnvelopeError(
                f"object {i} carries key {bytes(keys_u8[i]).hex()}, expected "
                f"{expected[i].key}"
            )
        return list(expected)
    return [
        Segment(
            bytes(keys_u8[i]).hex(),
            int(env["start"][i]),
            int(env["rows"][i]),
            bool(env["flags"][i] & FLAG_TAIL),
        )
        for i in range(n)
    ]


def materialize(
    spec: RowSpec,
    segments: Sequence[Segment],
    batch: ObjectBatch,
    num_rows: int,
    *,
    verify_payload_checksums: bool = False,
) -> np.ndarray:
    """Assemble the request's ``[num_rows, L, K]`` array from the objects in
    ``batch`` (in ``segments`` order). Every gap, overlap, count, shape,
    dtype, token-range or key mismatch raises; nothing partial is returned.

    Backends verify a checksum over each whole object on read; set
    ``verify_payload_checksums`` to also check the envelope's payload
    checksum (for objects that did not come through a verifying store).
    """
    check_coverage(segments, num_rows)
    n = len(segments)
    if len(batch) != n:
        raise CoverageError(f"expected {n} objects, got {len(batch)}")
    out = np.empty((num_rows, *spec.row_shape), spec.dtype)
    if n == 0:
        return out
    data, offsets, lengths = batch.data, batch.offsets, batch.lengths
    if (lengths < ENVELOPE_NBYTES).any():
        raise EnvelopeError("an artifact object is shorter than its envelope")
    tr = (offsets + lengths - ENVELOPE_NBYTES)[:, None] + np.arange(ENVELOPE_NBYTES)
    env = np.ascontiguousarray(data[tr]).view(_ENV_DTYPE).reshape(n)
    _check_envelopes(env, spec, lengths, segments)
    if verify_payload_checksums:
        mv = data.data
        for i in range(n):
            o = int(offsets[i])
            if zlib.crc32(mv[o : o + int(lengths[i]) - ENVELOPE_NBYTES]) != int(
                env["checksum"][i]
            ):
                raise EnvelopeError(
                    f"artifact object {segments[i].key} failed its payload checksum"
                )
    out_flat = out.reshape(num_rows, -1).view(np.uint8).reshape(-1)
    rb = spec.row_nbytes
    # Fast path: a run of equal-size objects laid out back to back.
    lens, offs = lengths.tolist(), offsets.tolist()
    i = 0
    while i < n:
        j = i + 1
        size = lens[i]
        while j < n and lens[j] == size and offs[j] == offs[j - 1] + size:
            j += 1
        o = offs[i]
        p = size - ENVELOPE_NBYTES
        src = data[o : o + (j - i) * size].reshape(j - i, size)[:, :p]
        d = segments[i].start * rb
        out_flat[d : d + (j - i) * p].reshape(j - i, p)[...] = src
        i = j
    return out


# --------------------------------------------------------------------------
# Store helpers for the publisher (worker) and the reader (scheduler)
# --------------------------------------------------------------------------
def publish_rows(
    store: ObjectStore,
    keyspace: KeySpace,
    spec: RowSpec,
    block_size: int,
    first_row: int,
    rows: np.ndarray,
    block_hashes: Sequence[bytes],
    *,
    first_block_hash_index: int = 0,
    tail_hash: bytes | None = None,
    pin: bool = False,
) -> list[tuple[Segment, ObjectRef]]:
    """Publish rows ``[first_row, first_row + len(rows))`` (``first_row``
    block aligned) as full-block objects plus, if ``tail_hash`` is given, a
    tail for the trailing partial block; without ``tail_hash`` the rows must
    end on a block boundary. ``block_hashes[i]`` is the hash of block
    ``first_block_hash_index + i``. One batched put; returns the published
    segments with their exact versions, in order."""
    end = first_row + rows.shape[0]
    if first_row % block_size:
        raise CoverageError(f"publication must start on a block boundary: {first_row}")
    if tail_hash is None and end % block_size:
        raise CoverageError(f"rows end at {end}, inside a block, and no tail hash")
    b0 = first_row // block_size
    n_full = end // block_size - b0
    lo = b0 - first_block_hash_index
    if lo < 0 or lo + n_full > len(block_hashes):
        raise CoverageError(
            f"block hashes for blocks [{b0}, {b0 + n_full}) are not available"
        )
    segs = [
        Segment(
            keyspace.block_key(block_hashes[lo + i], block_size),
            (b0 + i) * block_size,
            block_size,
            False,
        )
        for i in range(n_full)
    ]
    tail = end - (b0 + n_full) * block_size
    if tail:
        if tail_hash is None:  # pragma: no cover - checked above
            raise CoverageError("tail rows without a tail hash")
        segs.append(Segment(keyspace.tail_key(tail_hash, tail), end - tail, tail, True))
    if not segs:
        return []
    result = store.put_many(encode_segments(spec, segs, rows, first_row), pin=pin)
    return list(zip(segs, result.refs))


def read_request(
    store: ObjectStore,
    spec: RowSpec,
    segments: Sequence[Segment],
    num_rows: int,
    versions: Sequence[ObjectRef | None] | None = None,
) -> np.ndarray:
    """Read and assemble a request's array. ``versions[i]``, when given,
    names the exact version of ``segments[i]`` (the ones the request itself
    published); otherwise the key's current version is read (prefix-cache
    hits)."""
    check_coverage(segments, num_rows)
    keys: list[str | ObjectRef] = []
    for i, s in enumerate(segments):
        v = versions[i] if versions is not None else None
        if v is not None and v.key != s.key:
            raise CoverageError(f"version {i} names key {v.key}, expected {s.key}")
        keys.append(v if v is not None else s.key)
    return materialize(spec, segments, store.get_batch(keys), num_rows)
