# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The artifact store of ``backend: mooncake``: this engine's ``/dev/shm``
store, with a Mooncake Store shared by the key space's engines behind it.

* **put**: objects go into the local store (which decides what is new) and
  what is new there is mirrored into the shared tier, in one batched call
  that the publication thread posts and does not wait for. A key the tier
  already holds keeps its first object (``objects.py``: the routes follow
  the KV that a pool keeps, its first writer's). A failed or
  skipped mirror costs other engines their hits on these objects (their
  schedulers find no object and recompute), never this engine's own
  answers: it is counted and logged, not raised.
* **pull**: before the scheduler takes a hit on KV another engine computed
  (a shared KV pool, a prefill engine), it has the blocks' objects this
  store lacks copied here from the shared tier, verified (an object that
  fails is removed from the tier and left out); the hit is then
  cut to the blocks whose objects are local (``external_hits.py``), so a
  request never depends on the shared tier after it is scheduled.
* **retain**, **lookup**: the local store's.

Every call to the shared tier runs on the thread of this engine's client
(``remote.py``), posted: nothing waits for a mirror, a pull or the key
space's terms, and a tier whose call overran ``shared_pull_timeout_s`` is
not called (pulls end at once, mirrors are skipped) until a retry after a
pause. A slow, down or frozen master never holds the publication thread, so
it never holds the step loop. The client is opened with the writer and closed with
it, by that thread once its last call returned: Mooncake's ``setup`` and
``close`` hold the interpreter lock while they run (see the design doc).

The scheduler's route reader reads the local store only: by the time a
request's acknowledgement names an object, it is local.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.config.artifact_transfer import shared_secret
from vllm.distributed.artifact_connector.breaker import Breaker
from vllm.distributed.artifact_connector.mooncake import client as mc
from vllm.distributed.artifact_connector.mooncake.key_space import (
    KeySpaceMismatchError,
    KeySpaceTerms,
    agree,
    max_object_nbytes,
)
from vllm.distributed.artifact_connector.mooncake.objects import MooncakeObjects
from vllm.distributed.artifact_connector.mooncake.remote import RemoteCalls
from vllm.distributed.artifact_connector.store import (
    ArtifactError,
    FillFn,
    ObjectRef,
    ObjectStoreWriter,
    PutResult,
    PutStatus,
    StoreStats,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.artifact import ArtifactConfig

logger = init_logger(__name__)

# How often the idle upkeep records the key space's terms again (a restarted
# master forgets them, and would then take an engine that disagrees).
TERMS_INTERVAL_S = 5.0
# After the shared tier refused or failed writes (full, its master restarting
# or down), how long mirrors are skipped.
MIRROR_BACKOFF_S = 5.0
# KV roles whose finished requests send other engines to their objects (a
# prefill engine's answer sends the decode engine; a shared pool's next
# reader may come at once): only their acknowledgements wait for mirrors.
SETTLING_KV_ROLES = ("kv_producer", "kv_both")


class SharedTierWriter(ObjectStoreWriter):
    """See the module docs."""

    def __init__(
        self,
        local: ObjectStoreWriter,
        cfg: ArtifactConfig,
        *,
        max_object_nbytes: int,
        client: Any,
        rejoin: Any = None,
        settles: bool = True,
    ) -> None:
        self._local = local
        # Whether acknowledgements wait for their objects' mirrors (see
        # mirroring()); not for an engine no other engine is sent to.
        self._settles = settles
        self._client = client  # this engine's; released by its thread
        self._master = master = str(cfg.mooncake_master)
        # The client's calls run on its own thread, which closes it.
        self._shared = MooncakeObjects(
            client,
            master,
            secret=shared_secret(cfg),
            max_object_nbytes=max_object_nbytes,
        )
        self._remote = RemoteCalls(
            "artifact-shared-tier",
            Breaker(
                f"the Mooncake Store (master {master})",
                cfg.shared_pull_timeout_s,
                "shared_pull_timeout_s",
            ),
            on_exit=self._close_client,
        )
        self._rejoin = rejoin  # () -> None: records the key space's terms
        # The terms recorded in the store (after a master restart, by another
        # engine first) are not this engine's. Set and cleared by the client's
        # thread; while set, pulls end at once (the hits are recomputed) and
        # mirrors are skipped (shared_failures).
        self._sharing_stopped = False
        self._lock = threading.Lock()
        self._counts = {
            "shared_puts": 0,
            "shared_pulls": 0,
            "shared_failures": 0,
            "shared_rejected": 0,
        }
        self._rejected_logged = False
        self._next_terms = time.monotonic() + TERMS_INTERVAL_S
        self._last_warning = 0.0
        self._mirror_after = 0.0
        # Key -> the event its mirror sets when it ends (guarded by _lock;
        # only while the mirror is posted and not ended).
        self._in_flight: dict[str, threading.Event] = {}
        # (tag, objects, bytes) the client's thread fetched for pull().
        self._fetched: list[tuple[str, list[ObjectRef], Any]] = []

    @classmethod
    def open(
        cls, local: ObjectStoreWriter, vllm_config: VllmConfig
    ) -> SharedTierWriter:
        """Join the Mooncake Store and the key space of ``vllm_config``'s
        artifact config; closes ``local`` on failure."""
        cfg = vllm_config.artifact_config
        kv = vllm_config.kv_transfer_config
        settles = kv is not None and kv.kv_role in SETTLING_KV_ROLES
        client = None
        try:
            client = mc.acquire(cfg)
            terms = KeySpaceTerms.of(vllm_config)
            master, space = str(cfg.mooncake_master), str(cfg.key_space)
            secret = shared_secret(cfg)
            agree(client, master, space, terms, secret)
        except BaseException:
            if client is not None:
                mc.release(client)
            local.close()
            raise
        return cls(
            local,
            cfg,
            max_object_nbytes=max_object_nbytes(vllm_config),
            rejoin=lambda: agree(client, master, space, terms, secret),
            client=client,
            settles=settles,
        )

    # ------------------------------------------------------------ writes
    def put_batch(
        self,
        keys: Sequence[str],
        lengths: np.ndarray,
        fill: FillFn,
        *,
        owners: Sequence[str] | None = None,
    ) -> PutResult:
        kept: list[np.ndarray] = []

        def fill_and_keep(buf: np.ndarray) -> np.ndarray | None:
            sums = fill(buf)
            kept.append(buf.copy())  # the store's buffer is gone after fill
            return sums

        result = self._local.put_batch(keys, lengths, fill_and_keep, owners=owners)
        new = [i for i, s in enumerate(result.statuses) if s != PutStatus.IDENTICAL]
        if new and kept:
            offsets = np.zeros(len(keys), np.int64)
            np.cumsum(np.asarray(lengths, np.int64)[:-1], out=offsets[1:])
            data = kept[0]
            if len(new) < len(keys):
                lens = np.asarray(lengths, np.int64)
                is_new = np.zeros(len(keys), bool)
                is_new[new] = True
                data = data[np.repeat(is_new, lens)]
                offsets = np.zeros(len(new), np.int64)
                np.cumsum(lens[is_new][:-1], out=offsets[1:])
            self._mirror([keys[i] for i in new], [result.refs[i] for i in new],
                         data, offsets)  # fmt: skip
        return result

    def _mirror(self, keys, refs, data, offsets) -> None:
        done = threading.Event()
        if self._settles:  # registered first: the mirror may end at once
            with self._lock:
                for k in keys:
                    self._in_flight[k] = done
        posted = (
            not self._sharing_stopped and time.monotonic() >= self._mirror_after
        ) and self._remote.post(
            lambda: self._mirror_now(keys, refs, data, offsets, done)
        )
        if not posted:  # the tier is down: nobody will find them there
            self._landed(keys, done)
            self._count(0, len(keys))

    def mirroring(self, keys: Sequence[str]) -> list[threading.Event]:
        """The events of the mirrors in flight that hold any of ``keys``
        (each set when its mirror ends): what an acknowledgement naming
        ``keys`` waits for, so that the engine it sends to them finds them.
        Empty on an engine no other engine is sent to, and for keys whose
        mirror ended, failed or was skipped; never another request's."""
        if not self._settles:
            return []
        with self._lock:
            events = {id(e): e for k in keys if (e := self._in_flight.get(k))}
        return [e for e in events.values() if not e.is_set()]

    def _landed(self, keys, done: threading.Event) -> None:
        done.set()
        if self._settles:
            with self._lock:
                for k in keys:
                    if self._in_flight.get(k) is done:
                        del self._in_flight[k]

    def _mirror_now(self, keys, refs, data, offsets, done) -> None:
        """On the client's thread."""
        try:
            failed = self._shared.put(keys, refs, data, offsets)
        except ArtifactError as e:
            self._mirror_failed(len(keys), e)
            return
        finally:  # whatever happened, nobody waits for it any longer
            self._landed(keys, done)
        if failed:
            self._warn(
                f"the Mooncake Store refused {failed} of {len(keys)} writes "
                "(full, or its master restarting)"
            )
            self._mirror_after = time.monotonic() + MIRROR_BACKOFF_S
        self._count(len(keys) - failed, failed)

    def _mirror_failed(self, n: int, error: ArtifactError) -> None:
        self._warn(f"mirroring {n} objects failed: {error}")
        self._mirror_after = time.monotonic() + MIRROR_BACKOFF_S
        self._count(0, n)

    def _count(self, put: int, failed: int) -> None:
        with self._lock:
            self._counts["shared_puts"] += put
            self._counts["shared_failures"] += failed

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            logger.warning(
                "artifact store, shared tier (master %s): %s; other engines "
                "recompute these blocks instead of loading their KV",
                self._master,
                msg,
            )

    def _rejected(self, keys: list[str]) -> None:
        """Shared objects that failed their checks, now removed from the
        tier: treated as missing (the blocks are recomputed and mirrored
        again, which puts genuine ones in their place)."""
        with self._lock:
            self._counts["shared_rejected"] += len(keys)
            first, self._rejected_logged = not self._rejected_logged, True
        if first:  # once: a poisoned prefix would repeat it on every request
            logger.warning(
                "artifact store, shared tier (master %s): %d shared object(s) "
                "failed authentication or their checks (first: %s) and were "
                "removed and treated as missing (recomputed): altered, or "
                "planted by someone who reaches the master; "
                "counted in vllm:routed_experts_store_shared_rejected_objects, "
                "not logged again",
                self._master,
                len(keys),
                keys[0],
            )

    # ------------------------------------------------------------ reads
    def retain(self, owner: str, keys: Iterable[str]) -> None:
        self._local.retain(owner, keys)

    def lookup(self, keys: Sequence[str]) -> list[ObjectRef | None]:
        return self._local.lookup(keys)

    def pull(self, tag: str, keys: Sequence[str], wake: Callable[[], None]) -> bool:
        local = self._local.lookup(keys)
        missing = [k for k, ref in zip(keys, local) if ref is None]
        if not missing or self._sharing_stopped:
            return True

        def fetch() -> None:
            """On the client's thread; the pull ends whatever happens."""
            got: list[ObjectRef] = []
            data = None
            try:
                got, data, rejected = self._shared.fetch(missing)
                if rejected:
                    self._shared.remove(rejected)
                    self._rejected(rejected)
            except ArtifactError as e:
                self._warn(f"pulling {len(missing)} objects failed: {e}")
            finally:
                with self._lock:
                    self._fetched.append((tag, got, data))
                wake()

        # Skipped while the tier is down or a call in it overran: the
        # scheduler then recomputes the blocks instead of waiting.
        return not self._remote.post(fetch)

    def pulled(self) -> list[str]:
        """Puts what the client's thread fetched into the local store (on
        the publication thread, the local store's writer)."""
        with self._lock:
            fetched, self._fetched = self._fetched, []
        for _, got, data in fetched:
            if not got:
                continue
            sums = np.fromiter((r.checksum for r in got), np.uint64, len(got))

            def fill(buf: np.ndarray, data=data, sums=sums) -> np.ndarray:
                buf[:] = data
                return sums

            lengths = np.fromiter((r.nbytes for r in got), np.int64, len(got))
            try:
                self._local.put_batch([r.key for r in got], lengths, fill)
            except ArtifactError as e:  # the blocks are recomputed
                logger.warning("artifact store: storing pulled objects failed: %s", e)
                continue
            with self._lock:
                self._counts["shared_pulls"] += len(got)
        return [tag for tag, _, _ in fetched]

    # ------------------------------------------------------------ the rest
    def release(self, owner: str) -> int:
        return self._local.release(owner)

    def maintain(self) -> None:
        self._local.maintain()
        now = time.monotonic()
        rejoin = self._rejoin
        if rejoin is not None and now >= self._next_terms:
            self._next_terms = now + TERMS_INTERVAL_S
            # Skipped while the tier is down: the breaker is its backoff.
            self._remote.post(lambda: self._rejoin_now(rejoin))

    def _rejoin_now(self, rejoin: Any) -> None:
        """On the client's thread: stop sharing while the recorded terms
        differ from this engine's, resume once they agree."""
        try:
            rejoin()
        except KeySpaceMismatchError as e:
            if not self._sharing_stopped:
                logger.error(
                    "artifact store, shared tier (master %s): stopped sharing "
                    "routes: %s. Hits on other engines' KV are recomputed and "
                    "this engine's routes are not mirrored (counted in "
                    "vllm:routed_experts_store_shared_failures) until the "
                    "recorded terms agree again (checked every %.0f s)",
                    self._master,
                    e,
                    TERMS_INTERVAL_S,
                )
            self._sharing_stopped = True
        except ArtifactError as e:
            self._warn(f"the key space's terms: {e}")
        else:
            if self._sharing_stopped:
                self._sharing_stopped = False
                logger.warning(
                    "artifact store, shared tier (master %s): the key space's "
                    "terms agree again; sharing routes resumed",
                    self._master,
                )

    def stats(self) -> StoreStats:
        with self._lock:
            counts = dict(self._counts)
        return dataclasses.replace(self._local.stats(), **counts)

    def close(self) -> None:
        """Close the local store; the shared objects stay (other engines use
        them) until Mooncake evicts them or this engine's segment goes. A
        client still in a call is closed by its thread when the call
        returns, never under it."""
        self._local.close()
        self._remote.close()

    def _close_client(self) -> None:
        """On the client's thread, when it stops."""
        self._shared.close()
        mc.release(self._client)
