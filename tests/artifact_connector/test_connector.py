# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker-side connector between Model Runner V2 and the publisher, on a
real /dev/shm store: steps with speculative tokens (rows of rejected drafts
dropped, the next step re-attached), late rows of an ended attempt, and
acknowledgements carried by empty steps.

Model Runner V2's ngram proposer cannot run on the CPU harness (a Triton
kernel the interpreter rejects), so this is where the rejected-draft rows
are checked on CPU; tests/gpu runs speculative decoding end to end."""

import hashlib
import time

import numpy as np
import pytest
import torch

from vllm.distributed.artifact_connector.buffer import RowSlab
from vllm.distributed.artifact_connector.protocol import (
    ArtifactSchedulerMeta,
    AttemptStart,
    BlockHashes,
    Discard,
    Finalize,
    Release,
)
from vllm.distributed.artifact_connector.publisher import ArtifactPublisher
from vllm.distributed.artifact_connector.request_core import (
    KeySpace,
    read_rows,
)
from vllm.distributed.artifact_connector.shm import (
    ShmStoreReader,
    ShmStoreWriter,
    make_namespace,
)
from vllm.distributed.artifact_connector.worker import (
    ArtifactWorkerConnector,
    PendingArtifactStep,
)
from vllm.utils.routed_experts_rows import RowSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

SPEC = RowSpec(3, 2)
B = 4


def bh(req: str, block: int) -> bytes:
    return hashlib.sha256(f"{req}:{block}".encode()).digest()


def rows_for(positions: np.ndarray, salt: int = 0) -> np.ndarray:
    """Distinct rows per token position (what the router would give)."""
    base = (positions[:, None, None] * 7 + salt + np.arange(6).reshape(3, 2)) % 251
    return base.astype(np.uint8)


@pytest.fixture
def env(shm_root):
    ns = make_namespace("connector-test")
    writer = ShmStoreWriter(shm_root, ns, capacity_bytes=1 << 20)
    slab = RowSlab(SPEC, B, 64)
    publisher = ArtifactPublisher(writer, SPEC, slab, KeySpace(ns))
    conn = ArtifactWorkerConnector(capture=None, publisher=publisher)
    reader = ShmStoreReader(shm_root, ns)
    yield conn, reader
    reader.close()
    conn.close()


def current(conn, *req_ids):
    """The requests' attempt handles now, as ``prepare_step`` takes them."""
    return conn._publisher.current_attempts(list(req_ids))


def step(conn, attempts, starts, scheduled, rows, rejected, version="default"):
    """One model step of the ``attempts`` (handles from :func:`current`):
    ``rows`` holds every scheduled token's row (drafts included),
    ``rejected`` the drafts the sampler rejected per request; ``version``:
    the weight version when the step was prepared."""
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    pending = PendingArtifactStep(
        conn,
        attempts,
        version,
        np.array(starts, np.int32),
        qsl,
        torch.from_numpy(rows),
    )
    pending.enqueue_cpu_copy(np.array(rejected, np.int32))
    return pending.process()


def finish(conn, reader, req, attempt, num_rows, tail_hash=None):
    """Finalize, wait for the acknowledgement (carried by empty steps) and
    read the rows back through the scheduler's read path."""
    conn.begin_step(
        ArtifactSchedulerMeta(finalizes=(Finalize(req, attempt, num_rows, tail_hash),))
    )
    for _ in range(200):
        out = conn.no_forward(EMPTY_MODEL_RUNNER_OUTPUT)
        report = out.artifact_report
        if report is not None and (report.acks or report.failures):
            break
    else:
        raise AssertionError("no acknowledgement")
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT  # the shared singleton untouched
    assert EMPTY_MODEL_RUNNER_OUTPUT.artifact_report is None
    assert not report.failures, report.failures
    (ack,) = report.acks
    got = read_rows(reader, SPEC, ack.refs, ack.num_rows)
    conn.begin_step(ArtifactSchedulerMeta(releases=(Release(req, attempt),)))
    return got[:num_rows]


def test_rejected_draft_rows_are_dropped_and_the_next_step_reattaches(env):
    conn, reader = env
    r = "spec"
    conn.begin_step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart(r, 1, 0),),
            hashes=(BlockHashes(r, 1, 0, tuple(bh(r, b) for b in range(4))),),
        )
    )
    aid = current(conn, r)
    # Prefill: 5 prompt tokens.
    truth = [rows_for(np.arange(5))]
    step(conn, aid, [0], [5], truth[0], [0])
    # Decode with 3 drafts: tokens 5..8 scheduled, 2 drafts rejected, so
    # rows 5 and 6 are kept.
    sched = rows_for(np.arange(5, 9), salt=1)
    step(conn, aid, [5], [4], sched, [2])
    truth.append(sched[:2])
    # Async scheduling placed the next step after all drafts (start 9); its
    # tokens really sit at 7.. : the connector re-attaches at the kept end.
    nxt = rows_for(np.arange(7, 11), salt=2)
    step(conn, aid, [9], [4], nxt, [1])
    truth.append(nxt[:3])
    want = np.concatenate(truth)  # rows 0..9
    got = finish(conn, reader, r, 1, 10, tail_hash=bh(r, 99))
    np.testing.assert_array_equal(got, want)


def test_rows_of_an_ended_attempt_are_ignored(env):
    conn, reader = env
    r = "late"
    hashes = (BlockHashes(r, 1, 0, (bh(r, 0), bh(r, 1))),)
    conn.begin_step(
        ArtifactSchedulerMeta(starts=(AttemptStart(r, 1, 0),), hashes=hashes)
    )
    first = current(conn, r)
    step(conn, first, [0], [6], rows_for(np.arange(6)), [0])
    # Preempted: attempt 1 ends; a step scheduled before that still returns
    # rows tagged with attempt 1, then attempt 2 recomputes from scratch.
    conn.begin_step(
        ArtifactSchedulerMeta(
            discards=(Discard(r, 1),),
            starts=(AttemptStart(r, 2, 0),),
            hashes=(BlockHashes(r, 2, 0, (bh(r, 0), bh(r, 1))),),
        )
    )
    step(conn, first, [6], [1], rows_for(np.arange(6, 7), salt=9), [0])
    step(conn, current(conn, r), [0], [7], rows_for(np.arange(7), salt=3), [0])
    got = finish(conn, reader, r, 2, 7, tail_hash=bh(r, 77))
    np.testing.assert_array_equal(got, rows_for(np.arange(7), salt=3))
    assert conn.stats()["attempts"] == 0


def test_forward_steps_report_without_waiting(env):
    conn, _ = env
    r = "fwd"
    conn.begin_step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart(r, 1, 0),),
            hashes=(BlockHashes(r, 1, 0, (bh(r, 0),)),),
        )
    )
    step(conn, current(conn, r), [0], [4], rows_for(np.arange(4)), [0])
    conn.begin_step(ArtifactSchedulerMeta(finalizes=(Finalize(r, 1, 4),)))
    # Other requests' forward steps carry the acknowledgement once it is
    # ready; none of them blocks on it.
    for _ in range(500):
        report = step(
            conn, current(conn, "other"), [0], [1], rows_for(np.arange(1)), [0]
        )
        if report is not None and report.acks:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("no forward step carried the acknowledgement")
    assert report.acks[0].req_id == r
