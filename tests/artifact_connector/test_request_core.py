# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keys, envelopes, coverage and materialisation, including a property test
of a whole request life cycle (cached start, chunks, rejected suffixes,
recomputation, tail) through the worker buffer and a store."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.distributed.artifact_connector.buffer import (
    RequestRowBuffer,
    RowGapError,
)
from vllm.distributed.artifact_connector.request_core import (
    ENVELOPE_NBYTES,
    CoverageError,
    EnvelopeError,
    KeySpace,
    RowSpec,
    Segment,
    check_coverage,
    decode_object,
    encode_segments,
    materialize,
    plan_coverage,
    publish_rows,
    read_request,
    tail_block_hash,
)
from vllm.distributed.artifact_connector.shm import ShmObjectStore, make_namespace
from vllm.distributed.artifact_connector.store import (
    ChecksumAlgorithm,
    InMemoryObjectStore,
    ObjectBatch,
    ObjectMissingError,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

init_none_hash(sha256)
HASH_FN = sha256
KS = KeySpace("ns-test", "weights-v1")


def chain_hashes(tokens, block_size, extra=None):
    out, parent = [], None
    for b in range(len(tokens) // block_size):
        parent = hash_block_tokens(
            HASH_FN, parent, tokens[b * block_size : (b + 1) * block_size], extra
        )
        out.append(bytes(parent))
    return out


def tail_hash_for(tokens, hashes, block_size, num_rows, extra=None):
    n_full = num_rows // block_size
    if num_rows % block_size == 0:
        return None
    parent = hashes[n_full - 1] if n_full else None
    return tail_block_hash(
        HASH_FN, parent, tokens[n_full * block_size : num_rows], extra
    )


# ----------------------------------------------------------------- keys
def test_keys_are_deterministic_and_separate_identities():
    h = b"\x01" * 32
    k = KS.block_key(h, 16)
    assert k == KeySpace("ns-test", "weights-v1").block_key(h, 16)
    assert len(k) == 64 and int(k, 16) >= 0
    others = {
        KeySpace("ns-other", "weights-v1").block_key(h, 16),
        KeySpace("ns-test", "weights-v2").block_key(h, 16),
        KeySpace("ns-test", "weights-v1", schema_version=2).block_key(h, 16),
        KS.block_key(b"\x02" * 32, 16),
        KS.block_key(h, 8),
        KS.tail_key(h, 16),
        KS.tail_key(h, 15),
    }
    assert k not in others and len(others) == 7


def test_tail_hash_uses_prefix_cache_function_and_extra_keys():
    tokens = list(range(40))
    hashes = chain_hashes(tokens, 16)
    t = tail_block_hash(HASH_FN, hashes[1], tokens[32:39])
    assert t == bytes(hash_block_tokens(HASH_FN, hashes[1], tokens[32:39], None))
    # The tail of a request whose rows fill the block is the block itself.
    full = tail_block_hash(HASH_FN, hashes[0], tokens[16:32])
    assert full == hashes[1]
    salted = tail_block_hash(HASH_FN, hashes[1], tokens[32:39], (("lora", "x"),))
    assert salted != t
    assert tail_block_hash(HASH_FN, hashes[0], tokens[32:39]) != t
    with pytest.raises(CoverageError):
        tail_block_hash(HASH_FN, None, [])


def test_rowspec_dtype_choice():
    assert RowSpec.for_experts(48, 8, 128).dtype == np.uint8
    assert RowSpec.for_experts(48, 8, 256).dtype == np.uint8
    assert RowSpec.for_experts(48, 8, 257).dtype == np.uint16
    assert RowSpec.for_experts(48, 8, 128).row_nbytes == 384
    with pytest.raises(ValueError):
        RowSpec(4, 2, np.dtype(np.int32))


# ----------------------------------------------------------------- coverage
def test_plan_coverage_shapes_and_errors():
    hashes = [bytes([i]) * 32 for i in range(4)]
    segs = plan_coverage(KS, 16, 50, hashes, b"tail")
    assert [(s.start, s.num_rows, s.is_tail) for s in segs] == [
        (0, 16, False),
        (16, 16, False),
        (32, 16, False),
        (48, 2, True),
    ]
    assert [s.start for s in plan_coverage(KS, 16, 48, hashes, first_row=32)] == [32]
    with pytest.raises(CoverageError):
        plan_coverage(KS, 16, 50, hashes)  # tail without hash
    with pytest.raises(CoverageError):
        plan_coverage(KS, 16, 48, hashes, b"tail")  # hash without tail
    with pytest.raises(CoverageError):
        plan_coverage(KS, 16, 80, hashes)  # not enough block hashes
    with pytest.raises(CoverageError):
        plan_coverage(KS, 16, 48, hashes, first_row=8)
    check_coverage(segs, 50)
    with pytest.raises(CoverageError, match="gap"):
        check_coverage([segs[0], segs[2], segs[3]], 50)
    with pytest.raises(CoverageError, match="overlap"):
        check_coverage([segs[0], segs[0]] + segs[1:], 50)
    with pytest.raises(CoverageError):
        check_coverage(segs[:-1], 50)
    with pytest.raises(CoverageError, match="tail"):
        check_coverage([Segment(segs[0].key, 0, 16, True), *segs[1:]], 50)


# ----------------------------------------------------------------- envelope
SPEC = RowSpec(3, 2, np.dtype(np.uint16))


def _rows(n, seed=0, spec=SPEC):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 300, (n, *spec.row_shape)).astype(spec.dtype)


def test_encode_decode_round_trip_and_envelope_checks():
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    rows = _rows(37)
    segs = plan_coverage(KS, 16, 37, hashes, b"t")
    items = encode_segments(SPEC, segs, rows, 0)
    assert [len(v) for _, v in items] == [16 * 12 + 64, 16 * 12 + 64, 5 * 12 + 64]
    seg, got = decode_object(items[2][1], SPEC, segs[2])
    assert seg == segs[2] and (got == rows[32:37]).all()
    raw = bytearray(items[0][1])
    raw[5] ^= 1  # payload byte
    with pytest.raises(EnvelopeError, match="checksum"):
        decode_object(bytes(raw), SPEC)
    with pytest.raises(EnvelopeError, match="rows"):
        decode_object(items[0][1], SPEC, segs[1])  # wrong token range
    with pytest.raises(EnvelopeError, match="key"):
        decode_object(items[0][1], SPEC, Segment(segs[1].key, 0, 16, False))
    with pytest.raises(EnvelopeError):
        decode_object(items[0][1], RowSpec(3, 2, np.dtype(np.uint8)))
    with pytest.raises(EnvelopeError):
        decode_object(items[0][1], RowSpec(2, 3, np.dtype(np.uint16)))
    with pytest.raises(EnvelopeError):
        decode_object(bytes(items[0][1])[: ENVELOPE_NBYTES - 1], SPEC)
    bad_schema = bytearray(items[0][1])
    bad_schema[-64 + 4] = 9
    with pytest.raises(EnvelopeError, match="schema"):
        decode_object(bytes(bad_schema), SPEC)
    with pytest.raises(EnvelopeError):
        encode_segments(SPEC, segs, rows.astype(np.uint8), 0)


def test_materialize_rejects_inconsistent_batches():
    hashes = [bytes([i + 1]) * 32 for i in range(3)]
    rows = _rows(40)
    segs = plan_coverage(KS, 16, 40, hashes, b"t")
    items = dict(encode_segments(SPEC, segs, rows, 0))
    store = InMemoryObjectStore()
    store.put_many(list(items.items()))
    out = materialize(SPEC, segs, store.get_batch([s.key for s in segs]), 40)
    assert (out == rows).all()
    swapped = store.get_batch([segs[1].key, segs[0].key, segs[2].key])
    with pytest.raises(EnvelopeError):
        materialize(SPEC, segs, swapped, 40)
    with pytest.raises(CoverageError):
        materialize(SPEC, segs, store.get_batch([s.key for s in segs[:2]]), 40)
    # Objects of another weight version are never found.
    other = plan_coverage(KeySpace("ns-test", "weights-v2"), 16, 40, hashes, b"t")
    with pytest.raises(ObjectMissingError):
        read_request(store, SPEC, other, 40)
    # A payload corrupted outside a verifying store: envelope checksum.
    vals = [bytes(items[s.key]) for s in segs]
    vals[1] = vals[1][:3] + bytes([vals[1][3] ^ 4]) + vals[1][4:]
    batch = ObjectBatch.from_values(vals, [0, 0, 0])
    with pytest.raises(EnvelopeError, match="checksum"):
        materialize(SPEC, segs, batch, 40, verify_payload_checksums=True)


# ----------------------------------------------------------------- life cycle
@st.composite
def lifecycles(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_tokens = draw(st.integers(2, 120))
    num_rows = num_tokens - 1
    cached = draw(st.integers(0, num_rows // block_size)) * block_size
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["chunk", "chunk", "reject", "recompute", "publish"]),
                st.integers(1, 40),
                st.integers(0, 1000),
            ),
            max_size=25,
        )
    )
    dtype = draw(st.sampled_from([np.uint8, np.uint16]))
    return block_size, num_tokens, cached, ops, dtype


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(lifecycles())
def test_request_lifecycle_materialises_fed_rows(case):
    block_size, num_tokens, cached, ops, dtype = case
    spec = RowSpec(3, 2, np.dtype(dtype))
    num_rows = num_tokens - 1
    rng = np.random.default_rng(num_tokens * 31 + cached)
    tokens = rng.integers(0, 50_000, num_tokens).tolist()
    hashes = chain_hashes(tokens, block_size)
    hi = 256 if dtype == np.uint8 else 65536
    store = InMemoryObjectStore()
    truth = rng.integers(0, hi, (num_rows, 3, 2)).astype(dtype)

    # An earlier request published the cached prefix.
    if cached:
        publish_rows(store, KS, spec, block_size, 0, truth[:cached], hashes)

    buf = RequestRowBuffer(spec, block_size, cached, max_rows=4096)
    published: dict[int, tuple] = {}

    def publish(limit):
        first, ready = buf.ready_blocks(limit)
        if len(ready):
            for seg, ref in publish_rows(
                store, KS, spec, block_size, first, ready, hashes
            ):
                published[seg.start] = (seg, ref)
            buf.release(first + len(ready))

    for op, n, r in ops:
        end = buf.end
        if op == "chunk" and end < num_rows:
            m = min(n, num_rows - end)
            buf.write(end, truth[end : end + m])
        elif op == "reject" and end < num_rows:
            # Rows of a suffix that is later rejected and recomputed.
            m = min(n, num_rows - end)
            buf.write(end, rng.integers(0, hi, (m, 3, 2)).astype(dtype))
            buf.truncate(end)
        elif op == "recompute" and end > cached:
            # Preemption: recompute from a block boundary >= cached start.
            lo = cached + (r % (end - cached + 1))
            if lo < buf.committed:
                lo -= lo % block_size
            # Recomputed rows may differ (benign divergence).
            new = truth[lo:end].copy()
            if len(new) and r % 3 == 0:
                new[0, 0, 0] ^= 1
                truth[lo, 0, 0] ^= 1
            buf.write(lo, new)
        elif op == "publish":
            publish(cached + r % (num_rows + 1))
    if buf.end < num_rows:
        buf.write(buf.end, truth[buf.end :])
    publish(num_rows)
    first, rest = buf.finalize(num_rows)
    th = tail_hash_for(tokens, hashes, block_size, num_rows)
    for seg, ref in publish_rows(
        store, KS, spec, block_size, first, rest, hashes, tail_hash=th
    ):
        published[seg.start] = (seg, ref)

    # Scheduler side: prefix by key, own objects by exact version.
    segs = plan_coverage(KS, block_size, num_rows, hashes, th)
    versions = [published[s.start][1] if s.start >= cached else None for s in segs]
    assert all(published[s.start][0] == s for s in segs if s.start >= cached)
    out = read_request(store, spec, segs, num_rows, versions)
    assert out.shape == (num_rows, 3, 2) and out.dtype == dtype
    np.testing.assert_array_equal(out, truth)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 4, 16]),
    st.integers(1, 80),
    st.data(),
)
def test_missing_or_foreign_object_always_raises(block_size, num_rows, data):
    tokens = list(range(num_rows + 1))
    hashes = chain_hashes(tokens, block_size)
    th = tail_hash_for(tokens, hashes, block_size, num_rows)
    rows = _rows(num_rows, num_rows)
    store = InMemoryObjectStore()
    segs = plan_coverage(KS, block_size, num_rows, hashes, th)
    items = encode_segments(SPEC, segs, rows, 0)
    drop = data.draw(st.integers(0, len(items) - 1))
    store.put_many([it for i, it in enumerate(items) if i != drop])
    with pytest.raises(ObjectMissingError):
        read_request(store, SPEC, segs, num_rows)
    # Putting the object of another position under the missing key: caught.
    other = (drop + 1) % len(items)
    if other != drop:
        store.put(segs[drop].key, items[other][1])
        with pytest.raises(EnvelopeError):
            read_request(store, SPEC, segs, num_rows)


def test_gap_in_buffer_is_rejected():
    buf = RequestRowBuffer(SPEC, 4, 8)
    with pytest.raises(RowGapError):
        buf.write(9, _rows(2))


def test_crc32_envelopes_still_decode_and_verify():
    hashes = [bytes([i + 1]) * 32 for i in range(2)]
    rows = _rows(32)
    segs = plan_coverage(KS, 16, 32, hashes)
    items = encode_segments(SPEC, segs, rows, 0, checksum=ChecksumAlgorithm.CRC32)
    seg, got = decode_object(items[1][1], SPEC, segs[1])
    assert (got == rows[16:]).all()
    raw = bytearray(items[1][1])
    raw[7] ^= 2
    with pytest.raises(EnvelopeError, match="checksum"):
        decode_object(bytes(raw), SPEC)


def test_read_request_through_shm_store_with_out(shm_root):
    spec = RowSpec(4, 3, np.dtype(np.uint16))
    block = 4
    num_rows = 4 * 9 + 3
    tokens = list(range(num_rows + 1))
    hashes = chain_hashes(tokens, block)
    th = tail_hash_for(tokens, hashes, block, num_rows)
    truth = _rows(num_rows, 5, spec)
    w = ShmObjectStore.create(shm_root, make_namespace("rc"))
    other = _rows(8, 6, spec)
    # A prefill chunk, then one block per step interleaved with another
    # request's blocks, then the tail: runs and isolated objects.
    published = publish_rows(w, KS, spec, block, 0, truth[:16], hashes)
    for b in range(4, 9):
        published += publish_rows(
            w,
            KS,
            spec,
            block,
            b * block,
            truth[b * block : (b + 1) * block],
            hashes[b : b + 1],
            first_block_hash_index=b,
        )
        publish_rows(w, KeySpace("other", "w"), spec, block, 0, other, hashes[:2])
    published += publish_rows(w, KS, spec, block, 36, truth[36:], hashes, tail_hash=th)
    segs = plan_coverage(KS, block, num_rows, hashes, th)
    assert [s for s, _ in published] == segs
    r = ShmObjectStore.open_reader(shm_root, w.namespace)
    out = np.zeros((num_rows, 4, 3), np.uint16)
    got = read_request(r, spec, segs, num_rows, [ref for _, ref in published], out=out)
    assert got is out
    np.testing.assert_array_equal(out, truth)
    np.testing.assert_array_equal(read_request(r, spec, segs, num_rows), truth)
    with pytest.raises(ValueError):
        read_request(r, spec, segs, num_rows, out=np.zeros((num_rows, 4, 3), np.uint8))
    # An object of the wrong size under a planned key: envelope error.
    w.put(segs[2].key, b"\x00" * 10)
    with pytest.raises(EnvelopeError):
        read_request(r, spec, segs, num_rows)
    r.close()
    w.close()
