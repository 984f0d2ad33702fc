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
import itertools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from vllm.distributed.artifact_connector.store import (
    KEY_NBYTES,
    ArtifactError,
    ChecksumAlgorithm,
    ObjectBatch,
    ObjectRef,
    ObjectSizeError,
    ObjectStore,
    XXH3State,
    checksum_function,
    validate_keys,
)

SCHEMA_VERSION = 1
ENVELOPE_MAGIC = b"VART"
ENVELOPE = struct.Struct("<4sHBBHHIIQ32sB3x")
ENVELOPE_NBYTES = ENVELOPE.size  # 64
FLAG_TAIL = 1

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
        object.__setattr__(self, "_prefix", prefix)

    def _derive(self, kind: bytes, block_hash: bytes, num_tokens: int) -> str:
        if not isinstance(block_hash, bytes | bytearray) or not block_hash:
            raise CoverageError("block hash must be non-empty bytes")
        return hashlib.sha256(
            self._prefix  # type: ignore[attr-defined]
            + kind
            + struct.pack("<II", len(block_hash), num_tokens)
            + block_hash
        ).hexdigest()

    def block_keys(self, block_hashes: Sequence[bytes], block_size: int) -> list[str]:
        """``[block_key(h, block_size) for h in block_hashes]``, faster."""
        sha = hashlib.sha256
        pre32 = self._prefix + b"F" + struct.pack("<II", 32, block_size)  # type: ignore[attr-defined]
        out = []
        for h in block_hashes:
            if type(h) is bytes and len(h) == 32:  # the common case
                out.append(sha(pre32 + h).hexdigest())
            else:
                out.append(self.block_key(h, block_size))
        return out

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
class Segment(NamedTuple):
    """One object in a request's coverage: rows ``[start, start + num_rows)``
    (an immutable named tuple: cheap to create in bulk)."""

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
    b0 = first_row // block_size
    segs = [
        Segment(k, (b0 + i) * block_size, block_size, False)
        for i, k in enumerate(keyspace.block_keys(block_hashes[b0:n_full], block_size))
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


_get_start = attrgetter("start")
_get_rows = attrgetter("num_rows")
_get_tail = attrgetter("is_tail")
_get_key = attrgetter("key")


def _segment_columns(
    segments: Sequence[Segment],
) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    """The segments' keys (a tuple) and their starts, row counts and tail
    flags (arrays)."""
    n = len(segments)
    if n == 0:
        z = np.zeros(0, np.int64)
        return (), z, z.copy(), np.zeros(0, np.bool_)
    # Segments are named tuples: zip(*) transposes them at C speed.
    keys, starts, nrows, tails = zip(*segments)
    return (
        keys,
        np.fromiter(starts, np.int64, n),
        np.fromiter(nrows, np.int64, n),
        np.fromiter(tails, np.bool_, n),
    )


def _segment_arrays(
    segments: Sequence[Segment],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    _keys, starts, nrows, tails = _segment_columns(segments)
    return starts, nrows, tails


def _check_coverage_arrays(
    starts: np.ndarray, nrows: np.ndarray, tails: np.ndarray, num_rows: int
) -> None:
    n = starts.shape[0]
    prev_end = np.zeros(n, np.int64)
    if n > 1:
        np.cumsum(nrows[:-1], out=prev_end[1:])
    # prev_end[i] is where object i must start if all before it are right;
    # the first failing object is reported, as a sequential scan would.
    gap = starts != prev_end
    empty = nrows <= 0
    tail_mid = tails.copy()
    if n:
        tail_mid[-1] = False
    bad = gap | empty | tail_mid
    if bad.any():
        i = int(np.argmax(bad))
        pos = int(prev_end[i])
        if gap[i]:
            kind = "gap" if starts[i] > pos else "overlap"
            raise CoverageError(
                f"artifact coverage has a {kind} at row {pos} (object {i} starts "
                f"at row {int(starts[i])})"
            )
        if empty[i]:
            raise CoverageError(f"object {i} covers no rows")
        raise CoverageError(f"tail object {i} is not the last object")
    pos = int(starts[-1] + nrows[-1]) if n else 0
    if pos != num_rows:
        raise CoverageError(
            f"artifact objects cover rows [0, {pos}) but the request has "
            f"{num_rows} rows"
        )


def check_coverage(segments: Sequence[Segment], num_rows: int) -> None:
    """Raise :class:`CoverageError` unless ``segments`` cover ``[0,
    num_rows)`` in order, without gap or overlap, with only the last one a
    tail (vectorised over all segments)."""
    _check_coverage_arrays(*_segment_arrays(segments), num_rows)


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------
def _key_bytes(keys: Sequence[str]) -> np.ndarray:
    return np.frombuffer(bytes.fromhex("".join(keys)), np.uint8).reshape(
        len(keys), KEY_NBYTES
    )


def _validate_segments(
    spec: RowSpec, segments: Sequence[Segment], rows: np.ndarray, rows_start: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    spec.check_rows(rows)
    validate_keys(list(map(_get_key, segments)))
    starts, nrows, tails = _segment_arrays(segments)
    bad = (starts < rows_start) | (starts + nrows > rows_start + rows.shape[0])
    bad |= nrows <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise EnvelopeError(
            f"segment rows [{int(starts[i])}, {int(starts[i] + nrows[i])}) are "
            f"not inside the given rows [{rows_start}, "
            f"{rows_start + rows.shape[0]})"
        )
    return starts, nrows, tails


def _object_sizes(spec: RowSpec, nrows: np.ndarray) -> np.ndarray:
    return nrows * spec.row_nbytes + ENVELOPE_NBYTES


def _intdigest(h: Any) -> int:
    return h.intdigest()


def _encode_into(
    spec: RowSpec,
    kraw: bytes,
    starts: np.ndarray,
    nrows: np.ndarray,
    tails: np.ndarray,
    rows: np.ndarray,
    rows_start: int,
    buf: np.ndarray,
    algo: ChecksumAlgorithm,
) -> np.ndarray | None:
    """Write the objects of ``segments`` back to back into ``buf``: payload
    rows then envelope. The envelope records the payload checksum
    (``algo``). With xxh3 the same streaming pass also yields each whole
    object's checksum, returned for the store (one pass over the bytes);
    with CRC-32 returns ``None`` and the store hashes."""
    n = starts.shape[0]
    rb = spec.row_nbytes
    flat = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
    sizes = _object_sizes(spec, nrows)
    offs = np.zeros(n, np.int64)
    if n > 1:
        np.cumsum(sizes[:-1], out=offs[1:])
    env = np.zeros(n, _ENV_DTYPE)
    env["magic"] = np.frombuffer(ENVELOPE_MAGIC, "V4")[0]
    env["schema"] = SCHEMA_VERSION
    env["dtype"] = _DTYPE_CODES[spec.dtype]
    env["flags"] = np.where(tails, FLAG_TAIL, 0)
    env["layers"] = spec.num_layers
    env["top_k"] = spec.top_k
    env["start"] = starts
    env["rows"] = nrows
    env["algo"] = int(algo)
    env_u8 = env.view(np.uint8).reshape(n, ENVELOPE_NBYTES)
    env_u8[:, 28:60] = np.frombuffer(kraw, np.uint8).reshape(n, KEY_NBYTES)
    # Runs of equal-size, row-contiguous segments (all full blocks of a
    # publication form one run): one strided copy for the payloads and one
    # for the envelopes per run.
    sz, st, of = sizes.tolist(), starts.tolist(), offs.tolist()
    runs = []
    i = 0
    while i < n:
        j = i + 1
        per = (sz[i] - ENVELOPE_NBYTES) // rb
        while j < n and sz[j] == sz[i] and st[j] == st[j - 1] + per:
            j += 1
        p = sz[i] - ENVELOPE_NBYTES
        lo = (st[i] - rows_start) * rb
        dst = buf[of[i] : of[i] + (j - i) * sz[i]].reshape(j - i, sz[i])
        dst[:, :p] = flat[lo : lo + (j - i) * p].reshape(j - i, p)
        runs.append((i, j, dst, p))
        i = j
    mv = buf.data
    ends = (offs + sizes - ENVELOPE_NBYTES).tolist()
    obj_sums: np.ndarray | None = None
    states: list[Any] = []
    if algo == ChecksumAlgorithm.XXH3_64 and XXH3State is not None:
        states = list(map(XXH3State, map(mv.__getitem__, map(slice, of, ends))))
        env["checksum"] = np.fromiter(map(_intdigest, states), np.uint64, n)
    else:
        fn = checksum_function(algo)
        env["checksum"] = np.fromiter(
            map(fn, map(mv.__getitem__, map(slice, of, ends))), np.uint64, n
        )
    for i, j, dst, p in runs:
        dst[:, p:] = env_u8[i:j]
    if states:
        trail = map(
            mv.__getitem__, map(slice, ends, (e + ENVELOPE_NBYTES for e in ends))
        )
        for h, t in zip(states, trail):
            h.update(t)
        obj_sums = np.fromiter(map(_intdigest, states), np.uint64, n)
    return obj_sums


def encode_segments(
    spec: RowSpec,
    segments: Sequence[Segment],
    rows: np.ndarray,
    rows_start: int,
    *,
    checksum: ChecksumAlgorithm = ChecksumAlgorithm.XXH3_64,
) -> list[tuple[str, memoryview]]:
    """Encode objects for ``segments`` from ``rows`` (rows ``[rows_start,
    rows_start + len(rows))``). Returns ``(key, bytes)`` items ready for
    :meth:`ObjectStore.put_many`, all views of one buffer.
    :func:`publish_rows` encodes straight into the store instead."""
    if not segments:
        spec.check_rows(rows)
        return []
    starts, nrows, tails = _validate_segments(spec, segments, rows, rows_start)
    sizes = _object_sizes(spec, nrows)
    buf = np.empty(int(sizes.sum()), np.uint8)
    kraw = validate_keys(list(map(_get_key, segments)))
    _encode_into(spec, kraw, starts, nrows, tails, rows, rows_start, buf, checksum)
    out: list[tuple[str, memoryview]] = []
    o = 0
    for seg, size in zip(segments, sizes.tolist()):
        out.append((seg.key, buf.data[o : o + size]))
        o += size
    return out


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
    if verify_checksum and _payload_checksum(int(env["algo"][0]), payload.data) != int(
        env["checksum"][0]
    ):
        raise EnvelopeError(f"artifact object {seg.key} failed its payload checksum")
    rows = payload.copy().view(spec.dtype).reshape(seg.num_rows, *spec.row_shape)
    return seg, rows


def _payload_checksum(algo_id: int, payload: memoryview) -> int:
    try:
        algo = ChecksumAlgorithm(algo_id)
    except ValueError as e:
        raise EnvelopeError(f"unknown envelope checksum algorithm {algo_id}") from e
    return int(checksum_function(algo)(payload))


def _check_envelopes(
    env: np.ndarray,
    spec: RowSpec,
    lengths: Sequence[int] | np.ndarray,
    expected: Sequence[Segment] | None,
) -> list[Segment]:
    """Vectorised envelope validation; returns the decoded segments."""
    if expected is None:
        return _check_envelope_arrays(env, spec, lengths, None)
    starts, nrows, tails = _segment_arrays(expected)
    keys = list(map(_get_key, expected))
    _check_envelope_arrays(env, spec, lengths, (starts, nrows, tails, keys))
    return list(expected)


def _check_envelope_arrays(
    env: np.ndarray,
    spec: RowSpec,
    lengths: Sequence[int] | np.ndarray,
    expected: tuple[np.ndarray, np.ndarray, np.ndarray, Sequence[str]] | None,
) -> list[Segment]:
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
        exp_start, exp_rows, exp_tail, exp_keys = expected
        if len(exp_keys) != n:
            raise CoverageError(f"expected {len(exp_keys)} objects, got {n}")
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
                f"[{int(exp_start[i])}, {int(exp_start[i] + exp_rows[i])})"
            )
        have_keys = np.ascontiguousarray(keys_u8)
        if have_keys.tobytes().hex() == "".join(exp_keys):
            return []  # all keys match (one string comparison)
        try:  # keys found in a store are valid; validate only on doubt
            raw = bytes.fromhex("".join(exp_keys))
        except ValueError:
            raw = b""
        if len(raw) != n * KEY_NBYTES:
            raw = validate_keys(exp_keys)
        # Compare as 4 x uint64 per key (a contiguous copy of 32 B per key).
        want = np.frombuffer(raw, "<u8").reshape(n, KEY_NBYTES // 8)
        have = have_keys.view("<u8")
        bad = (have != want).any(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            raise EnvelopeError(
                f"object {i} carries key {bytes(keys_u8[i]).hex()}, expected "
                f"{exp_keys[i]}"
            )
        return []
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
            if _payload_checksum(
                int(env["algo"][i]), mv[o : o + int(lengths[i]) - ENVELOPE_NBYTES]
            ) != int(env["checksum"][i]):
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
    keys = keyspace.block_keys(block_hashes[lo : lo + n_full], block_size)
    # tuple.__new__ builds the named tuples without a Python frame each.
    segs = list(
        map(
            tuple.__new__,
            itertools.repeat(Segment),
            zip(
                keys,
                range(b0 * block_size, (b0 + n_full) * block_size, block_size),
                itertools.repeat(block_size, n_full),
                itertools.repeat(False, n_full),
            ),
        )
    )
    tail = end - (b0 + n_full) * block_size
    if tail:
        if tail_hash is None:  # pragma: no cover - checked above
            raise CoverageError("tail rows without a tail hash")
        keys.append(keyspace.tail_key(tail_hash, tail))
        segs.append(Segment(keys[-1], end - tail, tail, True))
    if not segs:
        return []
    spec.check_rows(rows)
    n = len(segs)
    starts = np.arange(n, dtype=np.int64) * block_size + b0 * block_size
    nrows = np.full(n, block_size, np.int64)
    tails = np.zeros(n, np.bool_)
    if tail:
        nrows[-1] = tail
        tails[-1] = True
    kraw = bytes.fromhex("".join(keys))  # sha256 hex digests; store validates
    algo = store.checksum_algorithm

    def fill(buf: np.ndarray) -> np.ndarray | None:
        return _encode_into(
            spec, kraw, starts, nrows, tails, rows, first_row, buf, algo
        )

    result = store.put_packed(keys, _object_sizes(spec, nrows), fill, pin=pin)
    return list(zip(segs, result.refs))


def read_request(
    store: ObjectStore,
    spec: RowSpec,
    segments: Sequence[Segment],
    num_rows: int,
    versions: Sequence[ObjectRef | None] | None = None,
    *,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Read and assemble a request's array. ``versions[i]``, when given,
    names the exact version of ``segments[i]`` (the ones the request itself
    published); otherwise the key's current version is read (prefix-cache
    hits). The store copies each object's rows straight into the result
    (``out`` if given: a C-contiguous ``[num_rows, L, K]`` array of the
    spec's dtype); envelopes are checked, vectorised, before it is
    returned. Every inconsistency raises; nothing partial is returned."""
    keys_s, starts, nrows, tails = _segment_columns(segments)
    _check_coverage_arrays(starts, nrows, tails, num_rows)
    keys: Sequence[str | ObjectRef] = keys_s
    if versions is not None:
        exact: list[str | ObjectRef] = list(keys_s)
        if len(versions) != len(segments):
            raise CoverageError(
                f"{len(versions)} versions given for {len(segments)} objects"
            )
        for i, v in enumerate(versions):
            if v is None:
                continue
            if v.key != keys_s[i]:
                raise CoverageError(
                    f"version {i} names key {v.key}, expected {keys_s[i]}"
                )
            exact[i] = v
        keys = exact
    shape = (num_rows, *spec.row_shape)
    if out is None:
        out = np.empty(shape, spec.dtype)
    elif out.shape != shape or out.dtype != spec.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {list(shape)} {spec.dtype} array")
    n = len(segments)
    if n == 0:
        return out
    try:
        got = store.get_split(
            keys,
            ENVELOPE_NBYTES,
            out.reshape(-1).view(np.uint8),
            body_nbytes=nrows * spec.row_nbytes,
        )
    except ObjectSizeError as e:
        raise EnvelopeError(
            f"object {e.index} ({keys_s[e.index]}) does not have the size its "
            f"segment needs: {e}"
        ) from e
    env = np.ascontiguousarray(got.trailers).view(_ENV_DTYPE).reshape(n)
    _check_envelope_arrays(env, spec, got.lengths, (starts, nrows, tails, keys_s))
    return out
