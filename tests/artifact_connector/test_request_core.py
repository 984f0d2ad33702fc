# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keys, the write path (encode_objects) and the read path (read_rows)
through a real /dev/shm store."""

import os
from typing import NamedTuple

import numpy as np
import pytest

from vllm.distributed.artifact_connector.protocol import ObjectRefs
from vllm.distributed.artifact_connector.request_core import (
    ENVELOPE_NBYTES,
    CoverageError,
    EnvelopeError,
    KeySpace,
    check_coverage,
    encode_objects,
    read_rows,
    tail_block_hash,
)
from vllm.distributed.artifact_connector.shm import (
    ShmStoreReader,
    ShmStoreWriter,
    make_namespace,
)
from vllm.distributed.artifact_connector.store import (
    ChecksumMismatchError,
    ObjectMissingError,
    checksum,
)
from vllm.utils.hashing import sha256
from vllm.utils.routed_experts_rows import RowSpec
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

init_none_hash(sha256)
SPEC = RowSpec(3, 2, np.dtype(np.int16))


class Ref(NamedTuple):
    """One object of a request, as the tests manipulate it."""

    key: str
    start: int
    num_rows: int
    checksum: int
    weight_version: str


def table(refs: list[Ref]) -> ObjectRefs:
    return ObjectRefs.build(*([list(c) for c in zip(*refs)] if refs else [[]] * 5))


KS = KeySpace("0123456789abcdef0123456789abcdef")


# ----------------------------------------------------------------- keys
def test_keys_are_deterministic_and_separate_identities():
    h = b"\x01" * 32
    k = KS.key("v1", h, 16, tail=False)
    assert k == KeySpace(KS.namespace).key("v1", h, 16, tail=False)
    assert len(k) == 64 and int(k, 16) >= 0
    others = {
        KeySpace("another-namespace").key("v1", h, 16, tail=False),
        KS.key("v2", h, 16, tail=False),  # another weight version
        KS.key("v1", b"\x02" * 32, 16, tail=False),
        KS.key("v1", h, 8, tail=False),
        KS.key("v1", h, 16, tail=True),
        KS.key("v1", h, 15, tail=True),
    }
    assert k not in others and len(others) == 6
    with pytest.raises(CoverageError):
        KS.key("v1", b"", 16, tail=False)


def test_tail_hash_uses_the_prefix_cache_function_and_extra_keys():
    tokens = list(range(40))
    h0 = hash_block_tokens(sha256, None, tokens[:16], None)
    h1 = hash_block_tokens(sha256, h0, tokens[16:32], None)
    t = tail_block_hash(sha256, h1, tokens[32:39])
    assert t == bytes(hash_block_tokens(sha256, h1, tokens[32:39], None))
    assert tail_block_hash(sha256, h1, tokens[32:39], (("lora", "x"),)) != t
    assert tail_block_hash(sha256, h0, tokens[32:39]) != t
    with pytest.raises(CoverageError):
        tail_block_hash(sha256, None, [])


def test_dtype_follows_the_number_of_experts():
    assert RowSpec.for_experts(48, 8, 128).dtype == np.uint8
    assert RowSpec.for_experts(48, 8, 256).dtype == np.uint8
    assert RowSpec.for_experts(48, 8, 257).dtype == np.int16  # not uint16
    assert RowSpec.for_experts(48, 8, 128).row_nbytes == 384
    for dt in (np.uint16, np.int32):  # the config's strict-parity choices
        assert RowSpec(4, 2, np.dtype(dt)).dtype == dt
    with pytest.raises(ValueError):
        RowSpec(4, 2, np.dtype(np.float32))


# ----------------------------------------------------------------- write/read
def _publish(writer, rows, block, version="v1", start=0):
    """Publish ``rows`` (starting at row ``start``) as full blocks plus a
    tail; returns the refs in order."""
    n = rows.shape[0]
    cuts = list(range(0, n, block))
    pieces = [rows[c : c + block] for c in cuts]
    keys = [
        KS.key(version, b"h%d" % (start + c), len(p), tail=len(p) < block)
        for c, p in zip(cuts, pieces)
    ]
    starts = [start + c for c in cuts]
    lengths = np.array(
        [len(p) * SPEC.row_nbytes + ENVELOPE_NBYTES for p in pieces], np.int64
    )
    res = writer.put_batch(
        keys,
        lengths,
        lambda buf: encode_objects(
            SPEC, keys, starts, [p.data.cast("B") for p in pieces], buf
        ),
    )
    return [
        Ref(k, s, len(p), ref.checksum, version)
        for k, s, p, ref in zip(keys, starts, pieces, res.refs)
    ]


@pytest.fixture
def store(shm_root):
    w = ShmStoreWriter(shm_root, make_namespace())
    r = ShmStoreReader(shm_root, w.namespace)
    yield w, r
    r.close()
    w.close()


def test_round_trip_and_prompt_start(store):
    w, r = store
    truth = np.random.default_rng(0).integers(0, 300, (45, 3, 2)).astype(np.int16)
    refs = _publish(w, truth, 16)
    assert [x.num_rows for x in refs] == [16, 16, 13]
    np.testing.assert_array_equal(read_rows(r, SPEC, table(refs), 45), truth)
    for first in (0, 1, 16, 17, 44, 45):
        got = read_rows(r, SPEC, table(refs), 45, first_row=first)
        np.testing.assert_array_equal(got, truth[first:])
    out = np.zeros((45 - 20, 3, 2), np.int16)
    assert read_rows(r, SPEC, table(refs), 45, first_row=20, out=out) is out
    np.testing.assert_array_equal(out, truth[20:])


def test_objects_before_the_prompt_start_are_not_read(store, shm_root):
    w, r = store
    truth = np.arange(64 * 6, dtype=np.int16).reshape(64, 3, 2)
    refs = _publish(w, truth, 16)
    # Corrupt the first object: a read that touches it fails; a read from
    # row 16 on never does.
    _flip_byte(w, 5)
    with pytest.raises(ChecksumMismatchError):
        read_rows(r, SPEC, table(refs), 64)
    np.testing.assert_array_equal(
        read_rows(r, SPEC, table(refs), 64, first_row=16), truth[16:]
    )


def test_envelope_and_coverage_mismatches_raise_and_leave_out_untouched(store):
    w, r = store
    truth = np.ones((40, 3, 2), np.int16)
    refs = _publish(w, truth, 16)
    out = np.full((40, 3, 2), 7, np.int16)
    cases = [
        # a reference that points at another object's key but claims rows
        # the envelope does not describe
        (
            [refs[1]._replace(start=0), refs[0]._replace(start=16), refs[2]],
            EnvelopeError,
        ),
        (
            [refs[0], refs[2]._replace(start=16), refs[1]._replace(start=24)],
            EnvelopeError,
        ),
        ([refs[0], refs[1]], CoverageError),
        ([refs[0], refs[0], refs[2]], CoverageError),
        ([refs[0], refs[1]._replace(checksum=1), refs[2]], ObjectMissingError),
    ]
    for bad, err in cases:
        with pytest.raises(err):
            read_rows(r, SPEC, table(bad), 40, out=out)
        assert (out == 7).all()
    # Another row format: the objects do not have the size it implies.
    with pytest.raises(EnvelopeError, match="bytes"):
        read_rows(r, RowSpec(3, 2, np.dtype(np.uint8)), table(refs), 40)
    # Same size, other layout: the envelope names the difference.
    with pytest.raises(EnvelopeError, match="int16"):
        read_rows(r, RowSpec(6, 1, np.dtype(np.int16)), table(refs), 40)
    with pytest.raises(ValueError):
        read_rows(r, SPEC, table(refs), 40, out=np.zeros((40, 3, 2), np.uint8))


def _flip_byte(writer, offset):
    """Flip one byte of the store's (only) arena, behind its back."""
    path = os.path.join(writer.root, writer.namespace)
    (arena,) = [n for n in os.listdir(path) if n.endswith(".arena")]
    with open(os.path.join(path, arena), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x55]))


def test_a_changed_byte_fails_the_checksum(store, shm_root):
    w, r = store
    truth = np.ones((32, 3, 2), np.int16)
    refs = _publish(w, truth, 16)
    out = np.full((32, 3, 2), 7, np.int16)
    _flip_byte(
        w, (16 * SPEC.row_nbytes + ENVELOPE_NBYTES) + 64 + 3
    )  # inside object 1's payload
    with pytest.raises(ChecksumMismatchError):
        read_rows(r, SPEC, table(refs), 32, out=out)
    assert (out == 7).all()


def test_encode_writes_a_self_describing_envelope():
    rows = np.arange(2 * 6, dtype=np.int16).reshape(2, 3, 2)
    key = KS.key("v1", b"h", 2, tail=True)
    buf = np.zeros((2 * SPEC.row_nbytes + ENVELOPE_NBYTES), np.uint8)
    (whole,) = encode_objects(
        SPEC, [key], [30], [rows.data.cast("B")], buf, tails=[True]
    )
    assert int(whole) == checksum(buf)
    assert buf[: rows.nbytes].tobytes() == rows.tobytes()
    env = buf[-ENVELOPE_NBYTES:]
    assert env[:4].tobytes() == b"VART"
    assert int.from_bytes(env[12:16].tobytes(), "little") == 30  # first row
    assert int.from_bytes(env[16:20].tobytes(), "little") == 2  # rows
    assert int.from_bytes(env[24:32].tobytes(), "little") == checksum(rows.tobytes())
    assert env[32:64].tobytes().hex() == key
    with pytest.raises(EnvelopeError):  # not a whole number of rows
        encode_objects(SPEC, [key], [0], [rows.data.cast("B")[:-1]], buf[:-1])
    with pytest.raises(EnvelopeError):
        encode_objects(
            SPEC,
            [key],
            [0],
            [rows.data.cast("B")],
            np.zeros(buf.shape[0] + 1, np.uint8),
        )


def test_check_coverage():
    refs = [
        Ref("a" * 64, 0, 16, 1, "v"),
        Ref("b" * 64, 16, 4, 2, "v"),
    ]
    check_coverage(table(refs), 20)
    with pytest.raises(CoverageError, match="gap"):
        check_coverage(table(refs[1:]), 4)
    with pytest.raises(CoverageError, match="overlap"):
        check_coverage(table([refs[0], refs[0]]), 32)
    with pytest.raises(CoverageError):
        check_coverage(table(refs), 21)
