# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading finished requests' routes off the engine thread.

The scheduler connector hands each acknowledged finish to
:class:`RouteReader` (:meth:`~RouteReader.submit`, a list append) and takes
the arrays back from the shared :class:`~.route_results.RouteResults` at a
later step; the engine thread never waits on a read while it has work. The
reader thread owns its store reader and reads whatever is queued together
(:func:`read_batch`: one index lookup, envelope check and copy pass for all
of them), in batches of about :data:`BATCH_OBJECTS` objects (a longer
request is read in runs of that many), posting each batch's results as soon
as it is read and yielding the interpreter between batches and runs. It
reads the local store only: handing rows out by reference is
:mod:`~.route_handoff`'s, on a thread of its own, so that no read waits
behind a transport.

A thread that dies (an exception no read catches) fails what it held and
is started again by the next :meth:`~RouteReader.submit`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from vllm.distributed.artifact_connector.request_core import RowsRead, read_batch
from vllm.distributed.artifact_connector.route_results import (
    RouteResult,
    RouteResults,
)
from vllm.distributed.artifact_connector.store import ArtifactError, ObjectStoreReader
from vllm.logger import init_logger
from vllm.utils.routed_experts_rows import RowSpec

logger = init_logger(__name__)

#: Objects per batch read: about 0.3 ms of the reader's Python on the
#: 2-vCPU VM (docs/benchmarks.md, "scheduler read"), the longest the engine
#: thread can wait for the interpreter because of a read.
BATCH_OBJECTS = 256
#: How long :meth:`RouteReader.close` waits for a read in flight.
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class RouteRead:
    """A finished attempt's read: rows ``[read.first_row, end)``."""

    req_id: str
    attempt: int
    read: RowsRead
    end: int


class RouteReader:
    """See the module docs. :meth:`submit` and :meth:`close` are called by
    one thread (the engine's)."""

    def __init__(
        self, reader: ObjectStoreReader, spec: RowSpec, results: RouteResults
    ) -> None:
        self._reader = reader
        self._spec = spec
        self._results = results
        self._cv = threading.Condition()
        self._queued: list[RouteRead] = []
        self._stop = False
        self._thread = self._spawn()

    # ------------------------------------------------------------ engine side
    def submit(self, reads: list[RouteRead]) -> None:
        if not reads:
            return
        self._results.add_pending(len(reads))
        with self._cv:
            if self._stop:
                raise RuntimeError("the route reader is closed")
            if not self._thread.is_alive():
                logger.warning("restarting the routed-experts reader thread")
                self._thread = self._spawn()
            self._queued.extend(reads)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            thread = self._thread
        thread.join(timeout=CLOSE_WAIT_S)
        if not thread.is_alive():
            self._reader.close()
        else:  # closing the reader under a read would unmap what it reads
            logger.warning(
                "the routed-experts reader is still reading after %.0f s; "
                "its store reader is left open",
                CLOSE_WAIT_S,
            )

    def _spawn(self) -> threading.Thread:
        thread = threading.Thread(
            target=self._run, name="artifact-route-reader", daemon=True
        )
        thread.start()
        return thread

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        batch: list[RouteRead] = []
        try:
            while True:
                with self._cv:
                    while not self._queued and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        return
                    batch = self._take_batch()
                self._results.post(self._read(batch))
                batch = []
                # Let a waiting engine thread have the interpreter before the
                # next batch.
                time.sleep(0)
        except BaseException as e:
            logger.exception("the routed-experts reader thread died")
            why = f"ArtifactError: the route reader thread died: {e!r}"
            with self._cv:
                lost, self._queued = batch + self._queued, []
            self._results.post(
                [RouteResult(r.req_id, r.attempt, None, why, 0.0) for r in lost]
            )

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
            else:
                cut = rows[: r.end - r.read.first_row]
                results.append(RouteResult(r.req_id, r.attempt, cut, None, share))
        return results
