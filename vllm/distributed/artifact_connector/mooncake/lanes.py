# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shared tier's transfers (pulls, mirrors), on a client that is
replaced when a transfer stalls in it.

Mooncake 0.3.13.post1 can leave the TCP connection between two processes
dead after an idle gap of about 5 s (Mooncake issue 4209; the fix proposed
in PR 4234 is not in a release yet): the next transfer on it makes no
progress until Mooncake's own 30 s deadline. Here it showed as a ``vllm
serve`` decode engine whose pull from a prefill engine's segment hung, in 2
of 3 runs of 20 prompts 12 s apart (``tests/test_r3_shared_kv.py``). The
call's deadline (``remote.py``) keeps the engine from waiting; a lane keeps
the next transfer off that connection:

A :class:`Lane` is one client of its own (no segment: it moves bytes, the
worker's main client holds memory), its objects' staging buffers and its
call thread. :class:`Lanes` opens :data:`LANES` of them with the writer and
keeps them: when a call is still stuck in the current lane past its
budget, the next call goes to one that is not, whose connections are its
own; a pull that stalled is retried there once, within what is left of its
deadline. The stuck lane is used again once its call returns (Mooncake
drops the dead connection at its 30 s deadline). With every lane stuck (a
frozen master, not a connection) the breaker answers at once.

Clients are opened only with the writer and closed only with it: Mooncake's
``setup`` and ``close`` hold the interpreter lock for their whole duration
(measured here: about 40 ms and 0.9-1.8 s; ``setup`` against a frozen master
until it resumes), which would stall every thread of the engine, while its
transfers and RPCs release it.

When a Mooncake release carries the fix of issue 4209, the lanes can give
way to one client with a deadline, as ``external_hits.py`` uses (existence
queries go to the master, not over a peer's connection)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from vllm.distributed.artifact_connector.breaker import Breaker
from vllm.distributed.artifact_connector.mooncake.objects import MooncakeObjects
from vllm.distributed.artifact_connector.mooncake.remote import (
    RemoteCalls,
    SharedTierUnavailableError,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")


#: Clients a writer transfers over.
LANES = 2


class Lane:
    """One open client, its objects and its thread (see the module docs)."""

    def __init__(
        self, name: str, client: Any, objects: MooncakeObjects, breaker: Breaker
    ) -> None:
        self._client = client
        self.objects = objects
        self.remote = RemoteCalls(name, breaker, on_exit=self._close_client)

    def busy_for(self) -> float:
        return self.remote.breaker.busy_for()

    def up(self) -> bool:
        """Neither in a call nor paused by its breaker."""
        return not self.busy_for() and self.remote.breaker.down() is None

    def stuck(self) -> bool:
        return self.busy_for() > self.remote.breaker.budget_s

    def _close_client(self) -> None:
        """On the lane's thread, when the writer closes."""
        self.objects.close()
        self._client.close()


class Lanes:
    """See the module docs. Thread-safe."""

    def __init__(
        self,
        master: str,
        open_client: Callable[[], Any],
        make_objects: Callable[[Any], MooncakeObjects],
        budget_s: float,
    ) -> None:
        self._master = master
        self._lock = threading.Lock()
        self._lanes: list[Lane] = []
        try:
            for n in range(LANES):
                client = open_client()
                try:
                    objects = make_objects(client)
                except BaseException:
                    client.close()
                    raise
                breaker = Breaker(
                    f"the Mooncake Store (master {master})",
                    budget_s,
                    "shared_pull_timeout_s",
                )
                self._lanes.append(
                    Lane(f"artifact-shared-tier-{n}", client, objects, breaker)
                )
        except BaseException:
            self.close()
            raise
        self._current = 0
        self.switched = 0  # times a stuck lane was left, for the log

    def call(self, fn: Callable[[MooncakeObjects], T], timeout_s: float) -> T:
        """``fn(objects)``'s answer within ``timeout_s``, else
        :class:`SharedTierUnavailableError`. The first lane gets half of
        it (a healthy transfer takes milliseconds); a stall there is
        retried once on another lane with the rest."""
        deadline = time.monotonic() + timeout_s
        lane = self._lane()
        try:
            return lane.remote.call(lambda: fn(lane.objects), timeout_s / 2)
        except SharedTierUnavailableError:
            if not lane.busy_for():
                raise  # paused, or it failed: not a stall in the call
            other = self._leave(lane)
            if other is None:
                raise
        return other.remote.call(
            lambda: fn(other.objects), max(0.0, deadline - time.monotonic())
        )

    def post(self, fn: Callable[[MooncakeObjects], Any]) -> bool:
        """Queue ``fn(objects)``; False when it is skipped."""
        lane = self._lane()
        return lane.remote.post(lambda: fn(lane.objects))

    def _lane(self) -> Lane:
        """The current lane, or another one when it is stuck past its
        budget (else its breaker answers)."""
        lane = self._lanes[self._current]
        if lane.stuck():
            return self._leave(lane) or lane
        return lane

    def _leave(self, lane: Lane) -> Lane | None:
        """Make another lane that is up current; None when none is."""
        with self._lock:
            current = self._lanes[self._current]
            if current is not lane and current.up():
                return current  # another caller moved on already
            for n, other in enumerate(self._lanes):
                if other is not lane and other.up():
                    self._current = n
                    self.switched += 1
                    break
            else:
                return None
        logger.warning(
            "artifact store, shared tier (master %s): a transfer made no "
            "progress for %.1f s (Mooncake issue 4209 on 0.3.13.post1); "
            "transfers go over another client (%d switches so far)",
            self._master,
            lane.busy_for(),
            self.switched,
        )
        return other

    def close(self) -> None:
        for lane in self._lanes:
            lane.remote.close()
