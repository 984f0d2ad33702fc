# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A circuit breaker for a remote service a thread of the engine calls (the
reference transport, the Mooncake Store's shared tier).

A call that takes longer than its budget, or one still running past it,
marks the service down: callers are told at once, without calling, until
a retry after :data:`BASE_S`, doubling up to :data:`MAX_S` while the
service stays slow; a call within its budget closes it again. Whoever
makes the calls reports them (:meth:`begin`, :meth:`end`)."""

from __future__ import annotations

import threading
import time

#: The first pause after an overrun, and the longest.
BASE_S = 1.0
MAX_S = 8.0


class Breaker:
    """See the module docs. Thread-safe."""

    def __init__(self, service: str, budget_s: float, budget_name: str) -> None:
        self.service = service  # "the reference transport"
        self.budget_s = budget_s
        self._budget = f"{budget_name} {budget_s:g} s"
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._pause_s = BASE_S
        self._reason = ""
        self._busy_since = 0.0  # when the call in flight started; 0.0: none

    def down(self, now: float | None = None) -> str | None:
        """Why calls are skipped now, or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now < self._down_until:
                return self._reason
            busy = self._busy_since
        if busy and now - busy > self.budget_s:
            return (
                f"a call has been in {self.service} for {now - busy:.1f} s "
                f"({self._budget})"
            )
        return None

    def begin(self, now: float) -> None:
        with self._lock:
            self._busy_since = now

    def end(self, start: float, end: float, ok: bool) -> str | None:
        """Report the call that :meth:`begin` started; returns the reason
        when it tripped the breaker."""
        with self._lock:
            self._busy_since = 0.0
            if end - start > self.budget_s:
                return self._trip(f"{self.service} took {end - start:.1f} s")
            if ok:
                self._pause_s = BASE_S
        return None

    def _trip(self, what: str) -> str:
        if time.monotonic() < self._down_until:
            return self._reason  # one trip per pause
        self._reason = (
            f"{what} ({self._budget}); calls are paused for {self._pause_s:g} s"
        )
        self._down_until = time.monotonic() + self._pause_s
        self._pause_s = min(self._pause_s * 2, MAX_S)
        return self._reason
