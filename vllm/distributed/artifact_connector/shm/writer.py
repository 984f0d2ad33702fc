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
files removed behind the writer (an operator's ``rm``): a deleted arena is
retired, its retained objects copied out of the writer's own mapping; a
removed directory, index log or writer record makes it recreate the store,
empty, at the same place, and readers follow.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

from vllm.distributed.artifact_connector.shm import log
from vllm.distributed.artifact_connector.shm.arena import Arena, align, arena_name
from vllm.distributed.artifact_connector.shm.collect import (
    INDEX_FILE,
    NAMESPACE_RE,
    WRITER_FILE,
    WriterIdentity,
    collect_stale_stores,
    collect_store,
    remove_namespace,
)
from vllm.distributed.artifact_connector.shm.index import Index
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
from vllm.distributed.safe_fs import (
    ensure_private_shm_dir,
    open_private_dir,
    open_private_file,
    write_all,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_CAPACITY_BYTES = 8 << 30
DEFAULT_INACTIVE_TTL_S = 3600.0
DEFAULT_COLLECT_INTERVAL_S = 300.0
HEARTBEAT_INTERVAL_S = 10.0
# Arenas are capacity / 16, clamped to [MIN_ARENA_BYTES, MAX_ARENA_BYTES].
MIN_ARENA_BYTES = 64 << 10
MAX_ARENA_BYTES = 64 << 20
# The smallest store that keeps serving puts: a full active arena is evicted
# only once the next one exists, so two arenas must fit next to the index
# log and the writer record (the third arena's room). With exactly two
# arenas the writer starts, but the first full arena stops every put.
MIN_CAPACITY_BYTES = 3 * MIN_ARENA_BYTES
# A store whose writer cannot be checked is judged by its heartbeat: a TTL
# must outlast a few heartbeat intervals, or a live writer's store (another
# pid namespace, or one not yet holding its writer record) is collected.
MIN_INACTIVE_TTL_S = 3 * HEARTBEAT_INTERVAL_S
# How often upkeep checks that the store's files are still in place.
STORE_CHECK_INTERVAL_S = 0.1
# How often a store that cannot be recreated says so again in the log.
BROKEN_LOG_INTERVAL_S = 10.0
# Compact when the log is this many times the size of a snapshot.
_COMPACT_RATIO = 4
_COMPACT_MIN_BYTES = 1 << 20
# The index records of an eviction that moves nothing: one RETIRE batch.
_EVICT_RECORD_BYTES = log.BATCH_HEADER.size + log.RECORD_NBYTES


def default_arena_bytes(capacity_bytes: int) -> int:
    """The arena size of a store of ``capacity_bytes``."""
    return min(MAX_ARENA_BYTES, max(MIN_ARENA_BYTES, capacity_bytes // 16))


def _io_error(e: OSError, what: str) -> Exception:
    """The typed error for a failed write: a full file system is a capacity
    error, anything else an I/O error."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreCapacityError(
            f"{what} failed: /dev/shm is full ({e}); free space there or lower "
            "the artifact store capacity"
        )
    return StoreIOError(f"{what} failed: {e}")


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
            self._root = ensure_private_shm_dir(root, error=UnsafeStoreError)
        except OSError as e:
            raise _io_error(e, f"creating the artifact store root {root}") from e
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
        self._ttl = inactive_ttl_s
        self._collect_interval = collect_interval_s
        self._index = Index()
        self._arenas: dict[int, Arena] = {}
        self._active: Arena | None = None
        self._spare: Arena | None = None
        self._next_id = 1  # arena ids and snapshot file ids
        self._retain_count: dict[str, int] = {}
        self._owners: dict[str, set[str]] = {}
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
        }
        self._root_fd = self._ns_fd = self._log_fd = self._writer_fd = -1
        self._last_collect = 0.0
        self._log_size = self._record_bytes = 0
        self._root_arg = root
        self._broken: str | None = None  # why the store could not be recreated
        self._last_check = self._last_broken_log = 0.0
        self._collect(force=True)
        self._check_room()
        self._create_store()
        self._last_heartbeat = time.monotonic()
        self._closed = False

    def _check_room(self) -> None:
        """Refuse to start where the file system cannot hold the two arenas
        the store needs at once (a container's default 64 MiB ``/dev/shm``
        and the default capacity): every request would fail otherwise."""
        need = 2 * self._arena_bytes
        try:
            st = os.statvfs(self._root)
        except OSError as e:
            raise _io_error(e, f"checking the free space under {self._root}") from e
        free = st.f_bavail * st.f_frsize
        if free >= need:
            return
        with contextlib.suppress(OSError):
            os.rmdir(self._root)  # only if this writer just created it, empty
        raise StoreCapacityError(
            f"{self._root} has {free / (1 << 20):.1f} MiB free; the routed-experts "
            f"store needs at least {need / (1 << 20):.1f} MiB to start (an active "
            f"and a spare arena of {self._arena_bytes / (1 << 20):.1f} MiB). Give "
            "/dev/shm more room (e.g. `docker run --shm-size=16g`, or a larger "
            "memory-backed /dev/shm volume), or lower --artifact-config "
            f"capacity_bytes (arenas are capacity/16, from {MIN_ARENA_BYTES >> 10} "
            f"KiB to {MAX_ARENA_BYTES >> 20} MiB)."
        )

    def _create_store(self) -> None:
        """Create this store's directory and files under the root: at start,
        and again when they were removed behind the writer (see
        :meth:`_check_store`). On failure nothing of it is left."""
        root, namespace = self._root_arg, self._namespace
        for attempt in range(3):
            try:
                self._root_fd = open_private_dir(self._root, error=UnsafeStoreError)
            except FileNotFoundError:
                # Another engine removed the (empty) root as it closed.
                self._root = ensure_private_shm_dir(root, error=UnsafeStoreError)
                continue
            except OSError as e:
                raise _io_error(e, f"opening the artifact store root {root}") from e
            try:
                os.mkdir(namespace, 0o700, dir_fd=self._root_fd)
                break
            except FileExistsError as e:
                # Namespaces are fresh per engine instance, so this is a
                # store of an earlier writer of the same instance. Take its
                # place only if that writer is proven gone (as any stale
                # store is collected); never share a store with a live one.
                state, _ = collect_store(self._root_fd, namespace, self._ttl)
                if state == "removed" and attempt < 2:
                    self._counts["stores_collected"] += 1
                    logger.warning(
                        "artifact store: removed a stale store of a dead "
                        "writer with this engine's namespace %s",
                        namespace,
                    )
                    os.close(self._root_fd)
                    self._root_fd = -1
                    continue
                os.close(self._root_fd)
                self._root_fd = -1
                why = {
                    "alive": "its writer is still running",
                    "recent": "its writer cannot be checked and it was active "
                    "within the inactive TTL",
                }.get(state, "it cannot be removed")
                raise UnsafeStoreError(
                    f"artifact namespace {namespace} already exists under "
                    f"{self._root} and {why}; namespaces are per engine "
                    "instance and fresh"
                ) from e
            except FileNotFoundError as e:
                # The root was removed between opening and mkdir: again.
                os.close(self._root_fd)
                self._root_fd = -1
                if attempt == 2:
                    raise _io_error(e, f"creating artifact store {namespace}") from e
                self._root = ensure_private_shm_dir(root, error=UnsafeStoreError)
        else:
            raise StoreIOError(
                f"creating artifact store {namespace} under {root} failed: the "
                "root kept disappearing"
            )
        try:
            self._ns_fd = open_private_dir(
                namespace, dir_fd=self._root_fd, error=UnsafeStoreError
            )
            create = os.O_RDWR | os.O_CREAT | os.O_EXCL
            self._writer_fd = open_private_file(
                WRITER_FILE,
                self._ns_fd,
                create,
                "writer record",
                error=UnsafeStoreError,
            )
            self._record_bytes = write_all(
                self._writer_fd, [WriterIdentity.current().to_json()], 0
            )
            self._log_fd = open_private_file(
                INDEX_FILE, self._ns_fd, create, "index log", error=UnsafeStoreError
            )
            self._log_size = write_all(self._log_fd, [log.header_bytes()], 0)
        except OSError as e:
            self._release_files()
            raise _io_error(e, f"creating artifact store {namespace}") from e
        except BaseException:
            self._release_files()
            raise

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def root(self) -> str:
        return self._root

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"artifact store {self._namespace} is closed")

    def _used(self) -> int:
        """Bytes on disk: arenas (the spare included), index log, writer
        record."""
        arenas = sum(a.size for a in self._arenas.values())
        return arenas + self._log_size + self._record_bytes

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
            if self._broken is not None:
                raise StoreIOError(
                    f"artifact store {self._namespace} was removed behind the "
                    f"engine and cannot be recreated yet: {self._broken}"
                )
            try:
                return self._put_batch(keys, lengths, fill, owners)
            except OSError as e:  # e.g. an arena file that cannot be created
                raise _io_error(e, "publishing to the artifact store") from e

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
        statuses = self._classify(keys, cs, locs, offs, lens)
        self._append_log(log.records(log.PUT, keys_raw, locs, offs, lens, cs))
        self._index.put(keys, keys_raw, locs, offs, lens, cs)
        for s in statuses:
            self._counts[_STATUS_COUNTER[s]] += 1
        if owners is not None:
            for owner, key in zip(owners, keys):
                self._retain(owner, (key,))
        self._heartbeat()
        return PutResult(
            tuple(
                ObjectRef(k, c, ln)
                for k, c, ln in zip(keys, cs.tolist(), lens.tolist())
            ),
            tuple(statuses),
        )

    def _classify(
        self,
        keys: list[str],
        cs: np.ndarray,
        locs: np.ndarray,
        offs: np.ndarray,
        lens: np.ndarray,
    ) -> list[PutStatus]:
        """Status per object. An identical version that exists already is
        pointed at (``locs``/``offs`` updated; the fresh copy is left
        unindexed)."""
        idx = self._index
        if (
            idx.current.keys().isdisjoint(keys)
            and idx.older.keys().isdisjoint(keys)
            and len(set(keys)) == len(keys)
        ):
            return [PutStatus.WRITTEN] * len(keys)
        statuses = []
        seen: dict[tuple[str, int], int] = {}
        for i, key in enumerate(keys):
            c = int(cs[i])
            s = idx.find(key, c)
            if s is not None and self._same_bytes(s, locs[i], offs[i], lens[i]):
                locs[i], offs[i] = idx.arena[s], idx.off[s]
                statuses.append(PutStatus.IDENTICAL)
            elif (key, c) in seen:  # repeated within the batch
                j = seen[(key, c)]
                locs[i], offs[i] = locs[j], offs[j]
                statuses.append(PutStatus.IDENTICAL)
            else:
                repeated = any(k == key for k, _ in seen)
                diverged = idx.has_key(key) or repeated
                statuses.append(PutStatus.DIVERGED if diverged else PutStatus.WRITTEN)
                seen[(key, c)] = i
        return statuses

    def _same_bytes(self, slot: int, aid: int, off: int, ln: int) -> bool:
        idx = self._index
        if int(idx.length[slot]) != ln:
            return False
        old = self._arenas[int(idx.arena[slot])]
        o = int(idx.off[slot])
        return bool(
            np.array_equal(old.arr[o : o + ln], self._arenas[aid].arr[off : off + ln])
        )

    def _append_log(self, recs: np.ndarray) -> None:
        data = log.encode_batch(recs)
        try:
            write_all(self._log_fd, [data], self._log_size)
        except OSError as e:
            raise _io_error(e, "appending to the artifact index log") from e
        self._log_size += len(data)

    # ------------------------------------------------------------ space
    def _reserve(self, nbytes: int, log_bytes: int) -> tuple[Arena, int]:
        """An arena region of ``nbytes`` for a batch whose index records
        take ``log_bytes``; room for both is made first."""
        self._make_room(log_bytes)
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
        self._make_room(size + log_bytes)
        arena = self._start_arena(size)
        self._counts["arenas_started_on_demand"] += 1
        self._active = arena
        return arena, arena.reserve(nbytes) or 0

    def _start_arena(self, size: int) -> Arena:
        aid = self._next_id
        self._next_id += 1
        arena = Arena.create(self._ns_fd, aid, size)
        self._arenas[aid] = arena
        self._counts["arenas_started"] += 1
        return arena

    def _retained_bytes(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        idx = self._index
        retained = self._retain_count
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
            for aid in sorted(self._arenas):
                arena = self._arenas[aid]
                if arena is self._active:
                    continue
                if arena is self._spare:  # empty: unindexed, unlink directly
                    self._spare = None
                    self._unlink_arena(aid)
                    break
                if self._evict(aid):
                    break
            else:
                retained = sum(self._retain_count.values())
                raise StoreCapacityError(
                    f"artifact store full: {self._used()} of {self._capacity} "
                    f"bytes in use, {need} more needed, and the rest is held by "
                    f"{len(self._owners)} live request attempts ({retained} "
                    "retained objects); raise the artifact capacity or lower "
                    "the number of concurrent requests"
                )

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
        self._append_log(np.concatenate(parts))
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
            os.unlink(arena_name(aid), dir_fd=self._ns_fd)

    # ------------------------------------------------------------ log
    def _compact_log_if_worthwhile(self, *, under_pressure: bool = False) -> bool:
        """Replace the log by a snapshot if it is several times larger than
        one (twice, when room is needed now) and the snapshot fits in
        capacity. Returns whether it compacted."""
        snap_bytes = log.LOG_HEADER.size + (
            log.BATCH_HEADER.size + log.RECORD_NBYTES * self._index.num_versions
        )
        if under_pressure:
            threshold = 2 * snap_bytes
        else:
            threshold = _COMPACT_RATIO * snap_bytes + min(
                _COMPACT_MIN_BYTES, self._capacity // 32
            )
        if self._log_size < threshold:
            return False
        if self._used() + snap_bytes > self._capacity:
            return False
        tmp = f"{self._next_id:016x}.tmp"
        self._next_id += 1
        fd = open_private_file(
            tmp,
            self._ns_fd,
            os.O_RDWR | os.O_CREAT | os.O_EXCL,
            "index snapshot",
            error=UnsafeStoreError,
        )
        try:
            data = [log.header_bytes(), log.encode_batch(self._index.snapshot())]
            size = write_all(fd, data, 0)
            os.rename(tmp, INDEX_FILE, src_dir_fd=self._ns_fd, dst_dir_fd=self._ns_fd)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._ns_fd)
            logger.warning("artifact store: log compaction failed: %s", e)
            return False
        os.close(self._log_fd)
        self._log_fd = fd
        self._log_size = size
        self._counts["log_compactions"] += 1
        return True

    # ------------------------------------------------------------ retention
    def retain(self, owner: str, keys: Iterable[str]) -> None:
        with self._lock:
            self._check_open()
            self._retain(owner, keys)

    def _retain(self, owner: str, keys: Iterable[str]) -> None:
        held = self._owners.setdefault(owner, set())
        counts = self._retain_count
        for key in keys:
            if key not in held:
                held.add(key)
                counts[key] = counts.get(key, 0) + 1

    def release(self, owner: str) -> int:
        with self._lock:
            held = self._owners.pop(owner, None)
            if not held:
                return 0
            counts = self._retain_count
            for key in held:
                n = counts[key] - 1
                if n:
                    counts[key] = n
                else:
                    del counts[key]
            return len(held)

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
            if self._broken is None:
                self._compact_log_if_worthwhile()
                if self._spare is None:
                    try:
                        self._make_room(self._arena_bytes)
                        self._spare = self._start_arena(self._arena_bytes)
                    except StoreCapacityError as e:
                        logger.debug("artifact store: no spare arena: %s", e)
                self._heartbeat()
        self._collect()

    # ------------------------------------------------------------ damage
    def _check_store(self) -> None:
        """Notice (at most every ``STORE_CHECK_INTERVAL_S``) files removed or
        replaced behind the writer, by an operator's ``rm`` or a clean-up of
        ``/dev/shm``, and recover: a deleted arena is retired (its retained
        objects copied out of the writer's own mapping first); a removed or
        replaced directory, index log or writer record means the store is
        recreated, empty, at the same place. Readers follow (they reopen the
        namespace); routes it held are lost, so requests that needed them
        fail with a typed error, and later requests are served again."""
        now = time.monotonic()
        if now - self._last_check < STORE_CHECK_INTERVAL_S:
            return
        self._last_check = now
        if self._broken is not None or not self._files_in_place():
            self._recreate()
        else:
            self._retire_lost_arenas()

    def _files_in_place(self) -> bool:
        try:
            ns = os.fstat(self._ns_fd)
            if any(
                os.fstat(fd).st_nlink == 0 for fd in (self._log_fd, self._writer_fd)
            ):
                return False
            root = os.fstat(self._root_fd)
            root_now = os.stat(self._root, follow_symlinks=False)
            ns_now = os.stat(
                self._namespace, dir_fd=self._root_fd, follow_symlinks=False
            )
        except OSError:
            return False
        return (
            ns.st_nlink > 0
            and (root_now.st_dev, root_now.st_ino) == (root.st_dev, root.st_ino)
            and (ns_now.st_dev, ns_now.st_ino) == (ns.st_dev, ns.st_ino)
        )

    def _recreate(self) -> None:
        if self._broken is None:
            logger.error(
                "artifact store %s under %s was removed or replaced behind the "
                "engine; recreating it empty (the routes it held are lost: "
                "requests that need them fail with a typed error)",
                self._namespace,
                self._root,
            )
        self._release_files(rmdir_root=False)
        self._index = Index()
        self._log_size = self._record_bytes = 0
        try:
            self._create_store()
        except (ArtifactError, OSError) as e:
            now = time.monotonic()
            if (
                self._broken is None
                or now - self._last_broken_log >= BROKEN_LOG_INTERVAL_S
            ):
                logger.error(
                    "artifact store %s cannot be recreated under %s: %s; "
                    "publication fails until it can",
                    self._namespace,
                    self._root,
                    e,
                )
                self._last_broken_log = now
            self._broken = str(e)
            return
        if self._broken is not None:
            logger.warning("artifact store %s recreated", self._namespace)
        self._broken = None
        self._counts["stores_recreated"] += 1
        self._last_heartbeat = time.monotonic()

    def _retire_lost_arenas(self) -> None:
        lost = []
        for aid in self._arenas:
            try:
                os.stat(arena_name(aid), dir_fd=self._ns_fd, follow_symlinks=False)
            except FileNotFoundError:
                lost.append(aid)
            except OSError:
                continue
        for aid in lost:
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
                    self._append_log(log.records(log.RETIRE, bytes(32), aid))
                    self._counts["evicted_objects"] += self._index.drop_arena(aid)
                    self._unlink_arena(aid)
            except (ArtifactError, OSError) as e:
                logger.warning("artifact store: retiring a lost arena failed: %s", e)

    def _heartbeat(self) -> None:
        """Refresh the writer record's mtime now and then (the TTL of
        collectors that cannot check this process's liveness)."""
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_INTERVAL_S:
            with contextlib.suppress(OSError):
                os.utime(self._writer_fd)
            self._last_heartbeat = now

    def _collect(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_collect < self._collect_interval:
            return
        self._last_collect = now
        try:
            report = collect_stale_stores(
                self._root, self._ttl, exclude=(self._namespace,)
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
                retained_keys=len(self._retain_count),
                retainers=len(self._owners),
                **self._counts,
            )

    def close(self) -> None:
        """Unmap, close and remove this store's files."""
        with self._lock:
            if self._closed and self._root_fd < 0:
                return
            self._closed = True
            self._release_files(rmdir_root=True)

    def _release_files(self, *, rmdir_root: bool = True) -> None:
        """Unmap the arenas, close every descriptor and delete this store's
        files; ``rmdir_root`` also removes the root when no other store is
        in it."""
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        self._active = self._spare = None
        for fd in (self._log_fd, self._writer_fd, self._ns_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._log_fd = self._writer_fd = self._ns_fd = -1
        if self._root_fd >= 0:
            remove_namespace(self._root_fd, self._namespace)
            os.close(self._root_fd)
            self._root_fd = -1
            # Leave nothing behind on a clean shutdown: the root goes too
            # when no other store is in it (a writer starting meanwhile
            # recreates it).
            if rmdir_root:
                with contextlib.suppress(OSError):
                    os.rmdir(self._root)


_STATUS_COUNTER = {
    PutStatus.WRITTEN: "puts_written",
    PutStatus.IDENTICAL: "puts_identical",
    PutStatus.DIVERGED: "divergences",
}
