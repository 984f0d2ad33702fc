# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker-side publication, the publication thread (global rank 0 only).

:class:`PublicationThread` owns the thread (``artifact-publisher``), the
bounded queue through which the engine side
(:class:`~.publisher.ArtifactPublisher`) hands it work items
(:class:`WorkItem`), and the store calls of publication. The thread
publishes a work item with one ``put_batch`` (one arena write, one index
append), then produces the acknowledgements; items run in order, so a
request's blocks are always in the store before its acknowledgement.
Acknowledgements and failures wait here until the engine side's ``report``
takes them (:meth:`~PublicationThread.take_results`).

A failure in the thread fails exactly the attempts of the work item it hit
(:class:`~.protocol.AttemptFailed` with the error's type and message);
nothing is retained for them afterwards and none of their later work runs.
Pulls from a shared tier (:class:`~.protocol.PullRoutes`) start with the
step's work and run on the tier's own thread; when one ends, that thread
wakes this one, which puts what it fetched into the store and reports it.
An acknowledgement that names objects whose mirror into a shared tier is
still in flight (``ObjectStoreWriter.mirroring``: only on engines whose
answers send another engine to them) is held, not the thread: it leaves
when those mirrors end, or after :data:`MIRROR_SETTLE_S`, while the thread
goes on with later work; a slow tier delays the acknowledgements of the
requests whose objects it holds, nothing else (``settles``, ``settles_late``
count them).
Whenever the queue is empty (after an item, and every ``idle_upkeep_s`` with
nothing to do) the thread runs the store's upkeep: it prepares the next arena
ahead of need, compacts the log, and collects stale stores when due.

Threads: the methods of :class:`PublicationThread` without a leading
underscore are called from the engine's thread (:meth:`~PublicationThread.post`
from both); the others run on the publication thread. The results, which
both threads post, and the count of finalizes answered are guarded by one
condition.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vllm.distributed.artifact_connector.buffer import AttemptRows, RowSlab
from vllm.distributed.artifact_connector.protocol import (
    Abort,
    AttemptFailed,
    AttemptId,
    Finalize,
    FinalizeAck,
    ObjectRefs,
    PullRoutes,
)
from vllm.distributed.artifact_connector.request_core import (
    ENVELOPE_NBYTES,
    KeySpace,
    check_coverage,
    encode_objects,
)
from vllm.distributed.artifact_connector.store import (
    ArtifactError,
    ObjectMissingError,
    ObjectStoreWriter,
)
from vllm.logger import init_logger
from vllm.utils.routed_experts_rows import RowSpec

logger = init_logger(__name__)

#: The longest an acknowledgement is held for its objects' mirror into a
#: shared tier (a healthy master takes milliseconds); a held one does not
#: hold the thread.
MIRROR_SETTLE_S = 0.25
#: How often the thread looks at held acknowledgements while some wait.
HELD_POLL_S = 0.002


class WeightVersionMismatchError(ArtifactError):
    """A prefix-cache hit landed on blocks computed under other weights."""


class PublisherClosedError(ArtifactError):
    """The publication thread stopped (closed, or died of an error)."""


def _owner(aid: AttemptId) -> str:
    return f"{aid[0]}#{aid[1]}"


@dataclass(eq=False)
class Attempt:
    """One attempt. Engine side (under the engine lock): its unpublished
    rows (and, in their cursor slot, where its last step's rows ended), the
    block hashes not used yet, how it ends. Publication thread only: what
    it retains and published."""

    aid: AttemptId
    rows: AttemptRows
    hashes: dict[int, bytes] = field(default_factory=dict)
    # A finalize (acknowledgement owed) or a discard's drain: ends once the
    # rows up to ``ends_at`` arrived, or at the deadline.
    finalize: Finalize | None = None
    drain_rows: int | None = None
    deadline: float = 0.0
    # Publication thread.
    prefix_version: str = ""
    prefix_hashes: tuple[bytes, ...] = ()
    prefix_keys: list[str] = field(default_factory=list)
    # The version (checksum) of each prefix key when it was retained, None
    # until published: the one the hit's KV goes with, even if a sibling's
    # recomputation makes another version current before the finish.
    prefix_checksums: list[int | None] = field(default_factory=list)
    # (key, first row, rows, checksum, weight version) of each own object.
    own_refs: list[tuple[str, int, int, int, str]] = field(default_factory=list)
    failed: bool = False


class PublishObject(NamedTuple):
    """One object to publish: rows of page ``page`` of the slab."""

    att: Attempt
    start: int
    num_rows: int
    page: int
    block_hash: bytes
    weight_version: str
    tail: bool

    def is_tail(self) -> bool:
        return self.tail


@dataclass
class WorkItem:
    """Everything one step hands to the publication thread, in the order it
    runs: pulls, retains, one put of all objects, acknowledgements,
    releases."""

    pulls: list[PullRoutes] = field(default_factory=list)
    starts: list[Attempt] = field(default_factory=list)
    objects: list[PublishObject] = field(default_factory=list)
    finalizes: list[tuple[Attempt, Finalize]] = field(default_factory=list)
    releases: list[AttemptId] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.pulls or self.starts or self.objects or self.finalizes or self.releases
        )


@dataclass
class _Held:
    """An acknowledgement waiting for its objects' mirrors."""

    ack: FinalizeAck
    waits: list[threading.Event]
    deadline: float  # time.monotonic()


class _Pulled:
    """Put on the publication thread's queue when a pull ended."""


_PULLED = _Pulled()


class PublicationThread:
    """See the module docs. Starts the thread; :meth:`close` closes
    ``writer``. ``versions_seen`` is the engine side's list of weight
    versions (it appends; this thread reads it to name a prefix miss's
    cause)."""

    def __init__(
        self,
        writer: ObjectStoreWriter,
        spec: RowSpec,
        slab: RowSlab,
        keyspace: KeySpace,
        versions_seen: list[str],
        *,
        max_queued_steps: int,
        idle_upkeep_s: float,
    ) -> None:
        self.spec = spec
        self.slab = slab
        self.block_size = slab.block_size
        self._writer = writer
        self._keys = keyspace
        self._versions_seen = versions_seen
        self._idle_upkeep_s = idle_upkeep_s
        # Finalizes answered (thread; the engine side counts those handed):
        # an empty step waits until they are equal.
        self.finalizes_answered = 0
        # Produced by both threads, read by take_results(), under the condition.
        self._results: collections.deque[FinalizeAck | AttemptFailed] = (
            collections.deque()
        )
        self._pulled: list[str] = []  # guarded by the condition too
        self._results_cv = threading.Condition()
        # Work items, wait_idle's markers (events), pulls that ended and the
        # stop sentinel; the semaphore bounds the work items (back-pressure).
        self._queue: queue.SimpleQueue[WorkItem | threading.Event | _Pulled | None] = (
            queue.SimpleQueue()
        )
        self._free_slots = threading.BoundedSemaphore(max_queued_steps)
        # Work items done (one writer, this thread; the engine side reads it
        # without a lock for the metrics' queue depth).
        self.items_done = 0
        # Acknowledgements held for their mirrors (this thread only), and
        # how many were (settles), and of those how many left at the budget.
        self._held: list[_Held] = []
        self.settles = 0
        self.settles_late = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="artifact-publisher", daemon=True
        )
        self._thread.start()

    # ================================================================ engine
    def wait_for_slot(self) -> None:
        """Back-pressure when the thread is behind, but never wait on a
        dead thread."""
        while not self._free_slots.acquire(timeout=1.0):
            self.check_alive()

    def put(self, work: WorkItem) -> None:
        """Hand over a work item (after :meth:`wait_for_slot`)."""
        self._queue.put(work)

    def post(self, item: FinalizeAck | AttemptFailed) -> None:
        """Add an acknowledgement or a failure for :meth:`take_results`."""
        with self._results_cv:
            self._results.append(item)
            self._results_cv.notify_all()

    def take_results(self) -> tuple[list[FinalizeAck | AttemptFailed], list[str]]:
        """The acknowledgements and failures, and the requests whose pulls
        ended, produced since the last call."""
        with self._results_cv:
            items = list(self._results)
            self._results.clear()
            pulled, self._pulled = self._pulled, []
        return items, pulled

    def wait_answered(self, handed: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until ``handed`` finalizes are
        answered; returns whether they are."""
        with self._results_cv:
            return self._results_cv.wait_for(
                lambda: self.finalizes_answered >= handed, timeout_s
            )

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until every work item handed over so far is done (tests,
        shutdown)."""
        self.check_alive()
        reached = threading.Event()
        self._queue.put(reached)  # set by the thread after everything before it
        if not reached.wait(timeout_s):
            self.check_alive()
            raise TimeoutError("artifact publication did not finish in time")

    def check_alive(self) -> None:
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
                if self._held:
                    self._release_held()
                try:
                    item = q.get(
                        timeout=HELD_POLL_S if self._held else self._idle_upkeep_s
                    )
                except queue.Empty:
                    if not self._held:
                        self._upkeep()
                    continue
                if item is None:
                    self._release_held(wait=True)
                    return
                if isinstance(item, threading.Event):
                    self._release_held(wait=True)  # "done" includes them
                    item.set()
                    continue
                if isinstance(item, _Pulled):
                    self._report_pulled(self._writer.pulled())
                    continue
                try:
                    self._process(item)
                finally:
                    self.items_done += 1
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

    def _pull(self, pulls: list[PullRoutes]) -> None:
        self._report_pulled(
            [
                p.req_id
                for p in pulls
                if self._writer.pull(p.req_id, p.keys, lambda: self._queue.put(_PULLED))
            ]
        )

    def _report_pulled(self, req_ids: list[str]) -> None:
        """Pulls that ended (at once, or :meth:`ObjectStoreWriter.pulled`'s
        after a wake-up), for :meth:`take_results`."""
        if req_ids:
            with self._results_cv:
                self._pulled.extend(req_ids)
                self._results_cv.notify_all()

    def _process(self, work: WorkItem) -> None:
        if work.pulls:
            self._pull(work.pulls)
        for att in work.starts:
            att.prefix_keys = [
                self._keys.key(att.prefix_version, h, self.block_size, tail=False)
                for h in att.prefix_hashes
            ]
            self._writer.retain(_owner(att.aid), att.prefix_keys)
            att.prefix_checksums = self._versions(att.prefix_keys)
        objects = [o for o in work.objects if not o.att.failed]
        if len(objects) < len(work.objects):
            self.slab.free_later([o.page for o in work.objects if o.att.failed])
        if objects:
            self._publish(objects)
        for att in work.starts:  # prefix blocks a sibling published this step
            if None in att.prefix_checksums:
                now = self._versions(att.prefix_keys)
                att.prefix_checksums = [
                    c if c is not None else n for c, n in zip(att.prefix_checksums, now)
                ]
        for att, fin in work.finalizes:
            if not att.failed:
                try:
                    ack = self._acknowledge(att, fin)
                except ArtifactError as e:
                    self._fail_in_thread([att], e)
                else:
                    # The engine it sends to these objects may ask at once.
                    waits = self._writer.mirroring(ack.refs.keys)
                    if waits:
                        self.settles += 1
                        deadline = time.monotonic() + MIRROR_SETTLE_S
                        self._held.append(_Held(ack, waits, deadline))
                        continue
                    self.post(ack)
            self._answered()
        for aid in work.releases:
            self._writer.release(_owner(aid))

    def _answered(self) -> None:
        with self._results_cv:
            self.finalizes_answered += 1
            self._results_cv.notify_all()

    def _release_held(self, *, wait: bool = False) -> None:
        """Post the held acknowledgements whose mirrors ended or whose
        budget is spent (``wait``: all of them, waiting out their budgets)."""
        still: list[_Held] = []
        for held in self._held:
            if wait:
                for e in held.waits:
                    e.wait(max(0.0, held.deadline - time.monotonic()))
            done = all(e.is_set() for e in held.waits)
            if not (done or wait or time.monotonic() >= held.deadline):
                still.append(held)
                continue
            if not done:
                self.settles_late += 1
            self.post(held.ack)
            self._answered()
        self._held = still

    def _publish(self, objects: list[PublishObject]) -> None:
        # Full blocks first: encode_objects copies and envelopes them as one
        # array; tails (one per finishing request) follow.
        objects.sort(key=PublishObject.is_tail)
        key = self._keys.key
        keys = [
            key(o.weight_version, o.block_hash, o.num_rows, tail=o.tail)
            for o in objects
        ]
        starts = np.fromiter((o.start for o in objects), np.int64, len(objects))
        nrows = np.fromiter((o.num_rows for o in objects), np.int64, len(objects))
        pages = np.fromiter((o.page for o in objects), np.int64, len(objects))
        tails = nrows < self.block_size
        try:
            result = self._writer.put_batch(
                keys,
                nrows * self.spec.row_nbytes + ENVELOPE_NBYTES,
                lambda buf: encode_objects(
                    self.spec,
                    keys,
                    starts,
                    nrows,
                    self.slab.pages,
                    pages,
                    buf,
                    tails=tails,
                ),
                owners=[_owner(o.att.aid) for o in objects],
            )
        except (ArtifactError, OSError) as e:
            self._fail_in_thread(list(dict.fromkeys(o.att for o in objects)), e)
            return
        finally:
            self.slab.free_later(pages.tolist())
        for o, ref in zip(objects, result.refs):
            o.att.own_refs.append(
                (ref.key, o.start, o.num_rows, ref.checksum, o.weight_version)
            )

    def _versions(self, keys: list[str]) -> list[int | None]:
        return [None if r is None else r.checksum for r in self._writer.lookup(keys)]

    def _acknowledge(self, att: Attempt, fin: Finalize) -> FinalizeAck:
        version, prefix_hashes = att.prefix_version, att.prefix_hashes
        prefix_keys = att.prefix_keys
        bs = self.block_size
        rows: list[tuple[str, int, int, int, str]] = []
        for b, (key, ref, retained) in enumerate(
            zip(
                prefix_keys,
                self._writer.lookup(prefix_keys),
                att.prefix_checksums,
                strict=True,
            )
        ):
            if ref is None:
                raise self._prefix_miss(b, key, version, prefix_hashes[b])
            # The version retained (the retain keeps every version alive).
            checksum = ref.checksum if retained is None else retained
            rows.append((key, b * bs, bs, checksum, version))
        rows.extend(att.own_refs)
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
        error = ObjectMissingError(
            f"the routes of prefix-cache block {block} (object {key}) are not in "
            "the artifact store: evicted or never published; the block leaves "
            "the prefix cache, so the next request recomputes it"
        )
        error.lost_block_hash = block_hash  # type: ignore[attr-defined]
        return error

    def _fail_in_thread(self, atts: list[Attempt], error: BaseException) -> None:
        # The message, not the exception: a log record kept by a handler
        # would keep the exception's frames, and the attempts, alive.
        logger.warning(
            "artifact publication failed for %d request(s): %s", len(atts), str(error)
        )
        for att in atts:
            if att.failed:
                continue
            att.failed = True
            att.own_refs.clear()
            self._writer.release(_owner(att.aid))
            aid = att.aid
            self.post(
                AttemptFailed(
                    aid[0],
                    aid[1],
                    type(error).__name__,
                    str(error),
                    getattr(error, "lost_block_hash", None),
                )
            )
