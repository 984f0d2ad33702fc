# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Request-level artifact logic: row format, keys, object envelopes, the
one write path (:func:`encode_objects`) and the one read path
(:func:`read_batch`, all requests finishing together in one pass;
:func:`read_rows` is its form for one request).

A request with ``N`` tokens has ``R = N - 1`` rows (the last sampled token
is never forwarded). Rows are cut at the prefix cache's hash-block size
``B``: rows ``[b*B, (b+1)*B)`` form full block ``b``, keyed by the
request's KV block hash ``block_hashes[b]``; the last ``R % B`` rows form
the *tail*, keyed by the hash of exactly those tokens computed with the
prefix cache's own function and parent hash (:func:`tail_block_hash`) plus
its row count. Every key also carries the weight version that computed the
block and the engine's cache epoch (:func:`keyed_version`), so routes of
other weights are never served under a key.

An object is ``payload || envelope``: the rows in C order, then a 64-byte
envelope (schema, dtype, shape, token range, the object's key) that makes
the object self-describing; the store's checksum covers both.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm.distributed.artifact_connector.protocol import ObjectRefs
from vllm.distributed.artifact_connector.store import (
    KEY_NBYTES,
    ArtifactError,
    ObjectStoreReader,
    checksum,
)
from vllm.utils.routed_experts_rows import (
    ROUTED_EXPERTS_DTYPE_CODES,
    RowSpec,
)

SCHEMA_VERSION = 3
ENVELOPE_MAGIC = b"VART"
FLAG_TAIL = 1

ENVELOPE_DTYPE = np.dtype(
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
            "reserved",
            "key",
        ],
        "formats": ["V4", "<u2", "u1", "u1", "<u2", "<u2", "<u4", "<u4", "V8", "V32"],
        # Bytes 20-31 are zero (schema 2 kept the payload's checksum at 24;
        # the store's checksum covers the whole object).
        "offsets": [0, 4, 6, 7, 8, 10, 12, 16, 24, 32],
        "itemsize": 64,
    }
)
ENVELOPE_NBYTES = ENVELOPE_DTYPE.itemsize


class EnvelopeError(ArtifactError):
    """An object's envelope does not match what the request expects (schema,
    dtype, shape, token range or key)."""


class CoverageError(ArtifactError):
    """A request's objects do not cover its rows exactly once, in order."""


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------
class KeySpace:
    """Derives object keys: SHA-256 over the schema version, the store's
    namespace (per engine instance and DP rank), the weight version, the
    kind (full block or tail), the row count and the block hash."""

    def __init__(self, namespace: str) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("KeySpace namespace must be a non-empty string")
        self.namespace = namespace
        self._prefixes: dict[tuple[str, bool, int], bytes] = {}

    def _prefix(self, weight_version: str, tail: bool, num_rows: int) -> bytes:
        k = (weight_version, tail, num_rows)
        p = self._prefixes.get(k)
        if p is None:
            if len(self._prefixes) > 4096:
                self._prefixes.clear()
            ns, wv = self.namespace.encode(), weight_version.encode()
            p = b"vllm-artifact\x00%d\x00%d:%s\x00%d:%s\x00%s%s" % (
                SCHEMA_VERSION,
                len(ns),
                ns,
                len(wv),
                wv,
                b"T" if tail else b"F",
                struct.pack("<I", num_rows),
            )
            self._prefixes[k] = p
        return p

    def key(
        self, weight_version: str, block_hash: bytes, num_rows: int, *, tail: bool
    ) -> str:
        """Key of a full block (``tail=False``, ``num_rows`` = block size)
        or of a tail of ``num_rows`` rows whose tokens hash to
        ``block_hash`` (:func:`tail_block_hash`)."""
        if not isinstance(block_hash, bytes | bytearray) or not block_hash:
            raise CoverageError("a block hash must be non-empty bytes")
        prefix = self._prefix(weight_version, tail, num_rows)
        return hashlib.sha256(prefix + bytes(block_hash)).hexdigest()


def keyed_version(weight_version: str, cache_epoch: int) -> str:
    """The version keys are derived under: the weight version, and from
    the first prefix-cache reset that leaves it unchanged on, that reset's
    number (``cache_epoch``). A weight version that did not change across
    a weight update (never set: ``"default"``) cannot tell the weights
    apart; the reset that follows the update (and empties the KV pool) can:
    every engine of a key space that resets moves to new keys together,
    an engine that did not reset keeps its old ones, and objects of the
    old weights (which the shared tier keeps: first put wins) are never
    paired with KV computed after the reset."""
    if cache_epoch == 0:
        return weight_version
    return f"{weight_version}\x00reset {cache_epoch}"


def row_versions(keyed_versions: tuple[str, ...]) -> str:
    """The weight versions of a request's objects (their keyed versions,
    in row order), without cache epochs, distinct, ``","``-joined: what a
    reference names as its rows' provenance."""
    return ",".join(dict.fromkeys(v.split("\x00", 1)[0] for v in keyed_versions))


def tail_block_hash(
    hash_fn: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    tail_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """Hash of a partial block, computed exactly like a full KV block hash
    (same function, parent chaining and extra keys: LoRA, multimodal, cache
    salt, prompt embeds) over the tail's tokens only. For a tail on a block
    boundary there is no tail: callers pass ``None`` instead."""
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    if not tail_token_ids:
        raise CoverageError("a tail block needs at least one token")
    return bytes(
        hash_block_tokens(hash_fn, parent_block_hash, tail_token_ids, extra_keys)  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------
# The write path
# --------------------------------------------------------------------------
def encode_objects(
    spec: RowSpec,
    keys: Sequence[str],
    starts: Sequence[int] | np.ndarray,
    num_rows: Sequence[int] | np.ndarray,
    pages: np.ndarray,
    page_of: Sequence[int] | np.ndarray,
    buf: np.ndarray,
    *,
    tails: Sequence[bool] | np.ndarray | None = None,
) -> np.ndarray:
    """Write object ``i`` back to back into ``buf`` (exactly the objects'
    total size): the first ``num_rows[i]`` rows of ``pages[page_of[i]]``
    (``pages``: ``[P, B, L, K]`` rows of ``spec``, the worker's row slab),
    which are rows ``[starts[i], ...)`` of its request, then its envelope
    naming ``keys[i]``. Returns each whole object's checksum, for the store.

    The leading run of full pages (the publisher puts full blocks first) is
    copied and enveloped as one ``[n, object]`` array; only the rest (a
    finishing request's tail) goes object by object. What is left per
    object is one checksum call."""
    n = len(keys)
    rb = spec.row_nbytes
    bs = pages.shape[1]
    nr = np.asarray(num_rows, np.int64)
    which = np.asarray(page_of, np.int64)
    if nr.shape != (n,) or which.shape != (n,):
        raise EnvelopeError("one row count and one page per key")
    if n and (nr.min() <= 0 or nr.max() > bs):
        raise EnvelopeError(f"an object holds 1 to {bs} rows")
    if pages.shape[2:] != spec.row_shape or pages.dtype != spec.dtype:
        raise EnvelopeError("pages do not hold rows of this spec")
    sizes = nr * rb + ENVELOPE_NBYTES
    if int(sizes.sum()) != buf.shape[0]:
        raise EnvelopeError("the buffer does not hold exactly these objects")
    env = np.zeros(n, ENVELOPE_DTYPE)
    env["magic"] = np.frombuffer(ENVELOPE_MAGIC, "V4")[0]
    env["schema"] = SCHEMA_VERSION
    env["dtype"] = ROUTED_EXPERTS_DTYPE_CODES[spec.dtype]
    env["layers"] = spec.num_layers
    env["top_k"] = spec.top_k
    env["start"] = np.asarray(starts, np.int64)
    env["rows"] = nr
    if tails is not None:
        env["flags"] = np.where(np.asarray(tails, np.bool_), FLAG_TAIL, 0)
    env["key"] = np.frombuffer(bytes.fromhex("".join(keys)), "V32")
    env_bytes = env.view(np.uint8).reshape(n, ENVELOPE_NBYTES)
    page_bytes = pages.reshape(pages.shape[0], -1).view(np.uint8)
    full = int(np.argmin(nr == bs)) if n and not (nr == bs).all() else n
    whole = bs * rb + ENVELOPE_NBYTES
    if full:
        objs = buf[: full * whole].reshape(full, whole)
        objs[:, : bs * rb] = page_bytes[which[:full]]
        objs[:, bs * rb :] = env_bytes[:full]
    o = full * whole
    for i in range(full, n):
        p = int(nr[i]) * rb
        buf[o : o + p] = page_bytes[which[i], :p]
        buf[o + p : o + p + ENVELOPE_NBYTES] = env_bytes[i]
        o += p + ENVELOPE_NBYTES
    mv = buf.data
    offs = np.cumsum(sizes) - sizes
    return np.fromiter(
        (checksum(mv[a : a + b]) for a, b in zip(offs.tolist(), sizes.tolist())),
        np.uint64,
        n,
    )


# --------------------------------------------------------------------------
# The read path
# --------------------------------------------------------------------------
def check_coverage(refs: ObjectRefs, num_rows: int) -> None:
    """Raise :class:`CoverageError` unless ``refs`` cover rows ``[0,
    num_rows)`` in order, each exactly once."""
    _check_coverage(refs.starts, refs.num_rows, num_rows)


def _check_coverage(starts: np.ndarray, nrows: np.ndarray, num_rows: int) -> None:
    expected = np.zeros(starts.shape[0], np.int64)
    np.cumsum(nrows[:-1], out=expected[1:])
    bad = (starts != expected) | (nrows <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        pos = int(expected[i])
        kind = "gap" if starts[i] > pos else "overlap"
        raise CoverageError(
            f"artifact objects have a {kind} at row {pos} (object {i} covers "
            f"rows [{int(starts[i])}, {int(starts[i] + nrows[i])}))"
        )
    pos = int(starts[-1] + nrows[-1]) if starts.shape[0] else 0
    if pos != num_rows:
        raise CoverageError(
            f"artifact objects cover rows [0, {pos}) but the request has "
            f"{num_rows} rows"
        )


@dataclass(frozen=True, slots=True)
class RowsRead:
    """One request's read: rows ``[first_row, num_rows)`` of a request whose
    objects ``refs`` cover ``[0, num_rows)`` in order."""

    refs: ObjectRefs
    num_rows: int
    first_row: int = 0


def read_rows(
    reader: ObjectStoreReader,
    spec: RowSpec,
    refs: ObjectRefs,
    num_rows: int,
    *,
    first_row: int = 0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Rows ``[first_row, num_rows)`` of one request (:func:`read_batch`
    of one read), into ``out`` if given: a C-contiguous ``[num_rows -
    first_row, L, K]`` array of the spec's dtype, untouched on error."""
    shape = (num_rows - first_row, *spec.row_shape)
    if out is not None and (
        out.shape != shape or out.dtype != spec.dtype or not out.flags.c_contiguous
    ):
        raise ValueError(f"out must be a C-contiguous {list(shape)} {spec.dtype} array")
    (got,) = read_batch(reader, spec, [RowsRead(refs, num_rows, first_row)], out=out)
    if isinstance(got, ArtifactError):
        raise got
    return got if out is None else out


def read_batch(
    reader: ObjectStoreReader,
    spec: RowSpec,
    reads: Sequence[RowsRead],
    *,
    out: np.ndarray | None = None,
    pause_every: int | None = None,
) -> list[np.ndarray | ArtifactError]:
    """The one read path: every request's rows, read together (one index
    lookup, one envelope check and one copy pass over all their objects).
    Objects that end at or before a read's ``first_row`` are not read.
    Every object is checked (checksum, then envelope: schema, dtype, shape,
    token range, key) before anything is copied. With ``pause_every``
    (and no ``out``), the objects are read in runs of that many, letting
    other threads have the interpreter between runs; a run that fails then
    leaves earlier runs' rows in a buffer that is never returned. Result ``i`` is read
    ``i``'s rows (views of one buffer: ``out`` if given, which must hold
    them back to back) or the typed error that stops it; a fault in one
    request's objects costs that request alone. Never partial rows."""
    n_reads = len(reads)
    rb = spec.row_nbytes
    first = np.array([r.first_row for r in reads], np.int64)
    total = np.array([r.num_rows for r in reads], np.int64)
    if ((first < 0) | (first > total)).any():
        i = int(np.argmax((first < 0) | (first > total)))
        return [
            CoverageError(f"first row {int(first[i])} is outside [0, {int(total[i])}]")
            if j == i
            else read_batch(reader, spec, [r])[0]
            for j, r in enumerate(reads)
        ]
    counts = np.array([len(r.refs) for r in reads], np.int64)
    starts = _concat([r.refs.starts for r in reads], np.int64)
    nrows = _concat([r.refs.num_rows for r in reads], np.int64)
    seg = np.repeat(np.arange(n_reads), counts)
    # Coverage of every read at once: object i starts where the ones
    # before it in its request end, and each request's objects end at its
    # num_rows.
    ends = np.cumsum(nrows)
    seg_base = np.zeros(n_reads, np.int64)
    seg_first = np.cumsum(counts) - counts
    has = counts > 0
    seg_base[has] = (ends - nrows)[seg_first[has]]
    expected = ends - nrows - seg_base[seg]
    seg_end = np.zeros(n_reads, np.int64)
    seg_end[has] = (ends - seg_base[seg])[seg_first[has] + counts[has] - 1]
    bad_obj = (starts != expected) | (nrows <= 0)
    bad = (seg_end != total) | np.bincount(seg[bad_obj], minlength=n_reads).astype(
        np.bool_
    )
    results: list[np.ndarray | ArtifactError | None] = [None] * n_reads
    for i in np.flatnonzero(bad).tolist():
        r = reads[i]
        try:
            _check_coverage(r.refs.starts, r.refs.num_rows, r.num_rows)
        except CoverageError as e:
            results[i] = e
    sizes = (total - first) * rb
    offsets = np.cumsum(sizes) - sizes
    if out is None:
        buf = np.empty(int(sizes.sum()), np.uint8)
    else:
        buf = out.reshape(-1).view(np.uint8)
        if buf.shape[0] != int(sizes.sum()):
            raise ValueError("out does not hold exactly the reads' rows")
    ok = np.array([res is None for res in results], np.bool_)
    # The objects to read: those of readable requests that end past the
    # first row wanted.
    take = ok[seg] & (starts + nrows > first[seg])
    if take.any():
        sel = np.flatnonzero(take)
        s, nr, sg = starts[sel], nrows[sel], seg[sel]
        lo = np.maximum(s, first[sg])
        spans = np.stack(
            (
                (lo - s) * rb,
                (s + nr - lo) * rb,
                offsets[sg] + (lo - first[sg]) * rb,
            ),
            axis=1,
        )
        all_keys = [k for r in reads for k in r.refs.keys]
        keys = [all_keys[i] for i in sel.tolist()]
        checksums = _concat([r.refs.checksums for r in reads], np.uint64)[sel]
        n = sel.shape[0]
        run = n if pause_every is None or out is not None else max(1, pause_every)

        def check_run(lo: int, hi: int):
            def check(trailers: np.ndarray, lengths: np.ndarray) -> None:
                nr_run = nr[lo:hi]
                bad = lengths != nr_run * rb + ENVELOPE_NBYTES
                if bad.any():
                    i = int(np.argmax(bad))
                    raise EnvelopeError(
                        f"object {keys[lo + i]} has {int(lengths[i])} bytes; "
                        f"{int(nr_run[i])} rows of [{spec.num_layers}, "
                        f"{spec.top_k}] {spec.dtype} take "
                        f"{int(nr_run[i]) * rb + ENVELOPE_NBYTES}"
                    )
                env = np.ascontiguousarray(trailers).view(ENVELOPE_DTYPE)
                _check_envelopes(
                    env.reshape(hi - lo), spec, s[lo:hi], nr_run, keys[lo:hi]
                )

            return check

        try:
            for lo in range(0, n, run):
                hi = min(n, lo + run)
                if lo:
                    time.sleep(0)  # the interpreter to whoever waits for it
                reader.read_into(
                    keys[lo:hi],
                    checksums[lo:hi],
                    buf,
                    spans[lo:hi],
                    trailer_nbytes=ENVELOPE_NBYTES,
                    check=check_run(lo, hi),
                )
        except ArtifactError as e:
            if n_reads == 1 or int(ok.sum()) == 1:
                for i in np.flatnonzero(ok).tolist():
                    results[i] = e
            else:
                # Find whose objects failed: each request alone.
                for i in np.flatnonzero(ok).tolist():
                    o, size = int(offsets[i]), int(sizes[i])
                    (results[i],) = read_batch(
                        reader, spec, [reads[i]], out=buf[o : o + size]
                    )
    for i in range(n_reads):
        if results[i] is None:
            o, size = int(offsets[i]), int(sizes[i])
            results[i] = (
                buf[o : o + size]
                .view(spec.dtype)
                .reshape(int(total[i] - first[i]), *spec.row_shape)
            )
    return results  # type: ignore[return-value]


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def _check_envelopes(
    env: np.ndarray,
    spec: RowSpec,
    starts: np.ndarray,
    nrows: np.ndarray,
    keys: Sequence[str],
) -> None:
    def first(bad: np.ndarray) -> int | None:
        return int(np.argmax(bad)) if bad.any() else None

    i = first(env["magic"] != np.frombuffer(ENVELOPE_MAGIC, "V4")[0])
    if i is not None:
        raise EnvelopeError(f"object {keys[i]} is not an artifact object")
    i = first(env["schema"] != SCHEMA_VERSION)
    if i is not None:
        raise EnvelopeError(
            f"object {keys[i]} has schema version {int(env['schema'][i])}, this "
            f"engine reads version {SCHEMA_VERSION}"
        )
    i = first(
        (env["dtype"] != ROUTED_EXPERTS_DTYPE_CODES[spec.dtype])
        | (env["layers"] != spec.num_layers)
        | (env["top_k"] != spec.top_k)
    )
    if i is not None:
        raise EnvelopeError(
            f"object {keys[i]} holds [{int(env['layers'][i])}, "
            f"{int(env['top_k'][i])}] rows of dtype code {int(env['dtype'][i])}, "
            f"expected [{spec.num_layers}, {spec.top_k}] {spec.dtype}"
        )
    i = first((env["start"] != starts) | (env["rows"] != nrows))
    if i is not None:
        raise EnvelopeError(
            f"object {keys[i]} covers rows [{int(env['start'][i])}, "
            f"{int(env['start'][i]) + int(env['rows'][i])}), expected "
            f"[{int(starts[i])}, {int(starts[i] + nrows[i])})"
        )
    have = np.ascontiguousarray(env["key"]).tobytes()
    if have.hex() != "".join(keys):
        raw = have
        i = next(
            j
            for j, k in enumerate(keys)
            if raw[j * KEY_NBYTES : (j + 1) * KEY_NBYTES].hex() != k
        )
        raise EnvelopeError(
            f"object {i} carries key "
            f"{raw[i * KEY_NBYTES : (i + 1) * KEY_NBYTES].hex()}, expected {keys[i]}"
        )
