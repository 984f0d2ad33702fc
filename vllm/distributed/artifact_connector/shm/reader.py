# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reading side of a ``/dev/shm`` store (any process of its user).

A reader rebuilds the index from the log and extends it with each new batch
before a read; it maps arenas read-only and drops a mapping when the log
retires the arena. An unlinked file's pages are freed only once no process
maps it or holds it open, and the writer evicts its oldest arenas (and
compacts its log) when ``/dev/shm`` is full (``space``), which must free
memory at once: a reader that kept an evicted arena mapped until its next
read would hold that room while its engine's puts fail for lack of it, and
a failed put means no read to let go of it. So after a read that finds
``/dev/shm`` tight (less than :data:`TIGHT_ARENAS` arenas free), the reader
keeps nothing mapped or open but its directories
(:data:`KEEP_MAPPED_WHEN_TIGHT`): the next read maps what it needs again
(reading an 8k- or 32k-token request then takes about 1.4 times as long;
docs/benchmarks.md, "Reader mappings") and reopens the log where it left
off. Otherwise it keeps every arena the log has not retired mapped. A read
resolves exact versions, verifies every object's checksum over the mapped
bytes, lets the caller check the objects' trailers, and only then copies: a
failed read leaves the caller's buffer untouched. Values leave the store,
never paths or mappings.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import numpy as np

from vllm.distributed.artifact_connector.shm import log
from vllm.distributed.artifact_connector.shm.arena import Arena
from vllm.distributed.artifact_connector.shm.collect import INDEX_FILE, NAMESPACE_RE
from vllm.distributed.artifact_connector.shm.index import Index
from vllm.distributed.artifact_connector.shm.space import free_bytes
from vllm.distributed.artifact_connector.store import (
    CheckFn,
    ChecksumMismatchError,
    ObjectMissingError,
    ObjectSizeError,
    ObjectStoreReader,
    StoreClosedError,
    StoreIOError,
    UnsafeStoreError,
    checksum,
)
from vllm_host_transport.safe_fs import open_private_dir, open_private_file, shm_subdir

#: ``/dev/shm`` is tight when it has less free space than this many of the
#: store's arenas (the largest the reader has mapped): the writer may evict
#: for room at any moment.
TIGHT_ARENAS = 4
#: Arenas (the newest) a reader keeps mapped between reads while
#: ``/dev/shm`` is tight; it closes its log too.
KEEP_MAPPED_WHEN_TIGHT = 0


class ShmStoreReader(ObjectStoreReader):
    """See the module docs. Not thread-safe: one thread owns it."""

    def __init__(self, root: str, namespace: str) -> None:
        """Open store ``namespace`` under ``root`` read-only."""
        if NAMESPACE_RE.match(namespace) is None:
            raise UnsafeStoreError(
                f"artifact namespace must be 32 lowercase hex characters, "
                f"got {namespace!r:.80}"
            )
        self._namespace = namespace
        self._root_fd = self._ns_fd = self._log_fd = -1
        self._ns_id = (0, 0)
        self._arenas: dict[int, Arena] = {}
        self._arena_size = 0  # the largest arena mapped so far
        self._index = Index()
        self._log_pos = 0
        self._log_ino = 0
        self.checksum_failures = 0
        self._root = shm_subdir(root, error=UnsafeStoreError)
        try:
            self._root_fd = open_private_dir(self._root, error=UnsafeStoreError)
            self._ns_fd = open_private_dir(
                namespace, dir_fd=self._root_fd, error=UnsafeStoreError
            )
            st = os.fstat(self._ns_fd)
            self._ns_id = (st.st_dev, st.st_ino)
            self._reload()
        except FileNotFoundError as e:
            self.close()
            raise StoreClosedError(
                f"artifact store {namespace} does not exist under {self._root}"
            ) from e
        except OSError as e:
            self.close()
            raise StoreIOError(f"opening artifact store {namespace} failed: {e}") from e
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ index
    def _reload(self) -> None:
        """Read the log from the start (first open, or after compaction)."""
        fd = open_private_file(
            INDEX_FILE, self._ns_fd, os.O_RDONLY, "index log", error=UnsafeStoreError
        )
        try:
            log.check_header(os.pread(fd, log.LOG_HEADER.size, 0))
        except BaseException:
            os.close(fd)
            raise
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd = fd
        self._log_ino = os.fstat(fd).st_ino
        self._log_pos = log.LOG_HEADER.size
        self._index = Index()
        self._unmap_all()
        self._read_tail()

    def _read_tail(self) -> None:
        recs, self._log_pos = log.read_batches(self._log_fd, self._log_pos)
        for aid in self._index.apply(recs):
            arena = self._arenas.pop(aid, None)
            if arena is not None:
                arena.close()

    def _refresh(self) -> None:
        if self._ns_fd < 0:
            raise StoreClosedError(f"artifact store reader {self._namespace} is closed")
        here: os.stat_result | None
        st: os.stat_result | None
        try:
            here = os.stat(
                os.path.join(self._root, self._namespace), follow_symlinks=False
            )
            st = os.stat(INDEX_FILE, dir_fd=self._ns_fd, follow_symlinks=False)
        except OSError:  # gone, or a non-directory on the way
            here = st = None
        if st is None or here is None or (here.st_dev, here.st_ino) != self._ns_id:
            # Removed (or replaced) behind the engine; the writer recreates
            # it at the same place: follow it there.
            self._reopen()
        elif st.st_ino != self._log_ino:
            self._reload()
        else:
            if self._log_fd < 0:  # closed after a read on a tight /dev/shm
                self._reopen_log()
            self._read_tail()

    def _reopen_log(self) -> None:
        """Open the index log again and go on where the last read stopped
        (from the start if it was replaced meanwhile)."""
        fd = open_private_file(
            INDEX_FILE, self._ns_fd, os.O_RDONLY, "index log", error=UnsafeStoreError
        )
        if os.fstat(fd).st_ino == self._log_ino:
            self._log_fd = fd
            return
        os.close(fd)
        self._reload()

    def _reopen(self) -> None:
        """Open the namespace again by its path (it was removed or replaced
        behind the engine, and its writer recreated it, empty)."""
        gone = StoreClosedError(
            f"artifact store {self._namespace} no longer exists under "
            f"{self._root} (its writer closed it, it was collected, or it was "
            "removed behind the engine and not recreated yet)"
        )
        root_fd = ns_fd = -1
        try:
            root_fd = open_private_dir(
                shm_subdir(self._root, error=UnsafeStoreError), error=UnsafeStoreError
            )
            ns_fd = open_private_dir(
                self._namespace, dir_fd=root_fd, error=UnsafeStoreError
            )
        except BaseException as e:
            for fd in (ns_fd, root_fd):
                if fd >= 0:
                    os.close(fd)
            if isinstance(e, OSError):
                raise gone from e
            raise
        for fd in (self._ns_fd, self._root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._root_fd, self._ns_fd = root_fd, ns_fd
        st = os.fstat(ns_fd)
        self._ns_id = (st.st_dev, st.st_ino)
        try:
            self._reload()
        except FileNotFoundError as e:  # the index log is not there yet
            self._log_ino = 0
            self._index = Index()
            self._unmap_all()
            raise gone from e

    def _unmap_all(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()

    def _arena(self, aid: int) -> Arena:
        arena = self._arenas.get(aid)
        if arena is None:
            arena = self._arenas[aid] = Arena.open_readonly(self._ns_fd, aid)
        return arena

    # ------------------------------------------------------------ read
    def num_present(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first on, have an object in the
        store now (any version)."""
        try:
            self._refresh()
        except OSError as e:
            raise StoreIOError(
                f"reading artifact store {self._namespace} failed: {e}"
            ) from e
        finally:
            self._let_go_if_tight()
        current = self._index.current
        return next((i for i, k in enumerate(keys) if k not in current), len(keys))

    def read_into(
        self,
        keys: Sequence[str],
        checksums: np.ndarray,
        out: np.ndarray,
        spans: np.ndarray,
        *,
        trailer_nbytes: int = 0,
        check: CheckFn | None = None,
    ) -> None:
        """See :meth:`ObjectStoreReader.read_into`."""
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.ndim != 1
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError("out must be a writable 1-D C-contiguous uint8 array")
        checksums = np.asarray(checksums, np.uint64)
        spans = np.asarray(spans, np.int64).reshape(len(keys), 3)
        if checksums.shape != (len(keys),):
            raise ValueError("one checksum per key")
        try:
            self._refresh()
            for attempt in range(3):
                try:
                    return self._read_once(
                        keys, checksums, out, spans, trailer_nbytes, check
                    )
                except FileNotFoundError:
                    # An arena was evicted after the index was read: the log
                    # now says where its retained objects went.
                    if attempt == 2:
                        raise
                    self._refresh()
        except OSError as e:
            raise StoreIOError(
                f"reading artifact store {self._namespace} failed: {e}"
            ) from e
        finally:
            self._let_go_if_tight()

    def _let_go_if_tight(self) -> None:
        """See the module docs: on a tight ``/dev/shm``, unmap the arenas
        (all but the newest :data:`KEEP_MAPPED_WHEN_TIGHT`) and close the
        log, so that nothing the writer evicts or replaces stays allocated."""
        for a in self._arenas.values():
            self._arena_size = max(self._arena_size, a.size)
        if not self._arena_size or (not self._arenas and self._log_fd < 0):
            return
        if free_bytes(self._root) >= TIGHT_ARENAS * self._arena_size:
            return
        keep = sorted(self._arenas)[len(self._arenas) - KEEP_MAPPED_WHEN_TIGHT :]
        for aid in sorted(self._arenas):
            if aid not in keep:
                self._arenas.pop(aid).close()
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1

    def _locate(self, keys: Sequence[str], checksums: np.ndarray) -> np.ndarray:
        """Slots of the exact versions, or the typed error for the first
        one that is missing."""
        idx = self._index
        try:  # the common case: every key's current version is wanted
            slots = np.fromiter(map(idx.current.__getitem__, keys), np.int64, len(keys))
            if (idx.cs[slots] == checksums).all():
                return slots
        except KeyError:
            pass
        found = []
        for key, cs in zip(keys, checksums.tolist()):
            s = idx.find(key, cs)
            if s is None:
                raise ObjectMissingError(
                    f"version {cs:#x} of artifact object {key} is missing from "
                    f"store {self._namespace} (evicted while not retained, or "
                    "never published)"
                )
            found.append(s)
        return np.array(found, np.int64)

    def _read_once(
        self,
        keys: Sequence[str],
        checksums: np.ndarray,
        out: np.ndarray,
        spans: np.ndarray,
        trailer_nbytes: int,
        check: CheckFn | None,
    ) -> None:
        n = len(keys)
        if n == 0:
            return
        idx = self._index
        slots = self._locate(keys, checksums)
        aids = idx.arena[slots]
        offs, lens = idx.off[slots], idx.length[slots]
        src, nbytes, dst = spans[:, 0], spans[:, 1], spans[:, 2]
        if (
            (src < 0).any()
            or (nbytes < 0).any()
            or (src + nbytes > lens).any()
            or (dst < 0).any()
            or (dst + nbytes > out.shape[0]).any()
            or trailer_nbytes > int(lens.min())
        ):
            raise ObjectSizeError("a read span lies outside its object or the output")
        arena_of = {aid: self._arena(aid) for aid in np.unique(aids).tolist()}
        ends = offs + lens
        for aid, arena in arena_of.items():
            if int(ends[aids == aid].max()) > arena.size:
                raise ChecksumMismatchError(
                    f"artifact arena {aid:016x} in store {self._namespace} is "
                    "shorter than its index says"
                )
        views = [arena_of[a].mv for a in aids.tolist()]
        offs_l, ends_l = offs.tolist(), ends.tolist()
        # Pass 1: every checksum, before anything is copied.
        for i, (mv, o, e, want) in enumerate(
            zip(views, offs_l, ends_l, checksums.tolist())
        ):
            if checksum(mv[o:e]) != want:
                self.checksum_failures += 1
                raise ChecksumMismatchError(
                    f"artifact object {keys[i]} in store {self._namespace} "
                    "failed its checksum (its bytes were changed after "
                    "publication)"
                )
        if check is not None:
            trailers = np.empty((n, trailer_nbytes), np.uint8)
            cols = np.arange(-trailer_nbytes, 0)
            for aid, arena in arena_of.items():
                sel = np.flatnonzero(aids == aid)
                trailers[sel] = arena.arr[ends[sel, None] + cols]
            check(trailers, lens)
        # Pass 2: the copies. Objects published back to back in one batch
        # (a prefill chunk) whose spans line up form a run copied with one
        # strided numpy copy: 0.5 ms instead of 1.5 ms of per-object copies
        # for a 32k-token request (docs/benchmarks.md, artifact core).
        omv = out.data
        src_l, nb_l, dst_l = src.tolist(), nbytes.tolist(), dst.tolist()
        joins = np.zeros(n, np.bool_)
        joins[1:] = (
            (aids[1:] == aids[:-1])
            & (offs[1:] == ends[:-1])
            & (lens[1:] == lens[:-1])
            & (src[1:] == src[:-1])
            & (nbytes[1:] == nbytes[:-1])
            & (dst[1:] == dst[:-1] + nbytes[:-1])
        )
        run_starts = np.flatnonzero(~joins).tolist()
        for i, j in zip(run_starts, run_starts[1:] + [n]):
            o, s, b, d = offs_l[i], src_l[i], nb_l[i], dst_l[i]
            if j - i == 1:
                omv[d : d + b] = views[i][o + s : o + s + b]
                continue
            size = int(lens[i])
            rows = (
                arena_of[int(aids[i])].arr[o : o + (j - i) * size].reshape(j - i, size)
            )
            out[d : d + (j - i) * b].reshape(j - i, b)[...] = rows[:, s : s + b]

    def close(self) -> None:
        self._unmap_all()
        for attr in ("_log_fd", "_ns_fd", "_root_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)
