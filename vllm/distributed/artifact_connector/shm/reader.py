# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reading side of a ``/dev/shm`` store (any process of its user).

A reader rebuilds the index from the log and extends it with each new batch
before a read; it maps arenas read-only, once, and drops a mapping when the
log retires the arena. A read resolves exact versions, verifies every
object's checksum over the mapped bytes, lets the caller check the objects'
trailers, and only then copies: a failed read leaves the caller's buffer
untouched. Values leave the store, never paths or mappings.
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
from vllm.distributed.artifact_connector.store import (
    CheckFn,
    ChecksumMismatchError,
    ObjectMissingError,
    ObjectRef,
    ObjectSizeError,
    ObjectStoreReader,
    StoreClosedError,
    UnsafeStoreError,
    checksum,
)
from vllm.distributed.safe_fs import open_private_dir, open_private_file, shm_subdir


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
        self._arenas: dict[int, Arena] = {}
        self._index = Index()
        self._log_pos = 0
        self._log_ino = 0
        self.checksum_failures = 0
        real = shm_subdir(root, error=UnsafeStoreError)
        try:
            self._root_fd = open_private_dir(real, error=UnsafeStoreError)
            self._ns_fd = open_private_dir(
                namespace, dir_fd=self._root_fd, error=UnsafeStoreError
            )
            self._reload()
        except FileNotFoundError as e:
            self.close()
            raise StoreClosedError(
                f"artifact store {namespace} does not exist under {real}"
            ) from e
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
        try:
            st = os.stat(INDEX_FILE, dir_fd=self._ns_fd, follow_symlinks=False)
        except FileNotFoundError as e:
            raise StoreClosedError(
                f"artifact store {self._namespace} no longer exists (its writer "
                "closed it, or it was collected)"
            ) from e
        if st.st_ino != self._log_ino:
            self._reload()
        else:
            self._read_tail()

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
    def read_into(
        self,
        refs: Sequence[ObjectRef],
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
        spans = np.asarray(spans, np.int64).reshape(len(refs), 3)
        self._refresh()
        for attempt in range(3):
            try:
                return self._read_once(refs, out, spans, trailer_nbytes, check)
            except FileNotFoundError:
                # An arena was evicted after the index was read: the log now
                # says where its retained objects went.
                if attempt == 2:
                    raise
                self._refresh()

    def _locate(self, refs: Sequence[ObjectRef]) -> tuple[np.ndarray, list[Arena]]:
        idx = self._index
        found = idx.slots_of(refs)
        for ref, s in zip(refs, found):
            if s is None:
                raise ObjectMissingError(
                    f"version {ref.checksum:#x} of artifact object {ref.key} is "
                    f"missing from store {self._namespace} (evicted while not "
                    "retained, or never published)"
                )
        slots = np.fromiter(found, np.int64, len(found))
        lens = idx.length[slots]
        want = np.fromiter((r.nbytes for r in refs), np.int64, len(refs))
        bad = lens != want
        if bad.any():
            i = int(np.argmax(bad))
            raise ObjectSizeError(
                f"artifact object {refs[i].key} has {int(lens[i])} bytes, its "
                f"reference says {int(want[i])}"
            )
        arenas = [self._arena(aid) for aid in idx.arena[slots].tolist()]
        return slots, arenas

    def _read_once(
        self,
        refs: Sequence[ObjectRef],
        out: np.ndarray,
        spans: np.ndarray,
        trailer_nbytes: int,
        check: CheckFn | None,
    ) -> None:
        n = len(refs)
        idx = self._index
        slots, arenas = self._locate(refs)
        offs, lens = idx.off[slots], idx.length[slots]
        src, nbytes, dst = spans[:, 0], spans[:, 1], spans[:, 2]
        if n and (
            (src < 0).any()
            or (nbytes < 0).any()
            or (src + nbytes > lens).any()
            or (dst < 0).any()
            or (dst + nbytes > out.shape[0]).any()
            or trailer_nbytes > int(lens.min())
        ):
            raise ObjectSizeError("a read span lies outside its object or the output")
        offs_l, ends_l = offs.tolist(), (offs + lens).tolist()
        for i, (arena, o, e) in enumerate(zip(arenas, offs_l, ends_l)):
            if e > arena.size or checksum(arena.mv[o:e]) != refs[i].checksum:
                self.checksum_failures += 1
                raise ChecksumMismatchError(
                    f"artifact object {refs[i].key} in store {self._namespace} "
                    "failed its checksum (its bytes were changed after "
                    "publication)"
                )
        if check is not None:
            trailers = np.empty((n, trailer_nbytes), np.uint8)
            for i, (arena, e) in enumerate(zip(arenas, ends_l)):
                trailers[i] = arena.arr[e - trailer_nbytes : e]
            check(trailers, lens)
        omv = out.data
        for arena, o, s, b, d in zip(
            arenas, offs_l, src.tolist(), nbytes.tolist(), dst.tolist()
        ):
            omv[d : d + b] = arena.mv[o + s : o + s + b]

    def close(self) -> None:
        self._unmap_all()
        for attr in ("_log_fd", "_ns_fd", "_root_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)
