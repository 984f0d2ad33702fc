# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker-side publication, off the step loop (global rank 0 only).

The engine's thread feeds :class:`ArtifactPublisher` with the scheduler's
messages (:meth:`~ArtifactPublisher.apply`) and each step's captured rows
(:meth:`~ArtifactPublisher.write_step`), then calls
:meth:`~ArtifactPublisher.flush` once per step. ``flush`` collects what the
step made publishable (full blocks whose hash is known, finalisations whose
rows have all arrived) into one work item and hands it to the publication
thread through a bounded queue; it returns at once unless the queue is full
(back-pressure). The thread publishes a work item with one ``put_batch``
(one arena write, one index append), then produces the acknowledgements;
items run in order, so a request's blocks are always in the store before
its acknowledgement. The engine's thread collects acknowledgements,
progress and failures with :meth:`~ArtifactPublisher.report`.

Retention: an attempt retains the objects of its prefix hit when it starts
(keys a sibling has not published yet included) and everything it
publishes, until the scheduler releases it after reading the
acknowledgement, or until it is discarded or fails.

A failure in the thread fails exactly the attempts of the work item it hit
(:class:`~.protocol.AttemptFailed` with the error's type and message);
nothing is retained for them afterwards and none of their later work runs.
Whenever the queue is empty (after an item, and every ``idle_upkeep_s`` with
nothing to do) the thread runs the store's upkeep: it prepares the next arena
ahead of need, compacts the log, and collects stale stores when due.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from vllm.distributed.artifact_connector.buffer import AttemptRows, RowSlab
from vllm.distributed.artifact_connector.protocol import (
    Abort,
    ArtifactSchedulerMeta,
    ArtifactWorkerReport,
    AttemptFailed,
    CommitProgress,
    Finalize,
    FinalizeAck,
    ObjectRefs,
)
from vllm.distributed.artifact_connector.request_core import (
    ENVELOPE_NBYTES,
    CoverageError,
    KeySpace,
    RowSpec,
    check_coverage,
    encode_objects,
)
from vllm.distributed.artifact_connector.store import (
    ArtifactError,
    ObjectMissingError,
    ObjectStoreWriter,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

AttemptId = tuple[str, int]


class WeightVersionMismatchError(ArtifactError):
    """A prefix-cache hit landed on blocks computed under other weights."""


class PublisherClosedError(ArtifactError):
    """The publication thread stopped (closed, or died of an error)."""


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


def _owner(aid: AttemptId) -> str:
    return f"{aid[0]}#{aid[1]}"


@dataclass
class _Attempt:
    """Engine-thread state of one attempt."""

    rows: AttemptRows
    hashes: dict[int, bytes] = field(default_factory=dict)
    finalize: Finalize | None = None
    finalize_deadline: float = 0.0


class _Object(NamedTuple):
    """One object to publish: rows of page ``page`` of the slab."""

    aid: AttemptId
    start: int
    num_rows: int
    page: int
    block_hash: bytes
    weight_version: str
    tail: bool


@dataclass
class _Work:
    """Everything one step hands to the publication thread, in the order it
    runs: retains, one put of all objects, acknowledgements, releases."""

    starts: list[tuple[AttemptId, str, tuple[bytes, ...]]] = field(default_factory=list)
    objects: list[_Object] = field(default_factory=list)
    finalizes: list[Finalize] = field(default_factory=list)
    releases: list[AttemptId] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.starts or self.objects or self.finalizes or self.releases)


class ArtifactPublisher:
    """See the module docs. Owns ``writer`` and closes it."""

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
        self._writer = writer
        self._keys = keyspace
        self._weight_version = weight_version
        self._versions_seen = [weight_version]
        self._finalize_wait_s = finalize_wait_s
        self._idle_upkeep_s = idle_upkeep_s
        # Engine thread.
        self._attempts: dict[AttemptId, _Attempt] = {}
        self._dirty: set[AttemptId] = set()
        self._work = _Work()
        # Produced by both threads, read by report(), guarded by the condition.
        self._results: collections.deque[
            CommitProgress | FinalizeAck | AttemptFailed
        ] = collections.deque()
        self._results_cv = threading.Condition()
        # See _engine_side.
        self._engine_lock = threading.RLock()
        # Publication thread.
        # Per attempt: (key, first row, rows, checksum, weight version).
        self._own_refs: dict[AttemptId, list[tuple[str, int, int, int, str]]] = {}
        # Per attempt: the prefix hit's weight version, block hashes and keys.
        self._prefix: dict[AttemptId, tuple[str, tuple[bytes, ...], list[str]]] = {}
        self._failed: set[AttemptId] = set()
        # Work items, wait_idle's markers (events) and the stop sentinel; the
        # semaphore bounds the work items (back-pressure).
        self._queue: queue.SimpleQueue[_Work | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._free_slots = threading.BoundedSemaphore(max_queued_steps)
        # Work items handed over (engine thread) and done (publication
        # thread), and the most a step found still undone since the last
        # metrics() (each counter has one writer; reads need no lock).
        self._items_put = self._items_done = self._queue_peak = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="artifact-publisher", daemon=True
        )
        self._thread.start()

    # ================================================================ engine
    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Rows written from now on were computed under ``version``."""
        self._weight_version = version
        if version not in self._versions_seen:
            self._versions_seen.append(version)

    @_engine_side
    def apply(self, meta: ArtifactSchedulerMeta) -> None:
        """Take one step's scheduler messages (a weight version first)."""
        if meta.weight_version is not None:
            self.set_weight_version(meta.weight_version)
        work = self._work
        for s in meta.starts:
            aid = (s.req_id, s.attempt)
            old = self._attempts.pop(aid, None)
            if old is not None:  # a repeated start replaces the attempt
                old.rows.drop()
            self._attempts[aid] = _Attempt(AttemptRows(self.slab, s.cached_rows))
            if len(s.prefix_hashes) * self.block_size != s.cached_rows:
                self._fail_here(
                    aid,
                    CoverageError(
                        f"{len(s.prefix_hashes)} prefix hashes for "
                        f"{s.cached_rows} cached rows (block size {self.block_size})"
                    ),
                )
                continue
            work.starts.append((aid, self._weight_version, s.prefix_hashes))
        for h in meta.hashes:
            att = self._attempts.get((h.req_id, h.attempt))
            if att is not None:
                for i, bh in enumerate(h.hashes):
                    att.hashes[h.first_block + i] = bh
                self._dirty.add((h.req_id, h.attempt))
        for d in meta.discards:
            aid = (d.req_id, d.attempt)
            att = self._attempts.pop(aid, None)
            if att is not None:
                att.rows.drop()
            self._dirty.discard(aid)
            work.releases.append(aid)
        for f in meta.finalizes:
            aid = (f.req_id, f.attempt)
            att = self._attempts.get(aid)
            if att is not None:
                att.finalize = f
                att.finalize_deadline = time.monotonic() + self._finalize_wait_s
                self._dirty.add(aid)
        for r in meta.releases:
            work.releases.append((r.req_id, r.attempt))

    @_engine_side
    def write_step(
        self,
        attempts: list[AttemptId],
        starts: list[int],
        counts: list[int],
        rows: np.ndarray,
    ) -> None:
        """One step's captured rows: ``rows`` (``[sum(counts), L, K]``) holds
        ``counts[i]`` rows for tokens ``[starts[i], starts[i] + counts[i])``
        of ``attempts[i]``, in that order. Rows of unknown (finished,
        failed) attempts are ignored."""
        spec = self.spec
        if rows.dtype != spec.dtype or rows.shape[1:] != spec.row_shape:
            raise ArtifactError(
                f"captured rows must be [n, {spec.num_layers}, {spec.top_k}] "
                f"{spec.dtype}, got {list(rows.shape)} {rows.dtype}"
            )
        if sum(counts) != rows.shape[0]:
            raise ArtifactError(
                f"counts add up to {sum(counts)} rows, got {rows.shape[0]}"
            )
        pages = self.slab.pages
        dst: list[int] = []  # single rows (decodes), copied in one gather
        src: list[int] = []
        bs = self.block_size
        version = self._weight_version
        dirty = self._dirty
        lo = 0
        attempts_get = self._attempts.get
        for aid, start, n in zip(attempts, starts, counts):
            att = attempts_get(aid)
            first, lo = lo, lo + n
            if att is None or not n:
                continue
            rows_state = att.rows
            try:
                if n == 1:
                    dst.append(rows_state.place_one(start, version))
                    src.append(first)
                else:
                    i = first
                    for page, off, take in rows_state.place(start, n, version):
                        pages[page, off : off + take] = rows[i : i + take]
                        i += take
            except ArtifactError as e:
                self._fail_here(aid, e)
                continue
            if rows_state.end - rows_state.committed >= bs or att.finalize:
                dirty.add(aid)
        if dst:
            flat = pages.reshape(-1, *spec.row_shape)
            flat[dst] = rows[src]

    @_engine_side
    def flush(self) -> None:
        """Hand what this step made publishable to the publication thread."""
        self._check_thread()
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
        if work:
            self._work = _Work()
            # How far behind the thread is (the metrics' queue depth).
            depth = self._items_put - self._items_done
            if depth > self._queue_peak:
                self._queue_peak = depth
            # Back-pressure when the thread is behind, but never wait on a
            # dead thread.
            while not self._free_slots.acquire(timeout=1.0):
                self._check_thread()
            self._queue.put(work)
            self._items_put += 1

    def _collect(self, aid: AttemptId, att: _Attempt, work: _Work) -> bool:
        """Move what ``aid`` made publishable into ``work``; returns whether
        it still waits (a block without its hash, rows of a finalisation)."""
        rows, bs = att.rows, self.block_size
        objects = work.objects
        for start, page, version, h in rows.take_blocks(att.hashes):
            objects.append(_Object(aid, start, bs, page, h, version, False))
        fin = att.finalize
        if fin is None:
            return rows.end - rows.committed >= bs
        if rows.end < fin.num_rows:
            if time.monotonic() > att.finalize_deadline:
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
                dataclasses.replace(fin, num_rows=rows.committed, tail_hash=None)
            )
            del self._attempts[aid]
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
                _Object(aid, start, n, page, fin.tail_hash, version, True)
            )
        elif fin.tail_hash is not None:
            raise CoverageError("a tail hash for rows that end on a block boundary")
        work.finalizes.append(fin)
        del self._attempts[aid]
        return False

    def _fail_here(self, aid: AttemptId, error: BaseException) -> None:
        """Fail an attempt on the engine's thread: drop its rows, report,
        and let the thread release what it retained."""
        att = self._attempts.pop(aid, None)
        if att is not None:
            att.rows.drop()
        self._dirty.discard(aid)
        self._post(AttemptFailed(aid[0], aid[1], type(error).__name__, str(error)))
        self._work.releases.append(aid)

    def _post(self, item: CommitProgress | FinalizeAck | AttemptFailed) -> None:
        with self._results_cv:
            self._results.append(item)
            self._results_cv.notify_all()

    def wait_for_results(self, attempts: list[AttemptId], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every attempt in ``attempts`` has an
        acknowledgement or a failure waiting in :meth:`report`; returns
        whether they all do (an engine with nothing else to run uses this
        instead of spinning)."""
        want = set(attempts)

        def ready() -> bool:
            have = {
                (r.req_id, r.attempt)
                for r in self._results
                if isinstance(r, FinalizeAck | AttemptFailed)
            }
            return want <= have

        with self._results_cv:
            return self._results_cv.wait_for(ready, timeout_s)

    @_engine_side
    def report(self) -> ArtifactWorkerReport:
        """Acknowledgements, progress and failures produced so far."""
        with self._results_cv:
            items = list(self._results)
            self._results.clear()
        progress, acks, failures = [], [], []
        for item in items:
            if isinstance(item, FinalizeAck):
                acks.append(item)
            elif isinstance(item, AttemptFailed):
                failures.append(item)
                # Failed in the thread: stop taking this attempt's rows.
                aid = (item.req_id, item.attempt)
                att = self._attempts.pop(aid, None)
                if att is not None:
                    att.rows.drop()
                    self._dirty.discard(aid)
                    self._work.releases.append(aid)
            else:
                progress.append(item)
        return ArtifactWorkerReport(tuple(progress), tuple(acks), tuple(failures))

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
        }

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until every work item handed over so far is done (tests,
        shutdown)."""
        self._check_thread()
        reached = threading.Event()
        self._queue.put(reached)  # set by the thread after everything before it
        if not reached.wait(timeout_s):
            self._check_thread()
            raise TimeoutError("artifact publication did not finish in time")

    def _check_thread(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise PublisherClosedError(
                "the artifact publication thread is not running"
                + (f": it died of {self._error!r}" if self._error else "")
            )

    def close(self) -> None:
        """Finish the queued work, stop the thread, close the store."""
        if self._closed:
            return
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._closed = True
        self._writer.close()

    # ================================================================ thread
    def _run(self) -> None:
        q = self._queue
        try:
            while True:
                try:
                    item = q.get(timeout=self._idle_upkeep_s)
                except queue.Empty:
                    self._upkeep()
                    continue
                if item is None:
                    return
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                try:
                    self._process(item)
                finally:
                    self._items_done += 1
                    self._free_slots.release()
                if q.empty():  # between steps: prepare the next arena etc.
                    self._upkeep()
        except BaseException as e:  # a bug: reported loudly by the next flush
            self._error = e
            logger.exception("artifact publication thread died")

    def _upkeep(self) -> None:
        try:
            self._writer.maintain()
        except (ArtifactError, OSError) as e:
            logger.warning("artifact store upkeep failed: %s", e)

    def _process(self, work: _Work) -> None:
        for aid, version, prefix_hashes in work.starts:
            keys = [
                self._keys.key(version, h, self.block_size, tail=False)
                for h in prefix_hashes
            ]
            self._prefix[aid] = (version, prefix_hashes, keys)
            self._own_refs[aid] = []
            self._writer.retain(_owner(aid), keys)
        objects = [o for o in work.objects if o.aid not in self._failed]
        for o in work.objects:
            if o.aid in self._failed:
                self.slab.free_later(o.page)
        if objects:
            self._publish(objects)
        for fin in work.finalizes:
            aid = (fin.req_id, fin.attempt)
            if aid in self._failed:
                self._forget(aid)
                continue
            try:
                ack = self._acknowledge(aid, fin)
            except ArtifactError as e:
                self._fail_in_thread([aid], e)
                continue
            self._post(ack)
        for aid in work.releases:
            self._forget(aid)

    def _publish(self, objects: list[_Object]) -> None:
        key = self._keys.key
        keys = [
            key(o.weight_version, o.block_hash, o.num_rows, tail=o.tail)
            for o in objects
        ]
        rb = self.spec.row_nbytes
        page_nbytes = self.block_size * rb
        slab_bytes = self.slab.pages.reshape(-1).view(np.uint8).data
        payloads = [
            slab_bytes[o.page * page_nbytes : o.page * page_nbytes + o.num_rows * rb]
            for o in objects
        ]
        lengths = np.array([len(p) for p in payloads], np.int64) + ENVELOPE_NBYTES
        starts = [o.start for o in objects]
        tails = [o.tail for o in objects]
        try:
            result = self._writer.put_batch(
                keys,
                lengths,
                lambda buf: encode_objects(
                    self.spec, keys, starts, payloads, buf, tails=tails
                ),
                owners=[_owner(o.aid) for o in objects],
            )
        except (ArtifactError, OSError) as e:
            self._fail_in_thread(list(dict.fromkeys(o.aid for o in objects)), e)
            return
        finally:
            payloads.clear()
            for o in objects:
                self.slab.free_later(o.page)
        ends: dict[AttemptId, int] = {}
        for o, ref in zip(objects, result.refs):
            self._own_refs[o.aid].append(
                (ref.key, o.start, o.num_rows, ref.checksum, o.weight_version)
            )
            ends[o.aid] = o.start + o.num_rows
        for aid, end in ends.items():
            self._post(CommitProgress(aid[0], aid[1], end))

    def _acknowledge(self, aid: AttemptId, fin: Finalize) -> FinalizeAck:
        version, prefix_hashes, prefix_keys = self._prefix[aid]
        bs = self.block_size
        rows: list[tuple[str, int, int, int, str]] = []
        for b, (key, ref) in enumerate(
            zip(prefix_keys, self._writer.lookup(prefix_keys))
        ):
            if ref is None:
                raise self._prefix_miss(b, key, version, prefix_hashes[b])
            rows.append((key, b * bs, bs, ref.checksum, version))
        rows.extend(self._own_refs[aid])
        columns = [list(c) for c in zip(*rows)] if rows else [[]] * 5
        refs = ObjectRefs.build(*columns)
        check_coverage(refs, fin.num_rows)
        return FinalizeAck(
            fin.req_id, fin.attempt, fin.num_rows, refs, isinstance(fin, Abort)
        )

    def _prefix_miss(
        self, block: int, key: str, version: str, block_hash: bytes
    ) -> ArtifactError:
        """The error for a prefix-hit block whose object is missing: a
        weight-version mismatch when the block exists under other weights."""
        for other in self._versions_seen:
            if other == version:
                continue
            k = self._keys.key(other, block_hash, self.block_size, tail=False)
            if self._writer.lookup([k])[0] is not None:
                return WeightVersionMismatchError(
                    f"prefix-cache hit on block {block}, computed under weight "
                    f"version {other!r}, while the engine runs version "
                    f"{version!r}: routes of other weights are never returned. "
                    "Reset the prefix cache when you update weights "
                    "(LLM.reset_prefix_cache(), or POST /reset_prefix_cache)."
                )
        return ObjectMissingError(
            f"the routes of prefix-cache block {block} (object {key}) are not in "
            "the artifact store: evicted or never published"
        )

    def _fail_in_thread(self, aids: list[AttemptId], error: BaseException) -> None:
        logger.warning(
            "artifact publication failed for %d request(s): %s", len(aids), error
        )
        for aid in aids:
            if aid in self._failed:
                continue
            self._failed.add(aid)
            self._writer.release(_owner(aid))
            self._post(AttemptFailed(aid[0], aid[1], type(error).__name__, str(error)))

    def _forget(self, aid: AttemptId) -> None:
        self._writer.release(_owner(aid))
        self._own_refs.pop(aid, None)
        self._prefix.pop(aid, None)
        self._failed.discard(aid)
