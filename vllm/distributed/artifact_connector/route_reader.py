# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading finished requests' routes off the engine thread.

The scheduler connector hands each acknowledged finish to
:class:`RouteReader` (:meth:`submit`, a list append) and takes the
finished arrays back at a later step (:meth:`take_done`); the engine
thread never waits on a read while it has work. The reader thread owns its
store reader and reads whatever is queued together (:func:`read_batch`:
one index lookup, envelope check and copy pass for all of them), in
batches of about :data:`BATCH_OBJECTS` objects (a longer request is read in
runs of that many), yielding the interpreter between batches and runs so
that the engine thread never waits long for it. A read that asks for a
reference hands its array to :class:`~.route_refs.RouteRefs` (made on the
first such read) and returns the reference instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm.distributed.artifact_connector.request_core import RowsRead, read_batch
from vllm.distributed.artifact_connector.store import ArtifactError, ObjectStoreReader
from vllm.logger import init_logger
from vllm.utils.routed_experts_rows import RowSpec

if TYPE_CHECKING:
    from vllm.distributed.artifact_connector.route_refs import RouteRefs
    from vllm_host_transport.routed_experts import RoutedExpertsRef

logger = init_logger(__name__)

#: Objects per batch read: about 0.3 ms of the reader's Python on the
#: 2-vCPU VM (docs/benchmarks.md, "scheduler read"), the longest the engine
#: thread can wait for the interpreter because of a read.
BATCH_OBJECTS = 256
#: How often an idle reader removes references' routes past their TTL.
REF_UPKEEP_S = 1.0


@dataclass(frozen=True, slots=True)
class RouteRead:
    """A finished attempt's read: rows ``[read.first_row, end)``."""

    req_id: str
    attempt: int
    read: RowsRead
    end: int
    # Hand the rows out by reference (routed_experts_format "ref").
    as_ref: bool = False


@dataclass(frozen=True, slots=True)
class RouteResult:
    req_id: str
    attempt: int
    rows: np.ndarray | None
    error: str | None
    seconds: float  # the read's share of its batch's reader time
    ref: RoutedExpertsRef | None = None


class RouteReader:
    """See the module docs. :meth:`submit`, :meth:`take_done`,
    :meth:`wait_done` and :meth:`close` are called by one thread (the
    engine's)."""

    def __init__(
        self,
        reader: ObjectStoreReader,
        spec: RowSpec,
        make_refs: Callable[[], RouteRefs] | None = None,
    ) -> None:
        self._reader = reader
        self._spec = spec
        # Reader thread: references, made on the first read that asks.
        self._make_refs = make_refs
        self.refs: RouteRefs | None = None
        self._cv = threading.Condition()
        self._queued: list[RouteRead] = []
        self._done: list[RouteResult] = []
        self._pending = 0  # submitted, not yet taken back
        self._stop = False
        # Why the thread died, if it did: reads then fail at once instead of
        # leaving their requests waiting.
        self._dead: str | None = None
        self._thread = threading.Thread(
            target=self._run, name="artifact-route-reader", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ engine side
    def submit(self, reads: list[RouteRead]) -> None:
        if not reads:
            return
        with self._cv:
            if self._stop:
                raise RuntimeError("the route reader is closed")
            self._pending += len(reads)
            if self._dead is not None:
                self._done.extend(self._failed(reads, self._dead))
                return
            self._queued.extend(reads)
            self._cv.notify_all()

    def take_done(self) -> list[RouteResult]:
        """The reads finished since the last call (without waiting)."""
        if not self._done:  # a racy peek; the next step takes what it missed
            return []
        with self._cv:
            done, self._done = self._done, []
            self._pending -= len(done)
        return done

    def wait_done(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a read to finish (for a step that has
        nothing else to do, so that it does not spin while holding the
        interpreter the reader needs)."""
        with self._cv:
            if not self._done and self._pending:
                self._cv.wait(timeout)

    @property
    def pending(self) -> int:
        return self._pending

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        self._reader.close()
        if self.refs is not None:
            self.refs.close()

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        batch: list[RouteRead] = []
        try:
            while True:
                with self._cv:
                    if not self._queued and not self._stop:
                        self._cv.wait(REF_UPKEEP_S)
                    if self._stop:
                        return
                    batch = self._take_batch() if self._queued else []
                if not batch:  # idle: remove unfetched routes past their TTL
                    if self.refs is not None:
                        self.refs.expire()
                    continue
                results = self._read(batch)
                batch = []
                with self._cv:
                    self._done.extend(results)
                    self._cv.notify_all()
                # Let a waiting engine thread have the interpreter before the
                # next batch.
                time.sleep(0)
        except BaseException as e:
            logger.exception("the routed-experts reader thread died")
            with self._cv:
                self._dead = f"the route reader thread died: {e!r}"
                self._done.extend(self._failed(batch + self._queued, self._dead))
                self._queued = []
                self._cv.notify_all()

    @staticmethod
    def _failed(reads: list[RouteRead], why: str) -> list[RouteResult]:
        error = f"ArtifactError: {why}"
        return [RouteResult(r.req_id, r.attempt, None, error, 0.0) for r in reads]

    def _take_batch(self) -> list[RouteRead]:
        queued = self._queued
        n = objects = 0
        while n < len(queued) and (n == 0 or objects < BATCH_OBJECTS):
            objects += len(queued[n].read.refs)
            n += 1
        batch, self._queued = queued[:n], queued[n:]
        return batch

    def _read(self, batch: list[RouteRead]) -> list[RouteResult]:
        start = time.perf_counter()
        try:
            got: list = read_batch(
                self._reader,
                self._spec,
                [r.read for r in batch],
                pause_every=BATCH_OBJECTS,
            )
        except Exception as e:  # a bug, not a store fault: fail loudly, per read
            logger.exception("reading routes failed")
            got = [ArtifactError(f"reading routes failed: {e!r}")] * len(batch)
        share = (time.perf_counter() - start) / len(batch)
        results = []
        for r, rows in zip(batch, got):
            if isinstance(rows, ArtifactError):
                logger.warning("routes of request %s unreadable: %s", r.req_id, rows)
                error = f"{type(rows).__name__}: {rows}"
                results.append(RouteResult(r.req_id, r.attempt, None, error, share))
                continue
            cut = rows[: r.end - r.read.first_row]
            if not r.as_ref:
                results.append(RouteResult(r.req_id, r.attempt, cut, None, share))
                continue
            try:
                ref = self._route_refs().publish(cut, r.read.first_row)
            except ArtifactError as e:
                logger.warning("routes of request %s not handed out: %s", r.req_id, e)
                error = f"{type(e).__name__}: {e}"
                results.append(RouteResult(r.req_id, r.attempt, None, error, share))
            else:
                results.append(RouteResult(r.req_id, r.attempt, None, None, share, ref))
        return results

    def _route_refs(self) -> RouteRefs:
        if self.refs is None:
            if self._make_refs is None:
                raise ArtifactError(
                    "this engine hands out no routed-experts references"
                )
            self.refs = self._make_refs()  # raises RouteRefPublishError
        return self.refs
