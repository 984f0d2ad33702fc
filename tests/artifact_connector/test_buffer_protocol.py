# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Row buffer rules and protocol serialisation."""

import pickle

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.distributed.artifact_connector.buffer import (
    RequestRowBuffer,
    RowBufferCapacityError,
    RowGapError,
    RowOverlapError,
)
from vllm.distributed.artifact_connector.protocol import (
    Abort,
    ArtifactSchedulerMeta,
    ArtifactWorkerReport,
    AttemptFailed,
    AttemptStart,
    BlockHashes,
    CommitProgress,
    Finalize,
    FinalizeAck,
    PublishedRef,
)
from vllm.distributed.artifact_connector.request_core import EnvelopeError, RowSpec

SPEC = RowSpec(2, 2, np.dtype(np.uint8))


def rows(n, v=0):
    return np.full((n, 2, 2), v, np.uint8)


def test_buffer_rules():
    with pytest.raises(RowOverlapError):
        RequestRowBuffer(SPEC, 4, 6)  # cached start not block aligned
    b = RequestRowBuffer(SPEC, 4, 8, max_rows=16)
    assert (b.committed, b.end) == (8, 8)
    b.write(8, rows(6, 1))
    with pytest.raises(RowGapError):
        b.write(15, rows(1))
    b.write(12, rows(3, 2))  # overlap replaces and drops the stale suffix
    assert b.end == 15
    first, ready = b.ready_blocks()
    assert first == 8 and len(ready) == 4 and (ready == 1).all()
    with pytest.raises(ValueError):
        ready[0, 0, 0] = 5  # read-only view
    b.release(12)
    assert (b.committed, b.num_rows_held) == (12, 3)
    assert (b.rows(12, 15) == 2).all()
    with pytest.raises(RowOverlapError):
        b.write(10, rows(1))  # inside committed rows, not block aligned
    b.write(8, rows(4, 7))  # recomputation of a committed block
    assert (b.committed, b.end) == (8, 12)
    with pytest.raises(RowBufferCapacityError):
        b.write(12, rows(13))
    b.truncate(10)
    assert b.end == 10
    with pytest.raises(RowOverlapError):
        b.truncate(4)
    with pytest.raises(RowGapError):
        b.finalize(11)
    first, rest = b.finalize(9)
    assert first == 8 and len(rest) == 1
    with pytest.raises(EnvelopeError):
        b.write(8, np.zeros((1, 3, 2), np.uint8))  # wrong shape


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([1, 3, 16]),
    st.lists(st.integers(1, 40), min_size=1, max_size=30),
    st.integers(0, 3),
)
def test_buffer_memory_stays_bounded(block_size, chunks, cached_blocks):
    """Committing as we go keeps at most one partial block plus a chunk."""
    b = RequestRowBuffer(SPEC, block_size, cached_blocks * block_size, max_rows=64)
    pos = b.end
    fed = []
    for n in chunks:
        b.write(pos, rows(n, n % 256))
        fed.append(rows(n, n % 256))
        pos += n
        assert b.num_rows_held < block_size + n
        first, ready = b.ready_blocks()
        b.release(first + len(ready))
    assert b.end == pos
    assert b.nbytes_reserved <= 64 * SPEC.row_nbytes


def _messages():
    return [
        ArtifactSchedulerMeta(
            starts=(AttemptStart("req-1", 0, 32),),
            hashes=(BlockHashes("req-1", 0, 2, (b"\x01" * 32, b"\x02" * 32)),),
            finalizes=(Finalize("req-1", 0, 77, b"\x03" * 32), Finalize("r2", 1, 64)),
            aborts=(Abort("req-9", 2),),
        ),
        ArtifactWorkerReport(
            progress=(CommitProgress("req-1", 0, 64),),
            acks=(
                FinalizeAck(
                    "req-1", 0, 77, 32, (PublishedRef("ab" * 32, 32, 16, 2**40),)
                ),
            ),
            failures=(AttemptFailed("r3", 0, "StoreCapacityError", "full"),),
            stats={"divergences": 1},
        ),
    ]


@pytest.mark.parametrize("msg", _messages())
def test_protocol_round_trips(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg
    raw = msgspec.msgpack.encode(msg)
    assert msgspec.msgpack.decode(raw, type=type(msg)) == msg
    assert len(raw) < 400
    assert not msg.is_empty()
    assert type(msg)().is_empty()
