# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's row slab and per-attempt rows; protocol messages."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.distributed.artifact_connector import buffer
from vllm.distributed.artifact_connector.buffer import (
    AttemptRows,
    RowBufferCapacityError,
    RowGapError,
    RowOverlapError,
    RowSlab,
)
from vllm.distributed.artifact_connector.protocol import (
    Abort,
    ArtifactSchedulerMeta,
    ArtifactWorkerReport,
    AttemptFailed,
    AttemptStart,
    BlockHashes,
    Discard,
    Finalize,
    FinalizeAck,
    ObjectRefs,
    Release,
)
from vllm.utils.routed_experts_rows import RowSpec

SPEC = RowSpec(2, 2)


def rows(n, v=0):
    return np.full((n, 2, 2), v, np.uint8)


def write(a: AttemptRows, start: int, data: np.ndarray, version: str) -> None:
    """Rows through ``place``, copied where it says (as ``write_step`` does)."""
    i = 0
    for page, off, take in a.place(start, data.shape[0], version):
        a.slab.pages[page, off : off + take] = data[i : i + take]
        i += take


def test_attempt_rows_rules():
    slab = RowSlab(SPEC, 4, 8)
    with pytest.raises(RowOverlapError):
        AttemptRows(slab, 6)  # cached start not on a block boundary
    a = AttemptRows(slab, 8)
    write(a, 8, rows(6, 1), "v1")
    with pytest.raises(RowGapError):
        write(a, 15, rows(1), "v1")
    write(a, 12, rows(3, 2), "v2")  # replaces the suffix from row 12 on
    assert (a.committed, a.end) == (8, 15)
    hashes = {2: b"h2", 3: b"h3"}
    ((start, page, version, h),) = a.take_blocks(hashes)  # block 3 is not full
    assert (start, version, h) == (8, "v1", b"h2") and (slab.pages[page] == 1).all()
    assert hashes == {3: b"h3"}  # a used hash is removed
    slab.free(page)
    with pytest.raises(RowOverlapError):
        write(a, 11, rows(1), "v1")  # inside rows handed to publication
    with pytest.raises(RowGapError):
        a.take_tail(16)  # past the rows received
    start, page, n, version = a.take_tail(14)  # row 14 is dropped
    assert (start, n, version) == (12, 2, "v2")
    assert (slab.pages[page, :2] == 2).all()
    slab.free(page)
    assert a.take_tail(14) is None  # already cut on that boundary
    a.drop()
    assert slab.num_free() == 8


def test_a_block_straddling_a_weight_update_keeps_the_older_version():
    slab = RowSlab(SPEC, 4, 4)
    a = AttemptRows(slab, 0)
    write(a, 0, rows(2), "old")
    write(a, 2, rows(3), "new")
    ((_, _, version, _),) = a.take_blocks({0: b"h"})
    assert version == "old"
    assert a.take_tail(5)[3] == "new"


def test_slab_exhaustion_is_typed_and_pages_come_back(monkeypatch):
    monkeypatch.setattr(buffer, "PAGE_WAIT_S", 0.01)
    slab = RowSlab(SPEC, 4, 2)
    a = AttemptRows(slab, 0)
    write(a, 0, rows(8), "v")
    with pytest.raises(RowBufferCapacityError):
        write(a, 8, rows(1), "v")
    ((_, page, _, _), _) = a.take_blocks({0: b"a", 1: b"b"})
    slab.free_later([page])  # as the publication thread does
    write(a, 8, rows(1), "v")
    assert slab.num_free() == 0


def test_slab_is_sized_from_the_scheduler_limits():
    """One partial page per running request and one per attempt that waits
    with its rows (preempted, finalizing, draining: defect m), plus the
    pages the steps in flight complete."""
    slab = RowSlab.for_scheduler(
        RowSpec(48, 8),
        16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        steps_in_flight=3,
    )
    assert slab.num_pages == 2 * 256 + 3 * (8192 // 16 + 256)
    assert slab.nbytes == slab.num_pages * 16 * 48 * 8


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([1, 3, 16]),
    st.integers(0, 3),
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 5)), min_size=1, max_size=25),
    st.integers(0, 15),
)
def test_rows_round_trip_through_pages(block, cached_blocks, chunks, cut):
    """Random chunks, each possibly rewriting a rejected suffix, published
    block by block as they complete: what comes out of the pages is exactly
    the rows last written, and no page leaks."""
    slab = RowSlab(SPEC, block, 64)
    start = cached_blocks * block
    a = AttemptRows(slab, start)
    truth: dict[int, np.ndarray] = {}
    published: dict[int, np.ndarray] = {}
    pos = start
    rng = np.random.default_rng(len(chunks))
    for n, rewind in chunks:
        pos = max(a.committed, pos - rewind)  # a rejected suffix comes again
        data = rng.integers(0, 256, (n, 2, 2), dtype=np.uint8)
        write(a, pos, data, "v")
        for i in range(n):
            truth[pos + i] = data[i]
        pos += n
        for k in [k for k in truth if k >= pos]:
            del truth[k]
        hashes = {b: b"h" for b in range(a.committed // block, a.end // block)}
        for s, page, _, _ in a.take_blocks(hashes):
            for i in range(block):
                published[s + i] = slab.pages[page, i].copy()
            slab.free_later([page])
        assert a.end - a.committed < block
    end = max(a.committed, pos - min(cut, pos - a.committed))
    tail = a.take_tail(end)
    if tail is not None:
        s, page, n, _ = tail
        for i in range(n):
            published[s + i] = slab.pages[page, i].copy()
        slab.free_later([page])
    assert sorted(published) == list(range(start, end))
    for r, value in published.items():
        np.testing.assert_array_equal(value, truth[r])
    a.drop()
    assert slab.num_free() == 64


def _messages():
    h = b"\x01" * 32
    return [
        ArtifactSchedulerMeta(
            starts=(AttemptStart("req-1", 0, 32, (h, h)),),
            hashes=(BlockHashes("req-1", 0, 2, (h,)),),
            finalizes=(Finalize("req-1", 0, 77, h), Abort("r2", 1, 64)),
            discards=(Discard("r3", 0),),
            releases=(Release("r4", 2),),
        ),
        ArtifactWorkerReport(
            acks=(
                FinalizeAck(
                    "req-1",
                    0,
                    16,
                    ObjectRefs.build(["ab" * 32], [0], [16], [2**63], ["v"]),
                ),
            ),
            failures=(AttemptFailed("r3", 0, "StoreCapacityError", "full"),),
        ),
    ]


@pytest.mark.parametrize("msg", _messages())
def test_protocol_messages_pickle_and_report_emptiness(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg
    assert not msg.is_empty()
    assert type(msg)().is_empty()
    if isinstance(msg, ArtifactSchedulerMeta):
        assert isinstance(pickle.loads(pickle.dumps(msg)).finalizes[1], Abort)
