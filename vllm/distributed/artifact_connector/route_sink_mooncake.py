# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where an engine puts the routes it hands out by reference when
``ref_transport`` is ``mooncake``: one object per reference in a Mooncake
Store, in this engine's own segment, readable by any number of trainer
ranks on any host that reaches the master (with range reads:
``vllm_host_transport/mooncake_refs.py``) until it is removed: by the
driver, by the last of N readers (``mark_read``), or by this engine (its
TTL, byte bound, retirement with a weight version, its stop).

Used by :class:`~vllm.distributed.artifact_connector.route_refs.RouteRefs`
on the hand-off thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm_host_transport.mooncake_probe import describe_error

if TYPE_CHECKING:
    from vllm.config.artifact import ArtifactConfig

#: Keys asked about per ``batch_is_exist`` in :meth:`MooncakeRefSink.gone`
#: (measured: 0.3 ms per 1,000 keys on loopback TCP).
_EXIST_BATCH = 4096
_OBJECT_NOT_FOUND = -704


def _publish_error(message: str) -> Exception:
    # Imported late: route_refs imports this module.
    from vllm.distributed.artifact_connector.route_refs import RouteRefPublishError

    return RouteRefPublishError(message)


class MooncakeRefSink:
    """A Mooncake Store, reached through its master."""

    transport = "mooncake"

    def __init__(self, cfg: ArtifactConfig) -> None:
        from vllm.distributed.artifact_connector.mooncake import client

        self.location = str(cfg.mooncake_master)
        try:
            self._store: Any = client.acquire(cfg)
        except client.MooncakeUnavailableError as e:
            raise _publish_error(str(e)) from e
        # In this engine's own segment: a reference lives as long as the
        # engine that handed it out, not as long as whichever engine's
        # segment Mooncake would pick (on another node, maybe).
        self._placement = client.own_segment(self._store)

    def put(self, key: str, parts: Sequence[Any], nbytes: int) -> bool:
        """Put the concatenation of ``parts`` (buffers: the header, the
        body) under ``key``, without joining them first (``put_parts``
        copies each into the object). Returns ``False``: never in
        ``/dev/shm``."""
        if sum(memoryview(p).nbytes for p in parts) != nbytes:
            raise ValueError(f"the parts of routes {key} are not {nbytes} bytes")
        if not nbytes:
            # Mooncake refuses empty objects (-600).
            return False
        rc = self._store.put_parts(key, *parts, config=self._placement)
        if rc != 0:
            raise _publish_error(
                f"the Mooncake Store (master {self.location}) refused a "
                f"{nbytes}-byte payload: {describe_error(rc)}"
            )
        return False

    def retire(self, key: str) -> bool:
        """Remove ``key`` now; ``False`` when it was gone already (a reader
        or the driver removed it). Forced: a read leaves a lease on the
        object (10 s by default) that refuses a plain remove."""
        return self._store.remove(key, True) == 0

    def gone(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` that are no longer in the store (removed by
        the driver or the last reader, or evicted): one ``batch_is_exist``
        per 4,096 keys, a few ms for the 65,536 references that may wait.
        A key the master cannot answer for counts as still there."""
        out: list[str] = []
        for i in range(0, len(keys), _EXIST_BATCH):
            batch = list(keys[i : i + _EXIST_BATCH])
            there = self._store.batch_is_exist(batch)
            if len(there) != len(batch):
                continue
            out.extend(k for k, rc in zip(batch, there) if rc == 0)
        return out

    def upkeep(self) -> None:
        pass

    def close(self) -> None:
        from vllm.distributed.artifact_connector.mooncake import client

        client.release(self._store)
