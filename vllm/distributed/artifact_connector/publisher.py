# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker-side publication, the engine's side (global rank 0 only).

The engine's thread feeds :class:`ArtifactPublisher` with the scheduler's
messages (:meth:`~ArtifactPublisher.apply`) and each step's captured rows
(:meth:`~ArtifactPublisher.write_step`), then calls
:meth:`~ArtifactPublisher.flush` once per step. ``flush`` collects what the
step made publishable (full blocks whose hash is known, finalisations whose
rows have all arrived) into one work item and hands it to the publication
thread (:class:`~.publication.PublicationThread`, which publishes it off the
step loop) through a bounded queue; it returns at once unless the queue is
full (back-pressure). A step whose work is only full blocks of running
requests may gather them with the next steps' (at most ``GATHER_STEPS``
steps, ``GATHER_OBJECTS`` objects): nothing waits for those, and a work
item's fixed cost then pays for more objects. The engine's thread collects
acknowledgements and failures with :meth:`~ArtifactPublisher.report`.
Everything here runs on the engine's threads (Model Runner V2's main thread
for the messages, its output thread for the rows; the attempt table under
one lock); the publication thread's work is in ``publication.py``.

Retention: an attempt retains the objects of its prefix hit when it starts
(keys a sibling has not published yet included) and everything it
publishes, until the scheduler releases it after reading the
acknowledgement, or until it is discarded or fails.

State: one table of attempts (:class:`~.publication.Attempt`), owned by the
engine side under its one lock; the table also answers which attempt a
request's rows belong to (:meth:`~ArtifactPublisher.current_attempts`). An
attempt leaves the table when it is finalised, drained or failed; the work
items that still refer to it keep the record alive for the publication
thread, which alone writes its thread-side fields (the prefix keys and the
references it published), so nothing outlives the attempt's last work item.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np

from vllm.distributed.artifact_connector.buffer import (
    PAGE_WAIT_S,
    AttemptRows,
    RowSlab,
    as_row_cells,
)
from vllm.distributed.artifact_connector.protocol import (
    ArtifactSchedulerMeta,
    ArtifactWorkerReport,
    AttemptFailed,
    AttemptId,
    FinalizeAck,
)
from vllm.distributed.artifact_connector.publication import (
    Attempt,
    PublicationThread,
    PublishObject,
    WorkItem,
)
from vllm.distributed.artifact_connector.request_core import CoverageError, KeySpace
from vllm.distributed.artifact_connector.store import ArtifactError, ObjectStoreWriter
from vllm.utils.routed_experts_rows import RowSpec

# Weight versions remembered to name a prefix miss's cause (a mismatch).
MAX_VERSIONS_SEEN = 16
# Full blocks of running requests wait for the next steps' at most this many
# steps, or until this many gathered (see the module docs): at 256 decoding
# requests, 16 blocks a step, the publication thread's CPU per step falls
# from 0.61-0.73 to 0.38-0.39 ms (benchmarks/bench_artifact_store.py
# decode_step; docs/benchmarks.md, "The rerun of issue 28's table").
GATHER_STEPS = 4
GATHER_OBJECTS = 64


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _engine_side(method: _Method) -> _Method:
    """Run an engine-side method under the publisher's engine lock: Model
    Runner V2 calls in from its main thread (messages) and its output thread
    (rows)."""

    @functools.wraps(method)
    def locked(self: ArtifactPublisher, *args: Any, **kwargs: Any) -> Any:
        with self._engine_lock:
            return method(self, *args, **kwargs)

    return cast(_Method, locked)


class ArtifactPublisher:
    """See the module docs. Owns ``writer`` and closes it (through its
    publication thread)."""

    def __init__(
        self,
        writer: ObjectStoreWriter,
        spec: RowSpec,
        slab: RowSlab,
        keyspace: KeySpace,
        *,
        weight_version: str = "default",
        max_queued_steps: int = 4,
        finalize_wait_s: float = 5.0,
        idle_upkeep_s: float = 0.05,
    ) -> None:
        self.spec = spec
        self.slab = slab
        self.block_size = slab.block_size
        # Read here for its counters only; the publication thread makes the
        # store calls.
        self._writer = writer
        self._weight_version = weight_version
        self._versions_seen = [weight_version]  # the thread reads it too
        self._finalize_wait_s = finalize_wait_s
        # Engine side: the attempt table, the same by cursor slot, each
        # request's newest attempt (its handle), attempts to look at in the
        # next flush.
        self._attempts: dict[AttemptId, Attempt] = {}
        self._at_slot: dict[int, Attempt] = {}
        self._current: dict[str, int] = {}
        self._dirty: set[AttemptId] = set()
        self._work = WorkItem()
        self._gathered = 0  # steps whose full blocks wait in _work
        # Finalizes handed to the thread (engine side; the thread counts
        # those answered): an empty step waits until they are equal.
        self._finalizes_handed = 0
        # See _engine_side.
        self._engine_lock = threading.RLock()
        # Work items handed over (engine thread; the thread counts those
        # done), and the most a step found still undone since the last
        # metrics() (each counter has one writer; reads need no lock).
        self._items_put = self._queue_peak = 0
        # The thread starts here, after everything above.
        self._publication = PublicationThread(
            writer,
            spec,
            slab,
            keyspace,
            self._versions_seen,
            max_queued_steps=max_queued_steps,
            idle_upkeep_s=idle_upkeep_s,
        )

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Rows written from now on were computed under ``version``."""
        self._weight_version = version
        if version not in self._versions_seen:
            self._versions_seen.append(version)
            del self._versions_seen[:-MAX_VERSIONS_SEEN]

    @_engine_side
    def current_attempts(self, req_ids: list[str]) -> np.ndarray:
        """The handle of the attempt each request's rows of a step prepared
        now belong to (``-1``: none, the rows are ignored), for
        :meth:`write_step`."""
        current = self._current.get
        return np.fromiter((current(r, -1) for r in req_ids), np.int64, len(req_ids))

    @_engine_side
    def apply(self, meta: ArtifactSchedulerMeta) -> None:
        """Take one step's scheduler messages (a weight version first)."""
        if meta.weight_version is not None:
            self.set_weight_version(meta.weight_version)
        work = self._work
        for s in meta.starts:
            aid = (s.req_id, s.attempt)
            old = self._attempts.get(aid)
            if old is not None:  # a repeated start replaces the attempt
                old.rows.drop()
                self._remove(old)
            att = Attempt(aid, AttemptRows(self.slab, s.cached_rows))
            att.prefix_version = self._weight_version
            att.prefix_hashes = s.prefix_hashes
            self._attempts[aid] = att
            self._at_slot[att.rows.slot] = att
            self._current[s.req_id] = att.rows.handle
            if len(s.prefix_hashes) * self.block_size != s.cached_rows:
                self._fail_here(
                    aid,
                    CoverageError(
                        f"{len(s.prefix_hashes)} prefix hashes for "
                        f"{s.cached_rows} cached rows (block size {self.block_size})"
                    ),
                )
                continue
            work.starts.append(att)
        attempts_get = self._attempts.get
        for h in meta.hashes:
            known = attempts_get((h.req_id, h.attempt))
            if known is not None:
                for i, bh in enumerate(h.hashes):
                    known.hashes[h.first_block + i] = bh
                self._dirty.add(known.aid)
        deadline = time.monotonic() + self._finalize_wait_s
        for d in meta.discards:
            aid = (d.req_id, d.attempt)
            known = attempts_get(aid)
            if known is None:  # failed, or never started here
                work.releases.append(aid)
                continue
            known.drain_rows = d.num_rows
            known.deadline = deadline
            self.slab.cursors.ending[known.rows.slot] = True
            self._dirty.add(aid)
        for f in meta.finalizes:
            # An attempt that is not here failed; the scheduler has its
            # failure report (or gets it with this step's report).
            known = attempts_get((f.req_id, f.attempt))
            if known is not None:
                known.finalize = f
                known.drain_rows = None
                known.deadline = deadline
                self.slab.cursors.ending[known.rows.slot] = True
                self._dirty.add(known.aid)
        for r in meta.releases:
            work.releases.append((r.req_id, r.attempt))
        work.pulls.extend(meta.pulls)

    @_engine_side
    def write_step(
        self,
        attempts: np.ndarray,
        starts: list[int] | np.ndarray,
        counts: list[int] | np.ndarray,
        rows: np.ndarray,
        *,
        scheduled: list[int] | np.ndarray | None = None,
        weight_version: str | None = None,
    ) -> None:
        """One step's captured rows: ``rows`` (``[sum(counts), L, K]``) holds
        ``counts[i]`` rows for tokens ``[starts[i], starts[i] + counts[i])``
        of attempt ``attempts[i]`` (a handle from :meth:`current_attempts`),
        in that order; ``scheduled[i] >= counts[i]`` were scheduled (the
        rest were rejected drafts). They were computed under
        ``weight_version`` (the version when the step was prepared). Rows
        of attempts that ended or failed since are ignored.

        Decode rows that continue their attempt are placed for all requests
        at once, with array operations (a row that starts a page takes it in
        one allocation for all of them); the others (prefill chunks,
        rewrites, drafts) go request by request."""
        spec = self.spec
        if rows.dtype != spec.dtype or rows.shape[1:] != spec.row_shape:
            raise ArtifactError(
                f"captured rows must be [n, {spec.num_layers}, {spec.top_k}] "
                f"{spec.dtype}, got {list(rows.shape)} {rows.dtype}"
            )
        handles = np.asarray(attempts, np.int64)
        start = np.asarray(starts, np.int64)
        count = np.asarray(counts, np.int64)
        sched = count if scheduled is None else np.asarray(scheduled, np.int64)
        if int(count.sum()) != rows.shape[0]:
            raise ArtifactError(
                f"counts add up to {int(count.sum())} rows, got {rows.shape[0]}"
            )
        bs = self.block_size
        cur = self.slab.cursors
        slot, live = cur.slots_of(handles)
        first = np.cumsum(count) - count
        held = cur.end[slot] - cur.committed[slot]
        fast = live & (count == 1) & (sched == 1) & (start == cur.end[slot])
        opens = fast & (held == cur.npages[slot] * bs)  # rows that start a page
        if opens.any():
            os_ = slot[opens]
            try:
                new_pages = self.slab.alloc_many(os_.shape[0], PAGE_WAIT_S)
            except ArtifactError:  # each of them fails alone, one by one
                fast &= ~opens
            else:
                version = weight_version or self._weight_version
                at = self._at_slot
                for s, page in zip(os_.tolist(), new_pages):
                    at[s].rows.append_page(page, version)
                cur.npages[os_] += 1
                cur.tail_page[os_] = new_pages
        if fast.any():
            fs = slot[fast]
            dst = cur.tail_page[fs] * bs + held[fast] - (cur.npages[fs] - 1) * bs
            # Decode rows are usually all on the fast path, in order.
            self.slab.row_cells[dst] = as_row_cells(
                rows if fs.shape[0] == rows.shape[0] else rows[first[fast]]
            )
            cur.end[fs] += 1
            cur.last_rows_end[fs] = cur.last_sched_end[fs] = cur.end[fs]
            wake = fs[(cur.end[fs] - cur.committed[fs] >= bs) | cur.ending[fs]]
            at = self._at_slot
            self._dirty.update(at[s].aid for s in wake.tolist())
        slow = np.flatnonzero(live & ~fast)
        if slow.shape[0]:
            self._write_rows_one_by_one(
                slow, slot, start, count, sched, first, rows, weight_version
            )

    def _write_rows_one_by_one(
        self,
        which: np.ndarray,
        slot: np.ndarray,
        start: np.ndarray,
        count: np.ndarray,
        sched: np.ndarray,
        first: np.ndarray,
        rows: np.ndarray,
        weight_version: str | None,
    ) -> None:
        pages = self.slab.pages
        cur = self.slab.cursors
        bs = self.block_size
        version = weight_version or self._weight_version
        for i in which.tolist():
            att = self._at_slot[int(slot[i])]
            s, n, lo = int(start[i]), int(count[i]), int(first[i])
            sl = att.rows.slot
            if cur.last_rows_end[sl] < s <= cur.last_sched_end[sl]:
                # The scheduler placed this step after the previous one's
                # draft tokens, some of which were rejected.
                s = int(cur.last_rows_end[sl])
            cur.last_rows_end[sl] = s + n
            cur.last_sched_end[sl] = s + int(sched[i])
            if not n:
                continue
            rows_state = att.rows
            try:
                for page, off, take in rows_state.place(s, n, version):
                    pages[page, off : off + take] = rows[lo : lo + take]
                    lo += take
            except ArtifactError as e:
                self._fail_here(att.aid, e)
                continue
            if (
                rows_state.end - rows_state.committed >= bs
                or att.finalize
                or att.drain_rows is not None
            ):
                self._dirty.add(att.aid)

    @_engine_side
    def flush(self, *, gather: bool = False) -> None:
        """Hand what this step made publishable to the publication thread;
        with ``gather``, full blocks alone may wait for the next steps' (see
        the module docs). An engine with nothing to run flushes without."""
        self._publication.check_alive()
        work = self._work
        dirty, self._dirty = self._dirty, set()
        attempts_get = self._attempts.get
        for aid in dirty:
            att = attempts_get(aid)
            if att is None:
                continue
            try:
                if self._collect(aid, att, work):
                    self._dirty.add(aid)
            except ArtifactError as e:
                self._fail_here(aid, e)
        if not work:
            return
        if gather and not (
            work.pulls or work.starts or work.finalizes or work.releases
        ):
            self._gathered += 1
            if self._gathered < GATHER_STEPS and len(work.objects) < GATHER_OBJECTS:
                return
        self._gathered = 0
        self._work = WorkItem()
        # How far behind the thread is (the metrics' queue depth).
        depth = self._items_put - self._publication.items_done
        if depth > self._queue_peak:
            self._queue_peak = depth
        self._publication.wait_for_slot()
        self._finalizes_handed += len(work.finalizes)
        self._publication.put(work)
        self._items_put += 1

    def _collect(self, aid: AttemptId, att: Attempt, work: WorkItem) -> bool:
        """Move what ``aid`` made publishable into ``work``; returns whether
        it still waits (a block without its hash, rows of a finalisation)."""
        rows, bs = att.rows, self.block_size
        objects = work.objects
        for start, page, version, h in rows.take_blocks(att.hashes):
            objects.append(PublishObject(att, start, bs, page, h, version, False))
        if att.drain_rows is not None:
            if rows.end < att.drain_rows and time.monotonic() <= att.deadline:
                return True  # rows of steps in flight may complete blocks
            rows.drop()
            self._remove(att)
            work.releases.append(aid)
            return False
        fin = att.finalize
        if fin is None:
            return rows.end - rows.committed >= bs
        if rows.end < fin.num_rows:
            if time.monotonic() > att.deadline:
                raise CoverageError(
                    f"rows for tokens [{rows.end}, {fin.num_rows}) never arrived "
                    f"({self._finalize_wait_s:g} s after the request ended)"
                )
            return True
        if fin.num_rows < rows.committed:
            # The finish lies inside rows already published (a stop string
            # the frontend found after more tokens ran, or the row of a step
            # scheduled before the finish was known completed a block):
            # acknowledge the published objects, which the scheduler cuts at
            # its boundary. They hold the true routes of their tokens.
            rows.drop()
            work.finalizes.append(
                (att, dataclasses.replace(fin, num_rows=rows.committed, tail_hash=None))
            )
            self._remove(att)
            return False
        if fin.num_rows - rows.committed >= bs:
            raise CoverageError(
                f"block {rows.committed // bs} of request {aid[0]} has no hash; "
                "the scheduler must send every full block's hash before finalize"
            )
        tail = rows.take_tail(fin.num_rows)
        if tail is not None:
            start, page, n, version = tail
            if fin.tail_hash is None:
                raise CoverageError(f"a {n}-row tail at row {start} but no tail hash")
            work.objects.append(
                PublishObject(att, start, n, page, fin.tail_hash, version, True)
            )
        elif fin.tail_hash is not None:
            raise CoverageError("a tail hash for rows that end on a block boundary")
        work.finalizes.append((att, fin))
        self._remove(att)
        return False

    def _remove(self, att: Attempt) -> None:
        """Take an attempt out of the table (its rows are handed over or
        dropped)."""
        aid = att.aid
        del self._attempts[aid]
        del self._at_slot[att.rows.slot]
        self._dirty.discard(aid)
        if self._current.get(aid[0]) == att.rows.handle:
            del self._current[aid[0]]
        att.rows.release()

    def _fail_here(self, aid: AttemptId, error: BaseException) -> None:
        """Fail an attempt on the engine's thread: drop its rows, report,
        and let the thread release what it retained."""
        att = self._attempts.get(aid)
        if att is not None:
            att.rows.drop()
            self._remove(att)
        self._publication.post(
            AttemptFailed(aid[0], aid[1], type(error).__name__, str(error))
        )
        self._work.releases.append(aid)

    def wait_for_answers(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every finalize handed to the
        thread so far has its acknowledgement or failure waiting in
        :meth:`report`; returns whether they all do (an engine with nothing
        else to run uses this instead of spinning)."""
        return self._publication.wait_answered(self._finalizes_handed, timeout_s)

    @_engine_side
    def owes_answers(self) -> bool:
        """Whether finalizes wait for their rows or for the thread."""
        return self._finalizes_handed > self._publication.finalizes_answered or any(
            a.finalize is not None for a in self._attempts.values()
        )

    @_engine_side
    def report(self) -> ArtifactWorkerReport:
        """Acknowledgements and failures produced so far."""
        items, pulled = self._publication.take_results()
        acks, failures = [], []
        for item in items:
            if isinstance(item, FinalizeAck):
                acks.append(item)
            else:
                failures.append(item)
                # Failed in the thread: stop taking this attempt's rows.
                aid = (item.req_id, item.attempt)
                att = self._attempts.get(aid)
                if att is not None:
                    att.rows.drop()
                    self._remove(att)
                    self._work.releases.append(aid)
        return ArtifactWorkerReport(tuple(acks), tuple(failures), pulled=tuple(pulled))

    @_engine_side
    def stats(self) -> dict[str, int]:
        """The store's counters, plus the attempts alive and the row-slab
        pages in use (approximate while the engine runs)."""
        out = dataclasses.asdict(self._writer.stats())
        out["attempts"] = len(self._attempts)
        out["slab_pages_used"] = self.slab.num_pages - self.slab.num_free()
        return out

    @_engine_side
    def metrics(self) -> dict[str, int]:
        """The store's counters for the Prometheus metrics (``metrics.py``)
        and ``queue_depth``: the most work items a step found still undone
        when it handed over its own, since the last call (at
        ``max_queued_steps`` that step waited)."""
        s = self._writer.stats()
        peak, self._queue_peak = self._queue_peak, 0
        return {
            "objects": s.objects,
            "used_bytes": s.used_bytes,
            "capacity_bytes": s.capacity_bytes,
            "retained_keys": s.retained_keys,
            "queue_depth": peak,
            "puts_written": s.puts_written,
            "divergences": s.divergences,
            "evicted_objects": s.evicted_objects,
            "space_evictions": s.space_evictions,
            "space_compactions": s.space_compactions,
            "shared_puts": s.shared_puts,
            "shared_pulls": s.shared_pulls,
            "shared_failures": s.shared_failures,
            "shared_rejected": s.shared_rejected,
            "shared_settles": self._publication.settles,
            "shared_settles_late": self._publication.settles_late,
        }

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until every work item handed over so far is done (tests,
        shutdown)."""
        self._publication.wait_idle(timeout_s)

    def close(self) -> None:
        """Finish the queued work, stop the thread, close the store."""
        self._publication.close()
