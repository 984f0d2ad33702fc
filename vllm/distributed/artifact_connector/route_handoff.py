# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Handing read routes out by reference, on a thread of its own.

The route reader reads rows from the local store (microseconds per object);
a hand-off puts them into a transport that may be slow, down or frozen (a
Mooncake master, another node's segment). The two never share a thread, so
an inline read never waits behind a hand-off (:class:`RouteHandoff`).

Every hand-off has a deadline (``ref_handoff_timeout_s``). The scheduler
fails a request whose hand-off missed it with ``RouteRefPublishError``
whatever the thread is doing; this thread only makes that cheap:

* a job whose deadline has passed when its turn comes is failed, not
  started;
* a put that ends past its deadline is retired at once (nobody will get
  its reference);
* **a circuit breaker** (``breaker.py``): a put that overran its
  deadline, or one still running past it, marks the transport down; jobs
  fail at once (the engine thread sees it in :meth:`RouteHandoff.submit`)
  until a retry after a pause that doubles while the transport stays
  slow.

Any exception of the sink fails that one reference; the thread lives on.
Any exception while opening the transport fails every reference (with
``RouteRefPublishError`` naming it); the thread lives on too.
Expiry of unfetched payloads (``ref_ttl_s``) runs every
:data:`EXPIRY_INTERVAL_S` under load as when idle.

The transport is opened once, on this thread: at start with ``open_now``
(a Mooncake Store), else with the first reference. A transport that cannot
be opened fails every reference, and is not tried again while the engine
serves: Mooncake's client ``setup`` holds the interpreter lock until it
returns, which would stall the whole engine core; it runs only after the
master answered a probe in a child process (``mooncake/client.py``), so a
master that is down or frozen at start costs this thread at most the
probe's 5 s and the engine core nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm.distributed.artifact_connector.breaker import Breaker
from vllm.distributed.artifact_connector.route_refs import RouteRefPublishError
from vllm.distributed.artifact_connector.route_results import (
    RouteResult,
    RouteResults,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.distributed.artifact_connector.route_refs import RouteRefs
    from vllm_host_transport.routed_experts import RoutedExpertsRef

logger = init_logger(__name__)

#: How often payloads past their TTL are removed.
EXPIRY_INTERVAL_S = 1.0
#: How long :meth:`RouteHandoff.close` waits for a put in flight.
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class Handoff:
    """Rows ``[first_row, ...)`` of a finished attempt, read, to hand out."""

    req_id: str
    attempt: int
    rows: np.ndarray
    first_row: int
    deadline: float  # time.monotonic()
    weight_version: str = ""  # the rows' versions, ","-joined in row order


class RouteHandoff:
    """See the module docs. :meth:`submit`, :meth:`retire`, :meth:`counters`
    and :meth:`close` are called by the engine thread."""

    def __init__(
        self,
        results: RouteResults,
        make_refs: Callable[[], RouteRefs] | None,
        timeout_s: float,
        *,
        open_now: bool = False,
    ) -> None:
        self._results = results
        self._make_refs = make_refs
        self.timeout_s = timeout_s
        self._refs: RouteRefs | None = None  # made on this thread, once
        self._refs_error: str | None = None  # why it could not be made
        self._cv = threading.Condition()
        self._queued: list[Handoff] = []
        self._to_retire: list[str] = []
        self._versions_kept: tuple[str, ...] | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._breaker = Breaker(
            "the reference transport", timeout_s, "ref_handoff_timeout_s"
        )
        self._open_now = open_now
        if open_now:
            self._start()

    # ------------------------------------------------------------ engine side
    def submit(self, jobs: list[Handoff]) -> None:
        if not jobs:
            return
        self._results.add_pending(len(jobs))
        with self._cv:
            down = self._breaker.down()
            if down is not None:
                self._results.post([self._failed(j, down) for j in jobs])
                return
            if self._thread is None or not self._thread.is_alive():
                self._start()
            self._queued.extend(jobs)
            self._cv.notify_all()

    def retire(self, key: str) -> None:
        """Remove a handed-out payload whose request no longer wants it (its
        result came after the engine gave up on it)."""
        with self._cv:
            self._to_retire.append(key)
            self._cv.notify_all()

    def retire_versions(self, kept: tuple[str, ...]) -> None:
        """Remove every payload whose weight version is not in ``kept``."""
        with self._cv:
            self._versions_kept = kept
            self._cv.notify_all()

    def counters(self) -> dict[str, int] | None:
        refs = self._refs
        return None if refs is None else refs.counters()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            thread = self._thread
        if thread is None:
            return
        thread.join(timeout=CLOSE_WAIT_S)
        if thread.is_alive():
            # Its sink is closed by the thread itself when the call returns;
            # closing it under the call would free what the call uses.
            logger.warning(
                "a routed-experts hand-off is still in its transport after "
                "%.0f s; it is left to finish and close the transport",
                CLOSE_WAIT_S,
            )

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="artifact-route-handoff", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _failed(job: Handoff, why: str) -> RouteResult:
        return _result(job, None, f"RouteRefPublishError: {why}", 0.0)

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        next_expiry = time.monotonic() + EXPIRY_INTERVAL_S
        try:
            if self._open_now:
                try:
                    self._route_refs()
                except RouteRefPublishError as e:
                    logger.error("routed-experts references are unavailable: %s", e)
            while True:
                with self._cv:
                    if not (
                        self._queued
                        or self._to_retire
                        or self._versions_kept is not None
                        or self._stop
                    ):
                        self._cv.wait(max(0.0, next_expiry - time.monotonic()))
                    if self._stop:
                        return
                    job = self._queued.pop(0) if self._queued else None
                    retire, self._to_retire = self._to_retire, []
                    kept, self._versions_kept = self._versions_kept, None
                for key in retire:
                    self._upkeep("retire", key)
                if kept is not None:
                    self._upkeep("versions", kept=kept)
                if job is not None:
                    self._results.post([self._hand_off(job)])
                if time.monotonic() >= next_expiry:
                    self._upkeep("expire")
                    next_expiry = time.monotonic() + EXPIRY_INTERVAL_S
        finally:
            with self._cv:
                left, self._queued = self._queued, []
            self._results.post([self._failed(j, "the engine stopped") for j in left])
            self._upkeep("close")

    def _upkeep(self, what: str, key: str = "", kept: tuple[str, ...] = ()) -> None:
        """Retire one payload or a weight version's, expire, or close; a
        fault is logged, never raised (this thread serves every later
        reference)."""
        refs = self._refs
        if refs is None:
            return
        try:
            if what == "retire":
                refs.retire(key)
            elif what == "versions":
                refs.retire_versions(kept)
            elif what == "expire":
                refs.expire()
            else:
                refs.close()
        except Exception:
            logger.exception("routed-experts references: %s failed", what)

    def _hand_off(self, job: Handoff) -> RouteResult:
        start = time.monotonic()
        if start > job.deadline:
            return self._failed(job, "its deadline passed before its turn")
        down = self._breaker.down(start)
        if down is not None:
            return self._failed(job, down)
        self._breaker.begin(start)
        ref = error = None
        try:
            ref = self._route_refs().publish(
                job.rows, job.first_row, job.weight_version
            )
        except RouteRefPublishError as e:
            error = f"RouteRefPublishError: {e}"
        except Exception as e:  # a sink fault: this reference fails, not us
            logger.exception("handing routes out by reference failed")
            error = f"RouteRefPublishError: the reference transport failed: {e!r}"
        end = time.monotonic()
        tripped = self._breaker.end(start, end, ok=error is None)
        if tripped is not None:
            logger.warning("routed-experts references: %s", tripped)
        if ref is not None and end > job.deadline:
            self._upkeep("retire", ref.key)
            ref, error = None, "RouteRefPublishError: handed out past its deadline"
        return _result(job, ref, error, end - start)

    def _route_refs(self) -> RouteRefs:
        if self._refs is None:
            if self._make_refs is None:
                raise RouteRefPublishError(
                    "this engine hands out no routed-experts references"
                )
            if self._refs_error is not None:
                raise RouteRefPublishError(self._refs_error)
            try:
                self._refs = self._make_refs()
            except Exception as e:  # whatever it is, every reference fails
                if not isinstance(e, RouteRefPublishError):
                    logger.exception("opening the reference transport failed")
                why = e if isinstance(e, RouteRefPublishError) else repr(e)
                self._refs_error = (
                    f"{why} (the reference transport is opened once: restart "
                    "the engine once it can be reached)"
                )
                raise RouteRefPublishError(self._refs_error) from e
        return self._refs


def _result(
    job: Handoff, ref: RoutedExpertsRef | None, error: str | None, seconds: float
) -> RouteResult:
    return RouteResult(job.req_id, job.attempt, None, error, seconds, ref, True)
