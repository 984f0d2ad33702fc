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
    """Posted by worker threads, taken by the engine thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._done: list[RouteResult] = []
        self._pending = 0  # submitted, not yet taken back

    def add_pending(self, n: int) -> None:
        with self._cv:
            self._pending += n

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
            self._pending -= len(done)
        return done

    def wait_all(self, timeout: float) -> None:
        """Wait up to ``timeout`` until every pending result is done (for a
        step that has nothing else to do: its outputs then leave with this
        step instead of a later one, and it does not spin while holding the
        interpreter the worker threads need)."""
        with self._cv:
            self._cv.wait_for(lambda: len(self._done) >= self._pending, timeout)

    @property
    def pending(self) -> int:
        return self._pending
