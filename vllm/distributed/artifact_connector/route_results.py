# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the route reader's and the hand-off's threads leave finished work
for the engine thread: one :class:`RouteResult` per read or hand-off, posted
as soon as it is done (:class:`RouteResults`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm_host_transport.routed_experts import RoutedExpertsRef


@dataclass(frozen=True, slots=True)
class RouteResult:
    req_id: str
    attempt: int
    rows: np.ndarray | None
    error: str | None
    seconds: float  # reader time (a read's share of its batch) or hand-off time
    ref: RoutedExpertsRef | None = None
    # A hand-off's result (else a read's).
    handed_off: bool = False


class RouteResults:
    """Posted by worker threads, taken by the engine thread. Pending results
    are counted per request: a request that stops waiting for its result
    (its deadline passed) is :meth:`abandon`-ed, so that its late result no
    longer counts as awaited."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._done: list[RouteResult] = []
        self._pending = 0  # submitted, awaited, not yet taken back
        # Results submitted, then abandoned before they were taken:
        # (req_id, attempt, handed_off).
        self._abandoned: set[tuple[str, int, bool]] = set()

    def add_pending(self, n: int) -> None:
        with self._cv:
            self._pending += n

    def abandon(self, req_id: str, attempt: int, handed_off: bool) -> None:
        """Nobody waits for this pending read's (or hand-off's) result any
        more: it leaves the pending count now; when it comes, :meth:`take`
        returns it like any other."""
        with self._cv:
            self._abandoned.add((req_id, attempt, handed_off))
            self._pending -= 1
            self._cv.notify_all()

    def post(self, results: list[RouteResult]) -> None:
        if results:
            with self._cv:
                self._done.extend(results)
                self._cv.notify_all()

    def take(self) -> list[RouteResult]:
        """What finished since the last call (without waiting)."""
        if not self._done:  # a racy peek; the next step takes what it missed
            return []
        with self._cv:
            done, self._done = self._done, []
            self._pending -= len(done) - self._num_abandoned(done, discard=True)
        return done

    def _num_abandoned(self, done: list[RouteResult], *, discard: bool) -> int:
        if not self._abandoned:
            return 0
        n = 0
        for r in done:
            key = (r.req_id, r.attempt, r.handed_off)
            if key in self._abandoned:
                n += 1
                if discard:
                    self._abandoned.discard(key)
        return n

    def wait_all(self, timeout: float) -> None:
        """Wait up to ``timeout`` until every pending result is done (for a
        step that has nothing else to do: its outputs then leave with this
        step instead of a later one, and it does not spin while holding the
        interpreter the worker threads need)."""
        with self._cv:
            self._cv.wait_for(
                lambda: (
                    len(self._done) - self._num_abandoned(self._done, discard=False)
                    >= self._pending
                ),
                timeout,
            )

    @property
    def pending(self) -> int:
        """Results awaited (submitted for requests that still wait for
        them), not yet taken back."""
        return self._pending
