# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How much of a hit on KV another engine computed to take (``backend:
mooncake``, scheduler side).

KV another engine computed (a shared KV pool, a prefill engine) is only
worth loading if its routes can be returned: otherwise the request would
fail, and so would every later one on that prefix, since the pool keeps
offering the same KV. So the scheduler takes such a hit only as far as the
blocks' routes are already in this engine's own store, and the engine
recomputes the rest, which gives their routes; KV stays authoritative (a
cut only recomputes KV the engine could have loaded).

When the offered blocks' objects are not all local, the request waits
(the scheduler skips it for now) while the publishing worker pulls the
missing ones from the shared tier into the local store
(:class:`~vllm.distributed.artifact_connector.protocol.PullRoutes`, on the
tier's own thread). When the worker says the pull ended, or
``shared_pull_timeout_s`` after the request first asked, the hit is cut to
the leading blocks whose objects are local. Once scheduled, a request
never needs the shared tier again: a slow, dead or frozen Mooncake
connection costs a waiting request that bound and the recomputation of its
hit, never an answer. The engine thread makes no remote call here; it
reads the local store's index."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.artifact_connector.protocol import PullRoutes
from vllm.distributed.artifact_connector.request_core import KeySpace
from vllm.distributed.artifact_connector.shm import ShmStoreReader
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _Waiting:
    """A request waiting for a pull."""

    until: float  # when it stops waiting (time.monotonic())
    ended: bool = False  # the worker said the pull ended


class ExternalHits:
    """See the module docs. Used by the engine thread only."""

    def __init__(self, vllm_config: VllmConfig, block_size: int) -> None:
        cfg = vllm_config.artifact_config
        rank = vllm_config.parallel_config.data_parallel_rank
        self.block_size = block_size
        self.weight_version = "default"
        self._keys = KeySpace(cfg.key_namespace(rank))
        self._store = ShmStoreReader(cfg.shm_root, cfg.namespace(rank))
        self._wait_s = cfg.shared_pull_timeout_s
        self._waiting: dict[str, _Waiting] = {}
        # Pulls for the next step's meta.
        self.pulls: list[PullRoutes] = []
        self._last_warning = 0.0

    def routed_tokens(
        self, request: Request, num_local: int, num_external: int
    ) -> int | None:
        """The part of ``num_external`` tokens after ``num_local`` (a block
        boundary) whose routes are in the local store (whole blocks, from
        the first on), or None while a pull of the missing ones runs."""
        bs = self.block_size
        if num_local % bs:
            return num_external
        first, n = num_local // bs, num_external // bs
        hashes = request.block_hashes[first : first + n]
        n = min(n, len(hashes))
        keys = [self._keys.key(self.weight_version, h, bs, tail=False) for h in hashes]
        try:
            local = self._store.num_present(keys)
        except ArtifactError as e:
            self._warn(f"the local store could not be read ({e})")
            self._waiting.pop(request.request_id, None)
            return 0
        req_id = request.request_id
        waiting = self._waiting.get(req_id)
        if local < n:
            now = time.monotonic()
            if waiting is None:
                self._waiting[req_id] = _Waiting(now + self._wait_s)
                self.pulls.append(PullRoutes(req_id, tuple(keys[local:])))
                return None
            if not waiting.ended and now < waiting.until:
                return None
            if not waiting.ended:
                self._warn(
                    f"the routes of KV another engine computed were not pulled "
                    f"within shared_pull_timeout_s ({self._wait_s:g} s)"
                )
        self._waiting.pop(req_id, None)
        if local == n and n * bs == num_external:
            return num_external
        return local * bs

    def pulled(self, req_ids: tuple[str, ...]) -> None:
        """The worker's pulls for ``req_ids`` ended."""
        for req_id in req_ids:
            waiting = self._waiting.get(req_id)
            if waiting is not None:
                waiting.ended = True

    def forget(self, req_id: str) -> None:
        """The request left the scheduler."""
        self._waiting.pop(req_id, None)

    def take_pulls(self) -> list[PullRoutes]:
        pulls, self.pulls = self.pulls, []
        return pulls

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            logger.warning(
                "routed experts: %s; that KV is recomputed instead of loaded",
                msg,
            )

    def close(self) -> None:
        self._store.close()
