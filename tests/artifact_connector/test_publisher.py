# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker-side publisher: step-batched publication on its thread,
retain/release, per-block weight versions, aborts and failures, read back
through the scheduler's read path from a real /dev/shm store."""

import hashlib
import threading
import time

import numpy as np
import pytest

from vllm.distributed.artifact_connector import publication, publisher
from vllm.distributed.artifact_connector.buffer import RowSlab
from vllm.distributed.artifact_connector.protocol import (
    Abort,
    ArtifactSchedulerMeta,
    AttemptStart,
    BlockHashes,
    Discard,
    Finalize,
    Release,
)
from vllm.distributed.artifact_connector.publication import PublisherClosedError
from vllm.distributed.artifact_connector.publisher import (
    GATHER_STEPS,
    ArtifactPublisher,
)
from vllm.distributed.artifact_connector.request_core import (
    KeySpace,
    read_rows,
)
from vllm.distributed.artifact_connector.shm import (
    ShmStoreReader,
    ShmStoreWriter,
    make_namespace,
)
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.utils.routed_experts_rows import RowSpec

SPEC = RowSpec(3, 2)
B = 4


def block_hash(seq: str, b: int) -> bytes:
    return hashlib.sha256(f"{seq}/{b}".encode()).digest()


def routes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3, 2), dtype=np.uint8)


class Harness:
    """A publisher on a real store, plus the scheduler's reader."""

    def __init__(self, root, capacity=8 << 20, arena=256 << 10, pages=256, **kw):
        ns = make_namespace("pub")
        self.writer = ShmStoreWriter(
            root, ns, capacity_bytes=capacity, arena_bytes=arena
        )
        self.slab = RowSlab(SPEC, B, pages)
        self.pub = ArtifactPublisher(self.writer, SPEC, self.slab, KeySpace(ns), **kw)
        self.reader = ShmStoreReader(root, ns)
        self.acks: dict = {}
        self.failures: dict = {}
        self.handles: dict = {}

    def step(self, meta=None, rows=(), gather=False):
        """One engine step: messages, then rows ``(req, attempt, start,
        array)``, then flush (``gather`` as the engine's step passes it);
        waits for the thread and collects reports."""
        if meta is not None:
            self.pub.apply(meta)
            # As the worker does when it prepares a step: the handle of each
            # request's attempt now (late rows of an older one keep theirs).
            for st in meta.starts:
                self.handles[(st.req_id, st.attempt)] = self.pub.current_attempts(
                    [st.req_id]
                )[0]
        if rows:
            self.pub.write_step(
                np.array([self.handles.get((r, a), -1) for r, a, _, _ in rows]),
                [s for _, _, s, _ in rows],
                [len(x) for *_, x in rows],
                np.concatenate([x for *_, x in rows]),
            )
        self.pub.flush(gather=gather)
        self.pub.wait_idle(10)
        rep = self.pub.report()
        for ack in rep.acks:
            self.acks[ack.req_id] = ack
        for f in rep.failures:
            self.failures[f.req_id] = f
        return rep

    def read(self, req, first_row=0):
        ack = self.acks[req]
        return read_rows(self.reader, SPEC, ack.refs, ack.num_rows, first_row=first_row)

    def close(self):
        self.reader.close()
        self.pub.close()


@pytest.fixture
def h(shm_root):
    harness = Harness(shm_root)
    yield harness
    harness.close()


def test_one_put_per_step_across_many_requests(h, monkeypatch):
    """16 requests complete one block each at unrelated rows in one step:
    the step is one put (one arena write, one index append)."""
    calls = []
    real = h.writer.put_batch
    monkeypatch.setattr(
        h.writer, "put_batch", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k)
    )
    reqs = [f"r{i}" for i in range(16)]
    starts = tuple(AttemptStart(r, 0, 0) for r in reqs)
    truth = {r: routes(i, 4 * (i % 5 + 1) + 3) for i, r in enumerate(reqs)}
    # Everything but each request's last block, in a first step.
    first = [(r, 0, 0, truth[r][: len(truth[r]) - 7]) for r in reqs]
    hashes = tuple(
        BlockHashes(r, 0, 0, tuple(block_hash(r, b) for b in range(len(truth[r]) // B)))
        for r in reqs
    )
    h.step(ArtifactSchedulerMeta(starts=starts, hashes=hashes), first)
    calls.clear()
    # Each request completes one block (rows [n-7, n-3)) in this step.
    second = [(r, 0, len(truth[r]) - 7, truth[r][-7:-3]) for r in reqs]
    h.step(rows=second)
    assert calls == [16]
    fins = tuple(Finalize(r, 0, len(truth[r]) - 3, None) for r in reqs)
    h.step(ArtifactSchedulerMeta(finalizes=fins))
    assert calls == [16]  # finishing on a block boundary publishes nothing
    for r in reqs:
        np.testing.assert_array_equal(h.read(r), truth[r][:-3])


@pytest.mark.parametrize("bound", ["steps", "objects"])
def test_full_blocks_gather_over_steps_until_a_bound_or_a_finalize(
    h, monkeypatch, bound
):
    """The engine's step flushes with ``gather``: full blocks of running
    requests wait for the next steps' until GATHER_STEPS steps (or
    GATHER_OBJECTS objects) gathered; a step with a start or a finalize
    hands everything over at once, and the acknowledgement covers the
    gathered blocks."""
    calls = []
    real = h.writer.put_batch
    monkeypatch.setattr(
        h.writer, "put_batch", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k)
    )
    if bound == "objects":
        monkeypatch.setattr(publisher, "GATHER_OBJECTS", 4)  # two steps' blocks
    reqs = ["r0", "r1"]
    steps = GATHER_STEPS + 2
    truth = {r: routes(i, B * steps) for i, r in enumerate(reqs)}
    hashes = tuple(
        BlockHashes(r, 0, 0, tuple(block_hash(r, b) for b in range(steps)))
        for r in reqs
    )

    def rows_of(step):
        return [(r, 0, B * step, truth[r][B * step : B * (step + 1)]) for r in reqs]

    starts = tuple(AttemptStart(r, 0, 0) for r in reqs)
    h.step(ArtifactSchedulerMeta(starts=starts, hashes=hashes), rows_of(0), True)
    assert calls == [2]  # a start is handed over at once, with its blocks
    handed_at = GATHER_STEPS if bound == "steps" else 2
    for step in range(1, steps - 1):
        h.step(rows=rows_of(step), gather=True)
        assert calls == [2] + [2 * handed_at] * (step // handed_at), step
    # The finalize's step hands over what waits, with its own last block.
    h.step(rows=rows_of(steps - 1), gather=True)
    fins = tuple(Finalize(r, 0, B * steps, None) for r in reqs)
    h.step(ArtifactSchedulerMeta(finalizes=fins), gather=True)
    assert sum(calls) == 2 * steps
    for r in reqs:
        np.testing.assert_array_equal(h.read(r), truth[r])


def test_decode_steps_placed_in_bulk_equal_the_truth(h, monkeypatch):
    """24 requests at staggered lengths decode together for 23 steps: every
    decode row, those that start a page included, goes through the array
    path; the prefill chunks and a rewritten suffix through the per-request
    one; every row lands where the truth has it."""
    one_by_one = []
    real_slow = h.pub._write_rows_one_by_one
    monkeypatch.setattr(
        h.pub,
        "_write_rows_one_by_one",
        lambda which, *a: one_by_one.append(len(which)) or real_slow(which, *a),
    )
    reqs = [f"d{i}" for i in range(24)]
    steps = 23
    truth = {r: routes(100 + i, i % 7 + steps + 1) for i, r in enumerate(reqs)}
    prompt = {r: i % 7 + 1 for i, r in enumerate(reqs)}
    hashes = tuple(
        BlockHashes(r, 0, 0, tuple(block_hash(r, b) for b in range(len(t) // B)))
        for r, t in truth.items()
    )
    h.step(
        ArtifactSchedulerMeta(
            starts=tuple(AttemptStart(r, 0, 0) for r in reqs), hashes=hashes
        ),
        [(r, 0, 0, truth[r][: prompt[r]]) for r in reqs],
    )
    for k in range(steps):
        if k == 6:
            # d3 (4 prompt rows) rewrites row 9 inside its open block [8, 12)
            # (a rejected asynchronous suffix).
            h.step(rows=[("d3", 0, 9, truth["d3"][9:10])])
        h.step(
            rows=[(r, 0, prompt[r] + k, truth[r][prompt[r] + k :][:1]) for r in reqs]
        )
    # The prefill step (the 20 prompts longer than one row) and the rewrite
    # only: no decode row went one by one.
    assert one_by_one == [20, 1]
    fins = []
    for r in reqs:
        n = prompt[r] + steps
        tail = None if n % B == 0 else block_hash(r, 1000)
        fins.append(Finalize(r, 0, n, tail))
    h.step(ArtifactSchedulerMeta(finalizes=tuple(fins)))
    assert not h.failures
    for r in reqs:
        np.testing.assert_array_equal(h.read(r), truth[r][: prompt[r] + steps])


def test_full_life_cycle_with_a_sibling_prefix_hit_and_prompt_start(h):
    a = routes(1, 14)
    hashes = tuple(block_hash("shared", b) for b in range(3))
    # r1 computes its prompt; r2 hits r1's first two blocks in the same
    # step, before r1's objects are published.
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r1", 0, 0), AttemptStart("r2", 0, 8, hashes[:2])),
            hashes=(
                BlockHashes("r1", 0, 0, hashes),
                BlockHashes("r2", 0, 2, (block_hash("r2", 2),)),
            ),
        ),
        [("r1", 0, 0, a[:12]), ("r2", 0, 8, routes(2, 4))],
    )
    h.step(rows=[("r1", 0, 12, a[12:]), ("r2", 0, 12, routes(3, 3))])
    h.step(
        ArtifactSchedulerMeta(
            finalizes=(Finalize("r1", 0, 14, b"t1"), Finalize("r2", 0, 15, b"t2")),
        )
    )
    np.testing.assert_array_equal(h.read("r1"), a)
    r2 = h.read("r2")
    np.testing.assert_array_equal(r2[:8], a[:8])  # rows r1 computed
    np.testing.assert_array_equal(r2[8:12], routes(2, 4))
    np.testing.assert_array_equal(r2[12:], routes(3, 3))
    np.testing.assert_array_equal(h.read("r2", first_row=10), r2[10:])
    assert h.acks["r2"].refs.starts.tolist() == [0, 4, 8, 12]
    assert h.writer.stats().retainers == 2
    h.step(ArtifactSchedulerMeta(releases=(Release("r1", 0), Release("r2", 0))))
    assert h.writer.stats().retained_keys == 0


def test_waiting_for_the_answers_of_handed_finalizes(h):
    h.pub.apply(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r", 0, 0),),
            finalizes=(Finalize("r", 0, 2, b"t"),),
        )
    )
    h.pub.flush()
    assert h.pub.owes_answers()  # the finalize waits for its rows
    h.pub.write_step(h.pub.current_attempts(["r"]), [0], [2], routes(1, 2))
    h.pub.flush()
    assert h.pub.wait_for_answers(10)
    (ack,) = h.pub.report().acks
    assert ack.req_id == "r" and ack.num_rows == 2
    assert not h.pub.owes_answers()


def test_a_finalize_after_a_failure_leaves_nothing_to_wait_for(h):
    """Defect g: a finalize sent before the scheduler saw the attempt's
    failure must not leave the worker waiting on every later empty step
    (the old worker connector kept it in its awaited set forever)."""
    h.step(ArtifactSchedulerMeta(starts=(AttemptStart("r", 0, 0),)))
    # Rows with a gap fail the attempt on the engine side.
    h.pub.write_step(h.pub.current_attempts(["r"]), [3], [1], routes(1, 1))
    h.step()
    assert h.failures["r"].error_type == "RowGapError"
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("r", 0, 4, None),)))
    assert not h.pub.owes_answers()
    assert h.pub.stats()["attempts"] == 0
    h.step(ArtifactSchedulerMeta(releases=(Release("r", 0),)))
    assert h.writer.stats().retained_keys == 0


def test_captured_rows_of_the_wrong_format_are_refused(h):
    h.pub.apply(ArtifactSchedulerMeta(starts=(AttemptStart("r", 0, 0),)))
    with pytest.raises(ArtifactError, match="captured rows must be"):
        h.pub.write_step(
            h.pub.current_attempts(["r"]), [0], [1], np.zeros((1, 2, 2), np.uint8)
        )
    with pytest.raises(ArtifactError, match="counts add up"):
        h.pub.write_step(h.pub.current_attempts(["r"]), [0], [2], routes(1, 1))
    # A gap fails that attempt only, with a typed report.
    h.pub.write_step(h.pub.current_attempts(["r"]), [5], [1], routes(1, 1))
    (f,) = h.pub.report().failures
    assert (f.req_id, f.error_type) == ("r", "RowGapError") and "gap" in f.message


def test_abort_is_a_finish_at_the_executed_boundary(h):
    a = routes(4, 11)
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r", 0, 0),),
            hashes=(BlockHashes("r", 0, 0, (block_hash("r", 0), block_hash("r", 1))),),
        ),
        [("r", 0, 0, a)],
    )
    # The scheduler aborts after 9 executed rows; rows 9 and 10 (a step
    # that ran past the abort) are dropped.
    h.step(ArtifactSchedulerMeta(finalizes=(Abort("r", 0, 9, b"tail"),)))
    ack = h.acks["r"]
    assert ack.aborted and ack.num_rows == 9
    np.testing.assert_array_equal(h.read("r"), a[:9])
    h.step(ArtifactSchedulerMeta(releases=(Release("r", 0),)))
    assert h.writer.stats().retainers == 0  # nothing leaks after an abort
    assert h.slab.num_free() == h.slab.num_pages


def test_finalize_waits_for_rows_in_flight_then_fails_loudly(shm_root):
    h = Harness(shm_root, finalize_wait_s=0.5)
    try:
        _finalize_waits(h)
    finally:
        h.close()


def _finalize_waits(h):
    a = routes(5, 6)
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r", 0, 0), AttemptStart("late", 0, 0)),
            hashes=(BlockHashes("r", 0, 0, (block_hash("r", 0),)),),
        ),
        [("r", 0, 0, a[:3]), ("late", 0, 0, a[:2])],
    )
    # The finish arrives before the last step's rows (asynchronous output).
    h.step(
        ArtifactSchedulerMeta(
            finalizes=(Finalize("r", 0, 6, b"t"), Finalize("late", 0, 5, b"t"))
        )
    )
    assert "r" not in h.acks
    h.step(rows=[("r", 0, 3, a[3:])])
    np.testing.assert_array_equal(h.read("r"), a)
    assert "late" not in h.failures  # still waiting for its rows
    time.sleep(0.6)  # rows of "late" never come
    h.step()
    f = h.failures["late"]
    assert f.error_type == "CoverageError" and "never arrived" in f.message
    assert "late" not in h.acks


def test_preemption_discards_and_the_next_attempt_replaces_rows(h):
    a = routes(6, 10)
    h.step(
        ArtifactSchedulerMeta(starts=(AttemptStart("r", 0, 0),)),
        [("r", 0, 0, routes(99, 6))],  # no hashes yet: nothing published
    )
    h.step(ArtifactSchedulerMeta(discards=(Discard("r", 0),)))
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r", 1, 0),),
            hashes=(BlockHashes("r", 1, 0, (block_hash("r", 0), block_hash("r", 1))),),
        ),
        [("r", 1, 0, a)],
    )
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("r", 1, 10, b"t"),)))
    assert h.acks["r"].attempt == 1
    np.testing.assert_array_equal(h.read("r"), a)
    h.step(ArtifactSchedulerMeta(releases=(Release("r", 1),)))
    assert h.writer.stats().retainers == 0
    assert h.slab.num_free() == h.slab.num_pages


def test_weight_versions_per_block(h):
    v1 = routes(7, 8)
    hashes = tuple(block_hash("p", b) for b in range(3))
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("old", 0, 0),),
            hashes=(BlockHashes("old", 0, 0, hashes),),
        ),
        [("old", 0, 0, v1[:6])],
    )
    # A weight update while "old" runs, announced with the step's messages.
    h.step(ArtifactSchedulerMeta(weight_version="w2"), [("old", 0, 6, v1[6:])])
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("old", 0, 8, None),)))
    # The request keeps its own rows across the update; each block carries
    # the version that computed (the first row of) it.
    np.testing.assert_array_equal(h.read("old"), v1)
    assert h.acks["old"].refs.weight_versions == ("default", "default")
    # A prefix hit on those blocks under the new weights fails loudly.
    h.step(
        ArtifactSchedulerMeta(starts=(AttemptStart("hit", 0, 8, hashes[:2]),)),
        [("hit", 0, 8, routes(8, 2))],
    )
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("hit", 0, 10, b"t"),)))
    f = h.failures["hit"]
    assert f.error_type == "WeightVersionMismatchError"
    assert "reset the prefix cache" in f.message.lower()
    # After a prefix-cache reset the blocks are recomputed under w2: fine.
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("new", 0, 0),),
            hashes=(BlockHashes("new", 0, 0, hashes[:2]),),
        ),
        [("new", 0, 0, routes(9, 8))],
    )
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("new", 0, 8, None),)))
    assert h.acks["new"].refs.weight_versions == ("w2", "w2")


def test_a_missing_prefix_object_is_a_typed_failure(h):
    h.step(
        ArtifactSchedulerMeta(starts=(AttemptStart("r", 0, 4, (block_hash("x", 0),)),)),
        [("r", 0, 4, routes(1, 2))],
    )
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("r", 0, 6, b"t"),)))
    assert h.failures["r"].error_type == "ObjectMissingError"
    assert h.writer.stats().retainers == 0


def test_tail_hash_policy_on_a_block_boundary(h):
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r", 0, 0),),
            hashes=(BlockHashes("r", 0, 0, (block_hash("r", 0),)),),
        ),
        [("r", 0, 0, routes(1, 4))],
    )
    # Rows end on a block boundary: the last block is a full block keyed by
    # its KV hash, and a tail hash is an error.
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("r", 0, 4, b"tail"),)))
    assert h.failures["r"].error_type == "CoverageError"


def test_a_background_failure_fails_exactly_the_affected_requests(shm_root):
    h = Harness(shm_root, capacity=256 << 10, arena=32 << 10)
    try:
        big = routes(1, 4 * 100)  # ~15 KiB of objects and index per request
        n = 24
        starts = tuple(AttemptStart(f"r{i}", 0, 0) for i in range(n))
        hashes = tuple(
            BlockHashes(
                f"r{i}", 0, 0, tuple(block_hash(f"r{i}", b) for b in range(100))
            )
            for i in range(n)
        )
        h.step(ArtifactSchedulerMeta(starts=starts, hashes=hashes))
        for i in range(n):
            h.step(rows=[(f"r{i}", 0, 0, big)])
        failed = set(h.failures)
        assert failed and len(failed) < n  # the store filled up part way
        for f in h.failures.values():
            assert f.error_type == "StoreCapacityError"
        ok = [f"r{i}" for i in range(n) if f"r{i}" not in failed]
        h.step(ArtifactSchedulerMeta(finalizes=tuple(Finalize(r, 0, 400) for r in ok)))
        for r in ok:
            np.testing.assert_array_equal(h.read(r), big)
        # Failed attempts retain nothing; their later rows are ignored.
        assert h.writer.stats().retainers == len(ok)
        h.step(rows=[(next(iter(failed)), 0, 400, routes(2, 1))])
        h.step(ArtifactSchedulerMeta(releases=tuple(Release(r, 0) for r in ok)))
        s = h.writer.stats()
        assert s.retainers == 0 and s.retained_keys == 0
        assert h.slab.num_free() == h.slab.num_pages
    finally:
        h.close()


def test_close_joins_the_thread_and_later_use_is_an_error(shm_root):
    h = Harness(shm_root)
    h.step(
        ArtifactSchedulerMeta(starts=(AttemptStart("r", 0, 0),)),
        [("r", 0, 0, routes(1, 2))],
    )
    h.close()
    assert not h.pub._publication._thread.is_alive()
    with pytest.raises(PublisherClosedError):
        h.pub.flush()


def test_a_dead_publication_thread_is_reported_not_waited_for(shm_root):
    h = Harness(shm_root, max_queued_steps=1)
    try:

        def crash(work):
            raise RuntimeError("bug in the publication thread")

        h.pub._publication._process = crash  # the thread's next item kills it
        h.pub.apply(ArtifactSchedulerMeta(starts=(AttemptStart("r", 0, 0),)))
        h.pub.flush()
        with pytest.raises(PublisherClosedError, match="bug in the publication"):
            for _ in range(50):  # a full queue must not block forever
                h.pub.apply(ArtifactSchedulerMeta(starts=(AttemptStart("r", 0, 0),)))
                h.pub.flush()
    finally:
        h.reader.close()
        h.pub.close()


def test_rows_carry_the_weight_version_of_the_step_that_computed_them(h):
    """Defect h: under async scheduling a step prepared before a weight
    update is processed after it. Its rows belong to the old weights (the
    old code took the version when the rows arrived)."""
    hashes = tuple(block_hash("h", b) for b in range(2))
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("h", 0, 0),),
            hashes=(BlockHashes("h", 0, 0, hashes),),
        )
    )
    prepared_under = h.pub.weight_version
    h.pub.apply(ArtifactSchedulerMeta(weight_version="w2"))  # the next step
    h.pub.write_step(
        h.pub.current_attempts(["h"]),
        [0],
        [8],
        routes(3, 8),
        weight_version=prepared_under,
    )
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("h", 0, 8, None),)))
    assert h.acks["h"].refs.weight_versions == ("default", "default")


def test_a_discard_drains_full_blocks_then_releases(h):
    """Defect a: an attempt discarded while its rows are in flight (aborted
    before its first token, failed) publishes its full blocks once the rows
    arrive, because their KV stays cached and a later hit needs them."""
    truth = routes(4, 10)
    hashes = tuple(block_hash("d", b) for b in range(2))
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("d", 0, 0),),
            hashes=(BlockHashes("d", 0, 0, hashes),),
            discards=(Discard("d", 0, 10),),
        )
    )
    assert h.pub.stats()["attempts"] == 1  # waits for the rows in flight
    h.step(rows=[("d", 0, 0, truth)])
    assert h.pub.stats()["attempts"] == 0
    assert h.pub.stats()["slab_pages_used"] == 0
    # A later request hits both blocks: exact.
    h.step(
        ArtifactSchedulerMeta(starts=(AttemptStart("hit", 0, 8, hashes),)),
        [("hit", 0, 8, truth[8:])],
    )
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("hit", 0, 10, b"tail"),)))
    np.testing.assert_array_equal(h.read("hit"), truth)
    h.step(ArtifactSchedulerMeta(releases=(Release("hit", 0),)))
    assert h.writer.stats().retained_keys == 0


def test_a_drain_ends_at_its_deadline_when_rows_never_come(shm_root):
    h = Harness(shm_root, finalize_wait_s=0.05)
    try:
        h.step(ArtifactSchedulerMeta(starts=(AttemptStart("d", 0, 0),)))
        h.step(ArtifactSchedulerMeta(discards=(Discard("d", 0, 12),)))
        time.sleep(0.1)
        h.step()
        assert h.pub.stats()["attempts"] == 0
        assert not h.failures  # a discard owes nobody an answer
    finally:
        h.close()


def test_nothing_outlives_an_attempt_that_fails_at_acknowledgement(h):
    """Defect f: the old publication thread kept per-attempt dicts that were
    never pruned for attempts failing at acknowledgement."""
    import gc
    import weakref

    refs = []
    for i in range(5):
        req = f"miss{i}"
        h.step(
            ArtifactSchedulerMeta(
                starts=(AttemptStart(req, 0, 4, (block_hash("gone", i),)),)
            ),
            [(req, 0, 4, routes(i, 2))],
        )
        refs.append(weakref.ref(h.pub._attempts[(req, 0)]))
        h.step(ArtifactSchedulerMeta(finalizes=(Finalize(req, 0, 6, b"t"),)))
        assert h.failures[req].error_type == "ObjectMissingError"
        h.step(ArtifactSchedulerMeta(releases=(Release(req, 0),)))
    gc.collect()
    assert [r() for r in refs] == [None] * 5
    # No per-attempt container keeps anything (the old _prefix and _failed).
    leftovers = {
        k: v for k, v in vars(h.pub).items() if isinstance(v, dict | set) and v
    }
    assert leftovers == {}
    assert h.pub.stats()["attempts"] == 0
    assert h.writer.stats().retained_keys == 0


def test_weight_versions_remembered_are_bounded(h):
    """Defect m: every version ever set was kept."""
    from vllm.distributed.artifact_connector.publisher import MAX_VERSIONS_SEEN

    for i in range(3 * MAX_VERSIONS_SEEN):
        h.pub.set_weight_version(f"v{i}")
    assert len(h.pub._versions_seen) == MAX_VERSIONS_SEEN
    assert h.pub._versions_seen[-1] == f"v{3 * MAX_VERSIONS_SEEN - 1}"


class _MirroredWriter(ShmStoreWriter):
    """A real store behind which a shared tier mirrors each put (r5 M2): the
    mirrors of requests named in ``slow`` stay in flight until the test sets
    their event (a slow master), the others have ended. Stands in for
    ``SharedTierWriter.mirroring``, whose real tier ``test_shared_tier.py``
    checks with a real master."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.slow: dict[str, threading.Event] = {}
        self.owner_of: dict[str, str] = {}
        self.asked: list[tuple[str, ...]] = []

    def put_batch(self, keys, lengths, fill, *, owners=None):
        for k, o in zip(keys, owners or [""] * len(keys)):
            self.owner_of[k] = o.split("#")[0]
        return super().put_batch(keys, lengths, fill, owners=owners)

    def mirroring(self, keys):
        self.asked.append(tuple(keys))
        owners = {self.owner_of.get(k) for k in keys}
        return [e for r, e in self.slow.items() if r in owners and not e.is_set()]


def _finish(h, req, seed, n=6):
    h.pub.apply(
        ArtifactSchedulerMeta(
            starts=(AttemptStart(req, 0, 0),),
            hashes=(BlockHashes(req, 0, 0, (block_hash(req, 0),)),),
            finalizes=(Finalize(req, 0, n, b"t"),),
        )
    )
    h.pub.flush()
    h.pub.write_step(h.pub.current_attempts([req]), [0], [n], routes(seed, n))
    h.pub.flush()


def _acks_within(h, n, timeout_s=10.0):
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        h.pub.wait_for_answers(0.05)
        got += [a.req_id for a in h.pub.report().acks]
    return got


def test_a_slow_mirror_holds_its_own_acknowledgement_only(shm_root, monkeypatch):
    """r5 M2: a request whose objects' mirror is still in flight has its
    acknowledgement held (counted), while a later request's acknowledgement,
    whose objects are not in flight, leaves at once: the publication thread
    does not wait for the tier. A mirror that never ends releases its
    acknowledgement at the budget (counted as late)."""
    monkeypatch.setattr(publication, "MIRROR_SETTLE_S", 30.0, raising=False)
    h = Harness(shm_root)
    h.writer.close()
    ns = make_namespace("mirrored")
    h.writer = _MirroredWriter(shm_root, ns, capacity_bytes=8 << 20,
                               arena_bytes=256 << 10)  # fmt: skip
    h.pub.close()
    h.pub = ArtifactPublisher(h.writer, SPEC, h.slab, KeySpace(ns))
    h.reader.close()
    h.reader = ShmStoreReader(shm_root, ns)
    try:
        h.writer.slow["slow"] = threading.Event()
        _finish(h, "slow", 1)
        _finish(h, "fast", 2)
        assert _acks_within(h, 1) == ["fast"]  # not behind "slow"'s mirror
        assert h.pub.metrics()["shared_settles"] == 1
        h.writer.slow["slow"].set()  # its mirror ended
        assert _acks_within(h, 1) == ["slow"]
        m = h.pub.metrics()
        assert m["shared_settles"] == 1 and m["shared_settles_late"] == 0
        # A mirror that never ends: held for the budget only.
        monkeypatch.setattr(publication, "MIRROR_SETTLE_S", 0.2)
        h.writer.slow["stuck"] = threading.Event()
        _finish(h, "stuck", 3)
        assert _acks_within(h, 1) == ["stuck"]
        m = h.pub.metrics()
        assert m["shared_settles"] == 2 and m["shared_settles_late"] == 1
        # What the acknowledgements waited on: their own keys only.
        assert all(len(keys) == 2 for keys in h.writer.asked)
    finally:
        h.close()


def test_a_prefix_hit_keeps_the_version_it_hit_when_a_sibling_recomputes(h):
    """r5 (outside the 95 commits): r2 hits r1's first block; before r2
    finishes, a sibling (r3) recomputes that block with other routes (a
    prompt of exactly k blocks recomputes its last one), which makes r3's
    version the key's current one. r2's KV is still r1's, so its
    acknowledgement names the version it retained, not the current one."""
    a = routes(1, 8)
    hashes = tuple(block_hash("shared", b) for b in range(2))
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r1", 0, 0),),
            hashes=(BlockHashes("r1", 0, 0, hashes),),
            finalizes=(Finalize("r1", 0, 8, None),),
        ),
        [("r1", 0, 0, a)],
    )
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r2", 0, 4, hashes[:1]),),
            hashes=(BlockHashes("r2", 0, 1, (block_hash("r2", 1),)),),
        ),
        [("r2", 0, 4, routes(2, 4))],
    )
    other = routes(3, 4)  # the same block, routed otherwise
    h.step(
        ArtifactSchedulerMeta(
            starts=(AttemptStart("r3", 0, 0),),
            hashes=(BlockHashes("r3", 0, 0, hashes[:1]),),
            finalizes=(Finalize("r3", 0, 4, None),),
        ),
        [("r3", 0, 0, other)],
    )
    assert not h.failures, h.failures
    np.testing.assert_array_equal(h.read("r3"), other)  # r3's is current
    h.step(ArtifactSchedulerMeta(finalizes=(Finalize("r2", 0, 8, None),)))
    r2 = h.read("r2")
    np.testing.assert_array_equal(r2[:4], a[:4])  # the version r2 hit
    np.testing.assert_array_equal(r2[4:], routes(2, 4))
