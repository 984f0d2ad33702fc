# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keys, the write path (encode_objects) and the read path (read_batch,
read_rows, and the route reader's thread) through a real /dev/shm store."""

import os
import threading
import time
from typing import NamedTuple

import numpy as np
import pytest

from vllm.distributed.artifact_connector.protocol import ObjectRefs
from vllm.distributed.artifact_connector.request_core import (
    ENVELOPE_NBYTES,
    CoverageError,
    EnvelopeError,
    KeySpace,
    RowsRead,
    check_coverage,
    encode_objects,
    read_batch,
    read_rows,
    tail_block_hash,
)
from vllm.distributed.artifact_connector.route_reader import RouteRead, RouteReader
from vllm.distributed.artifact_connector.route_results import RouteResults
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
    pages = np.zeros((len(pieces), block, *SPEC.row_shape), SPEC.dtype)
    for i, p in enumerate(pieces):
        pages[i, : len(p)] = p
    nrows = [len(p) for p in pieces]
    res = writer.put_batch(
        keys,
        lengths,
        lambda buf: encode_objects(
            SPEC, keys, starts, nrows, pages, range(len(pieces)), buf
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


def _requests(w, n: int, seed: int = 0):
    """``n`` published requests of 5 to 60 rows: (truth, refs) each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        truth = rng.integers(0, 300, (int(rng.integers(5, 60)), 3, 2)).astype(np.int16)
        out.append((truth, _publish(w, truth, 16, version=f"v{seed}-{i}")))
    return out


def test_read_batch_reads_many_requests_as_each_alone(store):
    w, r = store
    reqs = _requests(w, 9)
    firsts = [0, 1, 16, 17, len(reqs[4][0]), 3, 0, 20, 5]
    reads = [
        RowsRead(table(refs), len(t), min(f, len(t)))
        for (t, refs), f in zip(reqs, firsts)
    ]
    got = read_batch(r, SPEC, reads)
    for (truth, _), rd, rows in zip(reqs, reads, got):
        np.testing.assert_array_equal(rows, truth[rd.first_row :])
        np.testing.assert_array_equal(
            rows, read_rows(r, SPEC, rd.refs, rd.num_rows, first_row=rd.first_row)
        )


def test_a_fault_in_one_request_of_a_batch_costs_that_request_alone(store):
    """A corrupted object, a gap in the refs and a missing version, each in
    its own request of one batch: those three get their typed errors, the
    others their exact rows."""
    w, r = store
    reqs = _requests(w, 6)
    reads = [RowsRead(table(refs), len(t)) for t, refs in reqs]
    # Request 1: its first object's bytes changed behind the store.
    # (The arena's 64-byte header, then request 0's objects back to back.)
    req0 = sum(x.num_rows * SPEC.row_nbytes + ENVELOPE_NBYTES for x in reqs[0][1])
    _flip_byte(w, 64 + req0 + 3)
    # Request 3: a gap (its second object left out).
    t3, refs3 = reqs[3]
    reads[3] = RowsRead(table(refs3[:1] + refs3[2:]), len(t3))
    # Request 4: a version that was never published.
    t4, refs4 = reqs[4]
    reads[4] = RowsRead(
        table([refs4[0]._replace(checksum=refs4[0].checksum ^ 1), *refs4[1:]]), len(t4)
    )
    got = read_batch(r, SPEC, reads)
    assert isinstance(got[1], ChecksumMismatchError), got[1]
    assert isinstance(got[3], CoverageError), got[3]
    assert isinstance(got[4], ObjectMissingError), got[4]
    for i in (0, 2, 5):
        np.testing.assert_array_equal(got[i], reqs[i][0])


def test_read_batch_in_runs_equals_one_pass_and_a_late_fault_returns_no_rows(store):
    """``pause_every`` (the route reader's runs of objects): the same rows;
    a corrupted object in a late run is that request's typed error, never
    the rows of the runs before it."""
    w, r = store
    reqs = _requests(w, 4, seed=7)
    reads = [RowsRead(table(refs), len(t)) for t, refs in reqs]
    for got, (truth, _) in zip(read_batch(r, SPEC, reads, pause_every=2), reqs):
        np.testing.assert_array_equal(got, truth)
    # The last object of the last request (the last run) changed behind
    # the store.
    end = 64 + sum(
        x.num_rows * SPEC.row_nbytes + ENVELOPE_NBYTES for _, refs in reqs for x in refs
    )
    _flip_byte(w, end - ENVELOPE_NBYTES - 1)
    got = read_batch(r, SPEC, reads, pause_every=2)
    assert isinstance(got[3], ChecksumMismatchError), got[3]
    for i in range(3):
        np.testing.assert_array_equal(got[i], reqs[i][0])


class _HeldReader:
    """A real store reader whose reads wait for ``release`` (a held thread,
    to show what the engine side does while a read is under way)."""

    def __init__(self, reader):
        self._reader = reader
        self.release = threading.Event()
        self.reading = threading.Event()

    def read_into(self, *args, **kwargs):
        self.reading.set()
        assert self.release.wait(30)
        return self._reader.read_into(*args, **kwargs)

    def close(self):
        self._reader.close()


def test_the_route_reader_never_makes_the_engine_thread_wait(store, shm_root):
    w, _ = store
    reqs = _requests(w, 5)
    held = _HeldReader(ShmStoreReader(shm_root, w.namespace))
    results = RouteResults()
    reads = RouteReader(held, SPEC, results)  # type: ignore[arg-type]
    try:
        jobs = [
            RouteRead(f"r{i}", 1, RowsRead(table(refs), len(t), 2), len(t) - 1)
            for i, (t, refs) in enumerate(reqs)
        ]
        t0 = time.monotonic()
        reads.submit(jobs)
        assert held.reading.wait(30)
        # The read is stuck; the engine side goes on.
        assert results.take() == [] and results.pending == 5
        results.wait_all(0.01)
        assert results.take() == [] and time.monotonic() - t0 < 20
        held.release.set()
        done = []
        deadline = time.monotonic() + 30
        while len(done) < 5 and time.monotonic() < deadline:
            results.wait_all(0.1)
            done += results.take()
        assert results.pending == 0
        by_id = {res.req_id: res for res in done}
        for i, (truth, _) in enumerate(reqs):
            res = by_id[f"r{i}"]
            assert res.error is None
            # Rows [first_row, end): the cut at the request's boundary.
            np.testing.assert_array_equal(res.rows, truth[2 : len(truth) - 1])
    finally:
        held.release.set()
        reads.close()


class _DyingOnceReader:
    """A real store reader whose first read kills the reader thread (an
    exception no read path catches)."""

    def __init__(self, reader):
        self._reader = reader
        self.died = False

    def read_into(self, *args, **kwargs):
        if not self.died:
            self.died = True
            raise SystemExit("stand-in for a crash of the thread")
        return self._reader.read_into(*args, **kwargs)

    def close(self):
        self._reader.close()


def _wait_results(results, n):
    done = []
    deadline = time.monotonic() + 30
    while len(done) < n and time.monotonic() < deadline:
        results.wait_all(0.1)
        done += results.take()
    return done


def test_the_reader_thread_fails_what_it_held_and_is_started_again(store, shm_root):
    """No request waits forever for a reader thread that is gone: the read
    in flight gets an ArtifactError, and the next read is served exactly by
    a new thread."""
    w, _ = store
    (t0, refs0), (t1, refs1) = _requests(w, 2, seed=5)
    results = RouteResults()
    dying = _DyingOnceReader(ShmStoreReader(shm_root, w.namespace))
    reads = RouteReader(dying, SPEC, results)  # type: ignore[arg-type]
    try:
        reads.submit([RouteRead("a", 1, RowsRead(table(refs0), len(t0)), len(t0))])
        (a,) = _wait_results(results, 1)
        assert a.req_id == "a" and a.rows is None
        assert a.error.startswith("ArtifactError: the route reader thread died")
        reads.submit([RouteRead("b", 1, RowsRead(table(refs1), len(t1)), len(t1))])
        (b,) = _wait_results(results, 1)
        assert b.req_id == "b" and b.error is None
        np.testing.assert_array_equal(b.rows, t1)
        assert results.pending == 0
    finally:
        reads.close()


def test_the_route_reader_reports_a_store_fault_per_request(store, shm_root):
    w, _ = store
    (t0, refs0), (t1, refs1) = _requests(w, 2)
    results = RouteResults()
    reads = RouteReader(ShmStoreReader(shm_root, w.namespace), SPEC, results)
    try:
        bad = table([refs1[0]._replace(checksum=refs1[0].checksum ^ 1), *refs1[1:]])
        reads.submit(
            [
                RouteRead("ok", 1, RowsRead(table(refs0), len(t0)), len(t0)),
                RouteRead("lost", 1, RowsRead(bad, len(t1)), len(t1)),
            ]
        )
        done = _wait_results(results, 2)
        by_id = {res.req_id: res for res in done}
        np.testing.assert_array_equal(by_id["ok"].rows, t0)
        assert by_id["lost"].rows is None
        assert by_id["lost"].error.startswith("ObjectMissingError: ")
    finally:
        reads.close()


def test_encode_writes_a_self_describing_envelope():
    """Full pages (one array copy) then a tail (object by object): payload,
    envelope, and the store checksum over both."""
    block = 4
    pages = np.arange(3 * block * 6, dtype=np.int16).reshape(3, block, 3, 2)
    keys = [
        KS.key("v1", b"h%d" % i, n, tail=n < block) for i, n in enumerate((4, 4, 2))
    ]
    rb = SPEC.row_nbytes
    sizes = [4 * rb + ENVELOPE_NBYTES] * 2 + [2 * rb + ENVELOPE_NBYTES]
    buf = np.zeros(sum(sizes), np.uint8)
    # Objects from pages 2, 0 and the first two rows of page 1.
    sums = encode_objects(
        SPEC, keys, [0, 4, 8], [4, 4, 2], pages, [2, 0, 1], buf, tails=[0, 0, 1]
    )
    o = 0
    for i, (page, n, start) in enumerate(((2, 4, 0), (0, 4, 4), (1, 2, 8))):
        obj = buf[o : o + sizes[i]]
        assert int(sums[i]) == checksum(obj)
        assert obj[: n * rb].tobytes() == pages[page, :n].tobytes()
        env = obj[-ENVELOPE_NBYTES:]
        assert env[:4].tobytes() == b"VART"
        assert env[7] == (1 if n < block else 0)  # tail flag
        assert int.from_bytes(env[12:16].tobytes(), "little") == start
        assert int.from_bytes(env[16:20].tobytes(), "little") == n
        assert not env[20:32].any()
        assert env[32:64].tobytes().hex() == keys[i]
        o += sizes[i]
    with pytest.raises(EnvelopeError):  # more rows than a page holds
        encode_objects(SPEC, keys[:1], [0], [5], pages, [0], buf[: sizes[0] + rb])
    with pytest.raises(EnvelopeError):  # the buffer is not exactly the objects
        encode_objects(SPEC, keys[:1], [0], [4], pages, [0], buf[: sizes[0] + 1])
    with pytest.raises(EnvelopeError):  # pages of another row shape
        encode_objects(SPEC, keys[:1], [0], [4], pages[:, :, :2], [0], buf[: sizes[0]])


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
