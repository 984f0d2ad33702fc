# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mooncake calls with a deadline and a circuit breaker.

A Mooncake call to a master that is slow, down or frozen blocks its thread
for as long as the master does (a frozen master: until it resumes; a TCP
transfer: up to Mooncake's own 30 s). No engine thread may wait on that, so
every call of the shared tier runs on one :class:`BoundedCalls` thread:

* :meth:`BoundedCalls.call` waits for its answer at most ``timeout_s`` and
  raises :class:`~.client.MooncakeUnavailableError` past it;
* :meth:`BoundedCalls.post` queues a call nobody waits for (a mirror), at
  most :data:`MAX_POSTED` of them; more are dropped and counted by the
  caller;
* **the breaker**: a call that overran its deadline, or one still running
  past :data:`STUCK_S`, marks the tier down; calls fail at once (posts are
  dropped) until a retry after :data:`BREAKER_BASE_S`, doubling up to
  :data:`BREAKER_MAX_S` while it stays down.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.artifact_connector.mooncake.client import (
    MooncakeUnavailableError,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

MAX_POSTED = 64
STUCK_S = 2.0
BREAKER_BASE_S = 1.0
BREAKER_MAX_S = 8.0


class _Call:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class BoundedCalls:
    """See the module docs. ``name`` goes into the errors (the master)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[_Call, bool]] = collections.deque()
        self._posted = 0
        self._stop = False
        self._busy_since = 0.0
        self._down_until = 0.0
        self._pause_s = BREAKER_BASE_S
        self._thread = threading.Thread(
            target=self._run, name="artifact-mooncake-calls", daemon=True
        )
        self._thread.start()

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """``fn()``'s result, or its exception; MooncakeUnavailableError if
        the tier is down or does not answer within ``timeout_s``."""
        c = _Call(fn)
        with self._cv:
            self._check_up(time.monotonic())
            self._queue.append((c, False))
            self._cv.notify_all()
        if not c.done.wait(timeout_s):
            self._trip(f"no answer within {timeout_s:g} s")
            raise MooncakeUnavailableError(
                f"the Mooncake Store (master {self.name}) did not answer within "
                f"{timeout_s:g} s"
            )
        if c.error is not None:
            raise c.error
        return c.result

    def post(self, fn: Callable[[], Any]) -> bool:
        """Queue ``fn`` without waiting; False (dropped) if the tier is down
        or :data:`MAX_POSTED` calls wait already."""
        with self._cv:
            try:
                self._check_up(time.monotonic())
            except MooncakeUnavailableError:
                return False
            if self._posted >= MAX_POSTED:
                return False
            self._posted += 1
            self._queue.append((_Call(fn), True))
            self._cv.notify_all()
        return True

    def up(self) -> bool:
        with self._cv:
            try:
                self._check_up(time.monotonic())
            except MooncakeUnavailableError:
                return False
            return True

    def close(self, wait_s: float = 5.0) -> bool:
        """Stop the thread; False if a call still runs after ``wait_s`` (the
        caller must not close the client under it)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=wait_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ breaker
    def _check_up(self, now: float) -> None:
        """Under _cv: raise if calls fail at once now."""
        if now < self._down_until:
            raise MooncakeUnavailableError(
                f"the Mooncake Store (master {self.name}) is not answering; "
                f"the next try is in {self._down_until - now:.1f} s"
            )
        if self._busy_since and now - self._busy_since > STUCK_S:
            self._trip_locked(now, f"a call has run {now - self._busy_since:.1f} s")
            raise MooncakeUnavailableError(
                f"the Mooncake Store (master {self.name}) is not answering "
                f"(a call has run {now - self._busy_since:.1f} s)"
            )

    def _trip(self, why: str) -> None:
        with self._cv:
            self._trip_locked(time.monotonic(), why)

    def _trip_locked(self, now: float, why: str) -> None:
        if now < self._down_until:
            return
        self._down_until = now + self._pause_s
        logger.warning(
            "Mooncake Store (master %s): %s; calls fail at once for %g s",
            self.name,
            why,
            self._pause_s,
        )
        self._pause_s = min(self._pause_s * 2, BREAKER_MAX_S)

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    for c, _ in self._queue:
                        c.error = MooncakeUnavailableError("the engine stopped")
                        c.done.set()
                    return
                c, posted = self._queue.popleft()
                if posted:
                    self._posted -= 1
                self._busy_since = start = time.monotonic()
            try:
                c.result = c.fn()
            except BaseException as e:  # handed to the caller, or logged
                c.error = e
                if posted:
                    logger.warning("Mooncake Store call failed: %r", e)
            end = time.monotonic()
            with self._cv:
                self._busy_since = 0.0
                if end - start <= STUCK_S and c.error is None:
                    self._pause_s = BREAKER_BASE_S
            c.done.set()
