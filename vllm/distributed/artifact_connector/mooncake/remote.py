# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Calls to a Mooncake Store that never hold their caller.

A Mooncake call to a master that is slow, down or frozen blocks for up to
Mooncake's own RPC timeout (about 30 s); the publication thread (mirrors,
pulls, the key space's terms) cannot wait that long. :class:`RemoteCalls`
makes a client's calls on one thread of its own:

* :meth:`RemoteCalls.post` queues a call nobody waits for (a mirror; a pull,
  which reports its own end), up to :data:`MAX_POSTED`; past that, or while
  the tier is down, it is skipped and the caller says so;
* a :class:`~vllm.distributed.artifact_connector.breaker.Breaker` marks the
  tier down when a call overruns its budget, or is still running past it:
  posts are then skipped at once until a retry.

One thread per client keeps the client's staging buffers single-threaded,
and the thread closes the client when it stops (``on_exit``): after a call
stuck in it returns, never under it."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.artifact_connector.breaker import Breaker
from vllm.logger import init_logger

logger = init_logger(__name__)

#: Calls nobody waits for that may be queued; more are skipped.
MAX_POSTED = 16
#: How long :meth:`RemoteCalls.close` waits for a call in flight.
CLOSE_WAIT_S = 5.0


class RemoteCalls:
    """See the module docs."""

    def __init__(
        self, name: str, breaker: Breaker, on_exit: Callable[[], None] | None = None
    ) -> None:
        self.name = name
        self.breaker = breaker
        self._on_exit = on_exit
        self._cv = threading.Condition()
        self._posted: collections.deque[Callable[[], Any]] = collections.deque()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[[], Any]) -> bool:
        """Queue ``fn()``; False when it is skipped (the tier down, or
        :data:`MAX_POSTED` queued)."""
        if self.breaker.down() is not None:
            return False
        with self._cv:
            if self._stop or len(self._posted) >= MAX_POSTED:
                return False
            self._posted.append(fn)
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
                while not (self._posted or self._stop):
                    self._cv.wait()
                if self._stop:
                    return
                fn = self._posted.popleft()
            start = time.monotonic()
            self.breaker.begin(start)
            ok = True
            try:
                fn()
            except Exception as e:  # nobody waits for it to raise
                ok = False
                logger.warning("%s: a call failed: %s", self.name, e)
            tripped = self.breaker.end(start, time.monotonic(), ok=ok)
            if tripped is not None:
                logger.warning("%s: %s", self.name, tripped)
