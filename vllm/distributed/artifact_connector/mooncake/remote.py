# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Calls to a Mooncake Store that never hold their caller past a deadline.

A Mooncake call to a master that is slow, down or frozen blocks for up to
Mooncake's own RPC timeout (about 30 s); the engine thread (the external-
hit check) and the publication thread (mirror, pulls, the key space's
terms) cannot wait that long. :class:`RemoteCalls` makes a client's calls
on one thread of its own:

* :meth:`RemoteCalls.call` waits for the answer up to its deadline and
  raises :class:`SharedTierUnavailableError` past it (the call, if it
  started, is left to finish and its answer dropped);
* :meth:`RemoteCalls.post` queues a call nobody waits for (a mirror), up
  to :data:`MAX_POSTED`; past that, or while the tier is down, it is
  skipped and the caller counts it;
* a :class:`~vllm.distributed.artifact_connector.breaker.Breaker` marks the
  tier down when a call overruns: calls then fail, and posts are skipped,
  at once until a retry.

Calls waited for run before posted ones. One thread per client keeps the
client's staging buffers single-threaded, and the thread closes the client
when it stops (``on_exit``): after a call stuck in it returns, never under
it."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from vllm.distributed.artifact_connector.breaker import Breaker
from vllm.distributed.artifact_connector.store import StoreIOError
from vllm.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

#: Calls nobody waits for that may be queued; more are skipped.
MAX_POSTED = 16
#: How long :meth:`RemoteCalls.close` waits for a call in flight.
CLOSE_WAIT_S = 5.0


class SharedTierUnavailableError(StoreIOError):
    """The shared tier did not answer in time, or is paused after it did
    not: it is treated as absent."""


class _Call(Generic[T]):
    __slots__ = ("fn", "done", "result", "error", "abandoned")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.abandoned = False


class RemoteCalls:
    """See the module docs."""

    def __init__(
        self, name: str, breaker: Breaker, on_exit: Callable[[], None] | None = None
    ) -> None:
        self.name = name
        self.breaker = breaker
        self._on_exit = on_exit
        self._cv = threading.Condition()
        self._waited: collections.deque[_Call[Any]] = collections.deque()
        self._posted: collections.deque[_Call[Any]] = collections.deque()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()``'s answer, or :class:`SharedTierUnavailableError` when it
        has none within ``timeout_s`` (``fn``'s own exceptions propagate)."""
        down = self.breaker.down()
        if down is not None:
            raise SharedTierUnavailableError(down)
        c: _Call[T] = _Call(fn)
        with self._cv:
            if self._stop:
                raise SharedTierUnavailableError("the engine is stopping")
            self._waited.append(c)
            self._cv.notify_all()
        if not c.done.wait(timeout_s):
            with self._cv:
                c.abandoned = True
            raise SharedTierUnavailableError(
                self.breaker.trip(f"{self.breaker.service} gave no answer in "
                                  f"{timeout_s * 1e3:.0f} ms")
            )  # fmt: skip
        if c.error is not None:
            raise c.error
        return c.result  # type: ignore[return-value]

    def post(self, fn: Callable[[], Any]) -> bool:
        """Queue ``fn()``; False when it is skipped (the tier down, or
        :data:`MAX_POSTED` queued)."""
        if self.breaker.down() is not None:
            return False
        with self._cv:
            if self._stop or len(self._posted) >= MAX_POSTED:
                return False
            c: _Call[Any] = _Call(fn)
            c.abandoned = True  # nobody waits for it
            self._posted.append(c)
            self._cv.notify_all()
        return True

    def close(self) -> None:
        """Stop the thread (queued calls are dropped) and wait up to
        :data:`CLOSE_WAIT_S` for it; a thread still in a call closes its
        client itself when the call returns."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=CLOSE_WAIT_S)
        if self._thread.is_alive():
            logger.warning(
                "%s: a call is still in the Mooncake client after %.0f s; the "
                "client closes when it returns",
                self.name,
                CLOSE_WAIT_S,
            )

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except Exception:
                    logger.exception("%s: closing the client failed", self.name)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._waited or self._posted or self._stop):
                    self._cv.wait()
                if self._stop:
                    return
                if self._waited:
                    c = self._waited.popleft()
                    if c.abandoned:  # its caller has given up
                        continue
                else:
                    c = self._posted.popleft()
            start = time.monotonic()
            self.breaker.begin(start)
            try:
                c.result = c.fn()
            except BaseException as e:  # the caller's to raise or log
                c.error = e
            end = time.monotonic()
            tripped = self.breaker.end(start, end, ok=c.error is None)
            if tripped is not None:
                logger.warning("%s: %s", self.name, tripped)
            c.done.set()
            if c.error is not None and c.abandoned:  # nobody raises it
                logger.warning("%s: a call failed: %s", self.name, c.error)
