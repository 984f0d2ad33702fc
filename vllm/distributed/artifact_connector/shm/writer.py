# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The writing side of a ``/dev/shm`` store (one process per namespace).

A put reserves one region of the active arena for the whole batch, lets the
caller encode the objects straight into it, and appends one index batch
(see ``log``). The index in memory changes only after the log write
succeeded, so a failed write (``ENOSPC``) leaves log and index agreeing.

Capacity bounds everything on disk (arenas, the prepared spare included,
the index log and the writer record) at every point: room is made *before*
anything grows, by compacting the log or evicting whole arenas oldest
first, always keeping room for the records of one eviction. Objects of
retained keys in a victim arena are copied into the active arena (``MOVE``
records); then ``RETIRE`` is logged, which drops every version still in the
arena, and the arena is unlinked. An arena whose retained objects do not
fit is skipped.

Slow work runs in :meth:`ShmStoreWriter.maintain`, which the owner calls
when it is idle (the worker's publication thread between batches): it
prepares the next arena ahead of need, compacts the log, refreshes the
writer record and collects stale stores of other writers. It also notices
files removed behind the writer (``repair``).

The other jobs live beside it: the directory and its files (``files``),
which keys are retained (``retention``), the index (``index``) and its log
format (``log``). A writer is used from two threads (the publication thread
puts, retains, releases and looks up; the engine thread reads ``stats``):
every public method takes its one lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

from vllm.config.artifact_sizing import (
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_COLLECT_INTERVAL_S,
    DEFAULT_INACTIVE_TTL_S,
    HEARTBEAT_INTERVAL_S,
    default_arena_bytes,
)
from vllm.distributed.artifact_connector.shm import log
from vllm.distributed.artifact_connector.shm.arena import Arena, align, arena_name
from vllm.distributed.artifact_connector.shm.collect import (
    NAMESPACE_RE,
    collect_stale_stores,
)
from vllm.distributed.artifact_connector.shm.files import StoreFiles, io_error
from vllm.distributed.artifact_connector.shm.index import Index
from vllm.distributed.artifact_connector.shm.repair import (
    RepairState,
    files_in_place,
    lost_arenas,
)
from vllm.distributed.artifact_connector.shm.retention import Retention
from vllm.distributed.artifact_connector.shm.space import (
    check_room,
    free_bytes,
    keep_headroom,
    page_end,
    when_full,
)
from vllm.distributed.artifact_connector.store import (
    ArtifactError,
    FillFn,
    ObjectRef,
    ObjectStoreWriter,
    PutResult,
    PutStatus,
    StoreCapacityError,
    StoreClosedError,
    StoreIOError,
    StoreStats,
    UnsafeStoreError,
    checksum,
    keys_to_bytes,
)
from vllm.logger import init_logger
from vllm_host_transport.safe_fs import ensure_private_shm_dir

logger = init_logger(__name__)

# Compact when the log is this many times the size of a snapshot.
_COMPACT_RATIO = 4
_COMPACT_MIN_BYTES = 1 << 20
# The index records of an eviction that moves nothing: one RETIRE batch.
_EVICT_RECORD_BYTES = log.BATCH_HEADER.size + log.RECORD_NBYTES


class ShmStoreWriter(ObjectStoreWriter):
    """See the module docs. Create with :meth:`create`."""

    def __init__(
        self,
        root: str,
        namespace: str,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        arena_bytes: int | None = None,
        inactive_ttl_s: float = DEFAULT_INACTIVE_TTL_S,
        collect_interval_s: float = DEFAULT_COLLECT_INTERVAL_S,
    ) -> None:
        """Create the store ``namespace`` (32 hex characters, fresh) under
        ``root`` (a directory under ``/dev/shm``, created 0700). Stale
        stores of other writers under ``root`` are collected first.
        ``arena_bytes`` defaults to :func:`default_arena_bytes`."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if inactive_ttl_s < 0:
            raise ValueError("inactive_ttl_s must be >= 0")
        if NAMESPACE_RE.match(namespace) is None:
            raise UnsafeStoreError(
                f"artifact namespace must be 32 lowercase hex characters, "
                f"got {namespace!r:.80}"
            )
        self._lock = threading.Lock()
        self._closed = True
        try:
            real_root = ensure_private_shm_dir(root, error=UnsafeStoreError)
        except OSError as e:
            raise io_error(e, f"creating the artifact store root {root}") from e
        self._namespace = namespace
        self._capacity = capacity_bytes
        if arena_bytes is None:
            arena_bytes = default_arena_bytes(capacity_bytes)
        self._arena_bytes = align(arena_bytes)
        if self._arena_bytes <= 0 or 2 * self._arena_bytes > capacity_bytes:
            raise ValueError(
                f"artifact arenas of {arena_bytes} bytes need a capacity of at "
                f"least twice that (an active and a spare arena), got {capacity_bytes}"
            )
        self._files = StoreFiles(root, real_root, namespace, self._arena_bytes)
        self._ttl = inactive_ttl_s
        self._collect_interval = collect_interval_s
        self._index = Index()
        self._arenas: dict[int, Arena] = {}
        self._active: Arena | None = None
        self._spare: Arena | None = None
        self._next_id = 1  # arena ids and snapshot file ids
        self._retention = Retention()
        self._counts = {
            "puts_written": 0,
            "puts_identical": 0,
            "divergences": 0,
            "evicted_objects": 0,
            "relocated_objects": 0,
            "arenas_started": 0,
            "arenas_started_on_demand": 0,
            "log_compactions": 0,
            "stores_collected": 0,
            "stores_recreated": 0,
            "arenas_lost": 0,
            "space_evictions": 0,
            "space_compactions": 0,
        }
        self._last_collect = 0.0
        self._repair = RepairState()
        self._collect(force=True)
        check_room(self._files.root, self._arena_bytes)
        self._counts["stores_collected"] += self._files.create(self._ttl)
        self._last_heartbeat = time.monotonic()
        self._closed = False

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def root(self) -> str:
        return self._files.root

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"artifact store {self._namespace} is closed")

    def _used(self) -> int:
        """Bytes on disk: arenas (the spare included), index log (its
        reserved pages included), writer record."""
        arenas = sum(a.size for a in self._arenas.values())
        return arenas + self._files.log_bytes + self._files.record_bytes

    # ------------------------------------------------------------ put
    def put_batch(
        self,
        keys: Sequence[str],
        lengths: np.ndarray,
        fill: FillFn,
        *,
        owners: Sequence[str] | None = None,
    ) -> PutResult:
        """See :meth:`ObjectStoreWriter.put_batch`. Identical re-puts write
        nothing (that version becomes current again); different bytes under
        an existing key become a new current version, counted in
        ``stats().divergences``."""
        with self._lock:
            self._check_open()
            broken = self._repair.broken
            if broken is not None:
                raise StoreIOError(
                    f"artifact store {self._namespace} was removed behind the "
                    f"engine and cannot be recreated yet: {broken}"
                )
            try:
                return self._put_batch(keys, lengths, fill, owners)
            except OSError as e:  # e.g. an arena file that cannot be created
                raise io_error(e, "publishing to the artifact store") from e

    def _put_batch(
        self,
        keys: Sequence[str],
        lengths: np.ndarray,
        fill: FillFn,
        owners: Sequence[str] | None,
    ) -> PutResult:
        n = len(keys)
        if n == 0:
            return PutResult((), ())
        if owners is not None and len(owners) != n:
            raise ValueError("owners must name one owner per key")
        keys = list(keys)
        keys_raw = keys_to_bytes(keys)
        lens = np.asarray(lengths, np.int64)
        if lens.shape != (n,) or (lens <= 0).any():
            raise ValueError("lengths must be one positive int per key")
        total = int(lens.sum())
        log_bytes = log.BATCH_HEADER.size + n * log.RECORD_NBYTES
        arena, base = self._reserve(total, log_bytes)
        region = arena.arr[base : base + total]
        offs = np.zeros(n, np.int64)
        np.cumsum(lens[:-1], out=offs[1:])
        sums = fill(region)
        if sums is None:
            mv = region.data
            sums = np.fromiter(
                (
                    checksum(mv[o : o + ln])
                    for o, ln in zip(offs.tolist(), lens.tolist())
                ),
                np.uint64,
                n,
            )
        cs = np.asarray(sums, np.uint64)
        if cs.shape != (n,):
            raise ValueError("fill must return one checksum per object")
        locs = np.full(n, arena.aid, np.int64)
        offs += base
        statuses = self._index.classify(keys, cs, locs, offs, lens, self._same_bytes)
        self._append_log(log.records(log.PUT, keys_raw, locs, offs, lens, cs))
        self._index.put(keys, keys_raw, locs, offs, lens, cs)
        for s in statuses:
            self._counts[_STATUS_COUNTER[s]] += 1
        if owners is not None:
            self._retention.retain_each(list(owners), keys)
        self._heartbeat()
        return PutResult(
            tuple(
                ObjectRef(k, c, ln)
                for k, c, ln in zip(keys, cs.tolist(), lens.tolist())
            ),
            tuple(statuses),
        )

    def _same_bytes(self, slot: int, aid: int, off: int, ln: int) -> bool:
        idx = self._index
        if int(idx.length[slot]) != ln:
            return False
        old = self._arenas[int(idx.arena[slot])]
        o = int(idx.off[slot])
        return bool(
            np.array_equal(old.arr[o : o + ln], self._arenas[aid].arr[off : off + ln])
        )

    def _append_log(self, recs: np.ndarray, *, evicting: bool = False) -> None:
        """Append one batch; an ordinary one makes room (``space.when_full``)."""
        data = log.encode_batch(recs)
        if evicting:
            return self._files.append_log(data, evicting=True)
        self._when_full(lambda: self._files.append_log(data))

    def _when_full(self, op):
        return when_full(op, self._give_back_space, self._counts, self._files.root)

    def _grow(self, size: int) -> Arena:
        """A new arena, one arena of /dev/shm left free (``space``)."""
        need = size + self._arena_bytes
        keep_headroom(self._files.root, need, self._give_back_space)
        return self._when_full(lambda: self._start_arena(size))

    def _give_back_space(self) -> bool:
        """One step of making room on a full file system (``space``): the
        index log compacted where that at least halves it and the snapshot
        fits in what is free, else the oldest arena evicted. False when
        neither can be done."""
        if self._compact_log_if_worthwhile(under_pressure=True, on_full_disk=True):
            self._counts["space_compactions"] += 1
            return True
        if self._evict_oldest():
            self._counts["space_evictions"] += 1
            return True
        return False

    # ------------------------------------------------------------ space
    def _reserve(self, nbytes: int, log_bytes: int) -> tuple[Arena, int]:
        """An arena region of ``nbytes`` for a batch whose index records
        take ``log_bytes``; room for both (and the log's reserve) is made
        first."""
        self._make_room(log_bytes + self._files.log_headroom)
        a = self._active
        off = a.reserve(nbytes) if a is not None else None
        if a is not None and off is not None:
            return a, off
        spare = self._spare
        if spare is not None and nbytes <= spare.size:
            self._spare = None
            self._active = spare
            return spare, spare.reserve(nbytes) or 0
        size = max(self._arena_bytes, align(nbytes))
        self._make_room(size + log_bytes + self._files.log_headroom)
        arena = self._grow(size)
        self._counts["arenas_started_on_demand"] += 1
        self._active = arena
        return arena, arena.reserve(nbytes) or 0

    def _start_arena(self, size: int) -> Arena:
        aid = self._next_id
        self._next_id += 1
        arena = Arena.create(self._files.ns_fd, aid, size)
        self._arenas[aid] = arena
        self._counts["arenas_started"] += 1
        return arena

    def _retained_bytes(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        idx = self._index
        retained = self._retention
        keep = np.fromiter(
            (key in retained for key in idx.keys_of(slots)), np.bool_, slots.shape[0]
        )
        return keep, int(idx.length[slots[keep]].sum()) + 64 * int(keep.sum())

    def _make_room(self, need: int) -> None:
        """Evict (or compact) until ``need`` more bytes fit in capacity,
        with room left for the records of one more eviction."""
        while self._used() + need + _EVICT_RECORD_BYTES > self._capacity:
            if self._compact_log_if_worthwhile(under_pressure=True):
                continue
            if not self._evict_oldest():
                retention = self._retention
                raise StoreCapacityError(
                    f"artifact store full: {self._used()} of {self._capacity} "
                    f"bytes in use, {need} more needed, and the rest is held by "
                    f"{retention.num_owners} live request attempts "
                    f"({retention.num_holds} retained objects); raise the "
                    "artifact capacity or lower the number of concurrent requests"
                )

    def _evict_oldest(self) -> bool:
        """Evict the oldest arena that can go (not the active one); False if none."""
        for aid in sorted(self._arenas):
            arena = self._arenas[aid]
            if arena is self._active:
                continue
            if arena is self._spare:  # empty: unindexed, unlink directly
                self._spare = None
                self._unlink_arena(aid)
                return True
            if self._evict(aid):
                return True
        return False

    def _evict(self, aid: int) -> bool:
        """Evict arena ``aid`` if its retained objects fit in the active
        arena and its records fit in capacity. Computes everything, writes
        the moved bytes (unindexed until the log says so), appends the log
        batch, and only then changes the index and unlinks the file."""
        idx = self._index
        slots = idx.slots_in_arena(aid)
        keep, move_bytes = self._retained_bytes(slots)
        moves = slots[keep]
        rec_bytes = log.BATCH_HEADER.size + log.RECORD_NBYTES * (moves.shape[0] + 1)
        if self._used() + rec_bytes > self._capacity:
            return False
        dst = self._active
        dst_offs: list[int] = []
        parts = []
        if moves.shape[0]:
            if dst is None or align(dst.fill) + move_bytes > dst.size:
                return False
            victim = self._arenas[aid]
            for s in moves.tolist():
                o, ln = int(idx.off[s]), int(idx.length[s])
                d = dst.reserve(ln)
                if d is None:  # pragma: no cover - room checked above
                    raise StoreCapacityError("artifact arena space miscounted")
                dst.arr[d : d + ln] = victim.arr[o : o + ln]
                dst_offs.append(d)
            parts.append(
                log.records(
                    log.MOVE,
                    idx.key_raw[moves].tobytes(),
                    dst.aid,
                    np.array(dst_offs, np.int64),
                    idx.length[moves],
                    idx.cs[moves],
                )
            )
        parts.append(log.records(log.RETIRE, bytes(32), aid))
        self._append_log(np.concatenate(parts), evicting=True)
        if dst is not None:
            for s, d in zip(moves.tolist(), dst_offs):
                idx.move(s, dst.aid, d)
        self._counts["relocated_objects"] += int(moves.shape[0])
        self._counts["evicted_objects"] += idx.drop_arena(aid)
        self._unlink_arena(aid)
        return True

    def _unlink_arena(self, aid: int) -> None:
        self._arenas.pop(aid).close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(arena_name(aid), dir_fd=self._files.ns_fd)

    # ------------------------------------------------------------ log
    def _compact_log_if_worthwhile(
        self, *, under_pressure: bool = False, on_full_disk: bool = False
    ) -> bool:
        """Replace the log by a snapshot if it is several times larger than
        one (twice, when room is needed now) and the snapshot fits in
        capacity (and, ``on_full_disk``, in the file system's free space).
        Returns whether it compacted."""
        snap_bytes = log.LOG_HEADER.size + (
            log.BATCH_HEADER.size + log.RECORD_NBYTES * self._index.num_versions
        )
        if under_pressure:
            threshold = 2 * snap_bytes
        else:
            threshold = _COMPACT_RATIO * snap_bytes + min(
                _COMPACT_MIN_BYTES, self._capacity // 32
            )
        files = self._files
        if files.log_size < threshold:
            return False
        if self._used() + snap_bytes > self._capacity:
            return False
        if on_full_disk and free_bytes(files.root) < page_end(snap_bytes):
            return False
        tmp = f"{self._next_id:016x}.tmp"
        self._next_id += 1
        data = [log.header_bytes(), log.encode_batch(self._index.snapshot())]
        if not files.replace_log(tmp, data):
            return False
        self._counts["log_compactions"] += 1
        return True

    # ------------------------------------------------------------ retention
    def retain(self, owner: str, keys: Iterable[str]) -> None:
        with self._lock:
            self._check_open()
            self._retention.retain(owner, keys)

    def release(self, owner: str) -> int:
        with self._lock:
            return self._retention.release(owner)

    def lookup(self, keys: Sequence[str]) -> list[ObjectRef | None]:
        with self._lock:
            self._check_open()
            idx = self._index
            out: list[ObjectRef | None] = []
            for key in keys:
                s = idx.current.get(key)
                out.append(
                    None
                    if s is None
                    else ObjectRef(key, int(idx.cs[s]), int(idx.length[s]))
                )
            return out

    # ------------------------------------------------------------ upkeep
    def maintain(self) -> None:
        """Slow work, for the owner's idle moments: prepare the next arena,
        compact the log, refresh the writer record, collect stale stores.
        Never raises for a full store (the next put reports that)."""
        with self._lock:
            self._check_open()
            self._check_store()
            if self._repair.broken is None:
                self._compact_log_if_worthwhile()
                if self._spare is None:
                    try:
                        self._make_room(self._arena_bytes)
                        self._spare = self._grow(self._arena_bytes)
                    except StoreCapacityError as e:
                        logger.debug("artifact store: no spare arena: %s", e)
                self._heartbeat()
        self._collect()

    # ------------------------------------------------------------ damage
    def _check_store(self) -> None:
        """See ``repair``: recreate a store removed or replaced behind the
        writer, retire arenas deleted behind it."""
        repair = self._repair
        if not repair.due():
            return
        if repair.broken is not None or not files_in_place(self._files):
            self._recreate()
        else:
            self._retire_lost_arenas()

    def _recreate(self) -> None:
        repair, files = self._repair, self._files
        repair.recreating(files)
        self._release_files(rmdir_root=False)
        self._index = Index()
        try:
            self._counts["stores_collected"] += files.create(self._ttl)
        except (ArtifactError, OSError) as e:
            repair.failed(files, e)
            return
        repair.recreated(files)
        self._counts["stores_recreated"] += 1
        self._last_heartbeat = time.monotonic()

    def _retire_lost_arenas(self) -> None:
        for aid in lost_arenas(self._files, list(self._arenas)):
            arena = self._arenas.get(aid)
            if arena is None:  # evicted to make room meanwhile
                continue
            logger.error(
                "artifact arena %s of store %s was deleted behind the engine; "
                "retiring it",
                arena_name(aid),
                self._namespace,
            )
            self._counts["arenas_lost"] += 1
            if arena is self._spare:  # empty
                self._spare = None
                self._unlink_arena(aid)
                continue
            try:
                if arena is self._active:
                    # Somewhere for its retained objects to go.
                    self._active, self._spare = self._spare, None
                    if self._active is None:
                        self._make_room(self._arena_bytes)
                        self._active = self._start_arena(self._arena_bytes)
                if aid in self._arenas and not self._evict(aid):
                    # Its retained objects do not fit: drop them too.
                    self._append_log(
                        log.records(log.RETIRE, bytes(32), aid), evicting=True
                    )
                    self._counts["evicted_objects"] += self._index.drop_arena(aid)
                    self._unlink_arena(aid)
            except (ArtifactError, OSError) as e:
                logger.warning("artifact store: retiring a lost arena failed: %s", e)

    def _heartbeat(self) -> None:
        """Refresh the writer record's mtime now and then (the TTL of
        collectors that cannot check this process's liveness)."""
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_INTERVAL_S:
            self._files.touch()
            self._last_heartbeat = now

    def _collect(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_collect < self._collect_interval:
            return
        self._last_collect = now
        try:
            report = collect_stale_stores(
                self._files.root, self._ttl, exclude=(self._namespace,)
            )
        except OSError as e:  # a neighbour's trouble never fails this store
            logger.warning("artifact store: collecting stale stores failed: %s", e)
            return
        self._counts["stores_collected"] += len(report.removed)

    def stats(self) -> StoreStats:
        with self._lock:
            idx = self._index
            return StoreStats(
                objects=idx.num_versions,
                # ``older`` is small (keys with divergent versions)
                keys=len(idx.current) + sum(k not in idx.current for k in idx.older),
                used_bytes=self._used() if not self._closed else 0,
                capacity_bytes=self._capacity,
                retained_keys=self._retention.num_keys,
                retainers=self._retention.num_owners,
                **self._counts,
            )

    def close(self) -> None:
        """Unmap, close and remove this store's files."""
        with self._lock:
            if self._closed and self._files.root_fd < 0:
                return
            self._closed = True
            self._release_files(rmdir_root=True)

    def _release_files(self, *, rmdir_root: bool = True) -> None:
        """Unmap the arenas, then close and delete the store's files
        (``StoreFiles.release``)."""
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        self._active = self._spare = None
        self._files.release(rmdir_root=rmdir_root)


_STATUS_COUNTER = {
    PutStatus.WRITTEN: "puts_written",
    PutStatus.IDENTICAL: "puts_identical",
    PutStatus.DIVERGED: "divergences",
}
