# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which of the blocks a KV connector offers to load have routes
(``backend: mooncake``, scheduler side).

KV another engine computed is only worth loading if its routes can be
returned: otherwise the request would fail, and so would every later one on
that prefix, since the KV pool keeps offering the same KV. Before the
scheduler takes a connector's external hit, it asks here how many of the
hit's leading blocks have an object in the shared tier that can be read
now (one batched existence query, then a read of a few of them, see
``_readable``); the hit is cut to those, and the engine recomputes the
rest, which gives their routes. KV stays authoritative: a cut only
recomputes KV the engine could have loaded.

The query runs on a thread of its own (``remote.py``) and the engine thread
waits for it at most ``shared_check_timeout_s`` (50 ms): without an answer
the whole hit is recomputed, and while the tier stays that slow it is not
asked at all (a breaker), so a frozen master costs the step loop one wait,
not one per request.

An object found here can still vanish before the worker pulls it (Mooncake
evicting in between): that request fails with ``ObjectMissingError``, and
the next one is cut here."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm.distributed.artifact_connector.breaker import Breaker
from vllm.distributed.artifact_connector.mooncake import client as mc
from vllm.distributed.artifact_connector.mooncake.key_space import max_object_nbytes
from vllm.distributed.artifact_connector.mooncake.objects import MooncakeObjects
from vllm.distributed.artifact_connector.mooncake.remote import RemoteCalls
from vllm.distributed.artifact_connector.request_core import KeySpace
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


#: Objects of a hit read back before it is taken (see ``_readable``).
PROBES = 8


class ExternalHits:
    """See the module docs. Used by the engine thread only."""

    def __init__(self, vllm_config: VllmConfig, block_size: int) -> None:
        cfg = vllm_config.artifact_config
        rank = vllm_config.parallel_config.data_parallel_rank
        self.block_size = block_size
        self.weight_version = "default"
        self._keys = KeySpace(cfg.key_namespace(rank))
        # Joins without contributing memory: the worker's client holds it.
        self._client = mc.acquire(cfg, segment_bytes=0)
        self._shared = MooncakeObjects(
            self._client,
            str(cfg.mooncake_master),
            max_object_nbytes=max_object_nbytes(vllm_config),
            staging_bytes=0,
        )
        self._timeout_s = cfg.shared_check_timeout_s
        self._remote = RemoteCalls(
            "artifact-external-hits",
            Breaker(
                f"the Mooncake Store (master {cfg.mooncake_master})",
                self._timeout_s,
                "shared_check_timeout_s",
            ),
            on_exit=self._close_client,
        )
        self._last_warning = 0.0

    def routed_tokens(self, request: Request, num_local: int, num_external: int) -> int:
        """The part of ``num_external`` tokens after ``num_local`` (a block
        boundary) whose routes the shared tier has: whole blocks, from the
        first on."""
        bs = self.block_size
        if num_local % bs:
            return num_external
        first, n = num_local // bs, num_external // bs
        hashes = request.block_hashes[first : first + n]
        if len(hashes) < n:
            n = len(hashes)
        keys = [self._keys.key(self.weight_version, h, bs, tail=False) for h in hashes]
        try:
            routed = self._remote.call(lambda: self._readable(keys), self._timeout_s)
        except ArtifactError as e:
            routed = 0
            self._warn(f"the shared tier did not answer ({e})")
        if routed == n and n * bs == num_external:
            return num_external
        return routed * bs

    def _readable(self, keys: list[str]) -> int:
        """How many leading ``keys`` have an object that can be read now
        (on the client's thread): the existence query, then a read of up to
        :data:`PROBES` of them spread over the run (first and last
        included), which must all arrive verified. A connection Mooncake
        left dead after an idle gap (its issue 4209) then costs this
        check its deadline and the hit a recomputation, not the request
        the worker's pull over that connection would fail."""
        found = self._shared.exists(keys)
        routed = next((i for i, f in enumerate(found) if not f), len(found))
        if routed:
            picks = sorted({round(i * (routed - 1) / max(1, PROBES - 1))
                            for i in range(min(routed, PROBES))})  # fmt: skip
            got, _ = self._shared.fetch([keys[i] for i in picks])
            if len(got) < len(picks):  # gone in between: cut at the first
                have = {r.key for r in got}
                routed = next(i for i in picks if keys[i] not in have)
        return routed

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            logger.warning(
                "routed experts: %s; KV other engines computed is recomputed "
                "instead of loaded until it does",
                msg,
            )

    def close(self) -> None:
        """A check still in the client closes it when it returns."""
        self._remote.close()

    def _close_client(self) -> None:
        """On the client's thread, when it stops."""
        self._shared.close()
        mc.release(self._client)
