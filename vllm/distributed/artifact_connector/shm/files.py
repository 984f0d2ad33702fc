# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A store's directory and its two files under the root: the writer record
(``writer.json``) and the index log (``index.log``). Created 0700/0600
through descriptors (never following a symlink), appended to, and removed
on close; a namespace that exists already is taken over only when its
writer is proven gone (``collect.collect_store``)."""

from __future__ import annotations

import contextlib
import os

from vllm.distributed.artifact_connector.shm import log
from vllm.distributed.artifact_connector.shm.collect import (
    INDEX_FILE,
    WRITER_FILE,
    WriterIdentity,
    collect_store,
    remove_namespace,
)
from vllm.distributed.artifact_connector.shm.space import (
    NO_SPACE,
    log_reserve_bytes,
    page_end,
    reserve_log,
)
from vllm.distributed.artifact_connector.store import (
    StoreCapacityError,
    StoreIOError,
    UnsafeStoreError,
)
from vllm.logger import init_logger
from vllm_host_transport.safe_fs import (
    ensure_private_shm_dir,
    open_private_dir,
    open_private_file,
    write_all,
)

logger = init_logger(__name__)


def io_error(e: OSError, what: str) -> Exception:
    """The typed error for a failed write: a full file system is a capacity
    error, anything else an I/O error."""
    if e.errno in NO_SPACE:
        return StoreCapacityError(
            f"{what} failed: /dev/shm is full ({e}); free space there or lower "
            "the artifact store capacity"
        )
    return StoreIOError(f"{what} failed: {e}")


class StoreFiles:
    """The open descriptors of one store: its root, its directory, the
    writer record and the index log (with the bytes each takes; the log
    also keeps pages allocated beyond its end, see ``space``)."""

    def __init__(
        self, root_arg: str, root: str, namespace: str, arena_bytes: int
    ) -> None:
        self.root_arg = root_arg  # as configured; ``root`` is its real path
        self.root = root
        self.namespace = namespace
        self.root_fd = self.ns_fd = self.log_fd = self.writer_fd = -1
        self.log_size = self.record_bytes = 0
        self.log_reserved = 0  # the log's pages are allocated up to here
        # Kept allocated beyond the log's end; an ordinary append leaves at
        # least half of it (an eviction's records: 64 bytes each).
        self.log_reserve = log_reserve_bytes(arena_bytes)
        # The most an append of n bytes grows the log's allocation by, past
        # n (the writer makes that room in capacity first).
        self.log_headroom = page_end(self.log_reserve) + page_end(1)

    @property
    def log_bytes(self) -> int:
        """What the index log occupies, its reserved pages included."""
        return max(self.log_size, self.log_reserved)

    def create(self, ttl_s: float) -> int:
        """Create the directory and files (at start, and again after they
        were removed behind the writer). Returns how many stale stores of
        this namespace were removed first (0 or 1). On failure nothing of
        it is left."""
        root, namespace = self.root_arg, self.namespace
        collected = 0
        for attempt in range(3):
            try:
                self.root_fd = open_private_dir(self.root, error=UnsafeStoreError)
            except FileNotFoundError:
                # Another engine removed the (empty) root as it closed.
                self.root = ensure_private_shm_dir(root, error=UnsafeStoreError)
                continue
            except OSError as e:
                raise io_error(e, f"opening the artifact store root {root}") from e
            try:
                os.mkdir(namespace, 0o700, dir_fd=self.root_fd)
                break
            except FileExistsError as e:
                # Namespaces are fresh per engine instance, so this is a
                # store of an earlier writer of the same instance. Take its
                # place only if that writer is proven gone (as any stale
                # store is collected); never share a store with a live one.
                state, _ = collect_store(self.root_fd, namespace, ttl_s)
                os.close(self.root_fd)
                self.root_fd = -1
                if state == "removed" and attempt < 2:
                    collected += 1
                    logger.warning(
                        "artifact store: removed a stale store of a dead "
                        "writer with this engine's namespace %s",
                        namespace,
                    )
                    continue
                why = {
                    "alive": "its writer is still running",
                    "recent": "its writer cannot be checked and it was active "
                    "within the inactive TTL",
                }.get(state, "it cannot be removed")
                raise UnsafeStoreError(
                    f"artifact namespace {namespace} already exists under "
                    f"{self.root} and {why}; namespaces are per engine "
                    "instance and fresh"
                ) from e
            except FileNotFoundError as e:
                # The root was removed between opening and mkdir: again.
                os.close(self.root_fd)
                self.root_fd = -1
                if attempt == 2:
                    raise io_error(e, f"creating artifact store {namespace}") from e
                self.root = ensure_private_shm_dir(root, error=UnsafeStoreError)
        else:
            raise StoreIOError(
                f"creating artifact store {namespace} under {root} failed: the "
                "root kept disappearing"
            )
        try:
            self.ns_fd = open_private_dir(
                namespace, dir_fd=self.root_fd, error=UnsafeStoreError
            )
            create = os.O_RDWR | os.O_CREAT | os.O_EXCL
            self.writer_fd = open_private_file(
                WRITER_FILE, self.ns_fd, create, "writer record", error=UnsafeStoreError
            )
            self.record_bytes = write_all(
                self.writer_fd, [WriterIdentity.current().to_json()], 0
            )
            self.log_fd = open_private_file(
                INDEX_FILE, self.ns_fd, create, "index log", error=UnsafeStoreError
            )
            self.log_size = write_all(self.log_fd, [log.header_bytes()], 0)
            self.log_reserved = page_end(self.log_size)  # its page is taken
        except OSError as e:
            self.release()
            raise io_error(e, f"creating artifact store {namespace}") from e
        except BaseException:
            self.release()
            raise
        return collected

    def append_log(self, data: bytes, *, evicting: bool = False) -> None:
        """Append ``data``. An ordinary append first makes sure that half
        of ``log_reserve`` stays reserved beyond it (growing the reservation,
        which fails when the file system is full); an eviction's append
        (``evicting``) spends that spare instead."""
        end = self.log_size + len(data)
        spare = 0 if evicting else self.log_reserve // 2
        if end + spare > self.log_reserved:
            want = page_end(end + self.log_reserve)
            try:
                if reserve_log(self.log_fd, self.log_size, want - self.log_size):
                    self.log_reserved = want
            except OSError as e:
                # An eviction may spend the spare; an ordinary append leaves
                # it for the eviction that will make room.
                if not evicting or end > self.log_reserved:
                    raise io_error(
                        e, "reserving room for the artifact index log"
                    ) from e
        try:
            write_all(self.log_fd, [data], self.log_size)
        except OSError as e:
            raise io_error(e, "appending to the artifact index log") from e
        self.log_size = end

    def replace_log(self, tmp: str, data: list[bytes]) -> bool:
        """Write a compacted log (``data``) to the fresh file ``tmp`` and
        rename it over the index log (readers notice the new inode and
        reload). Returns False, with a warning, when that fails."""
        fd = open_private_file(
            tmp,
            self.ns_fd,
            os.O_RDWR | os.O_CREAT | os.O_EXCL,
            "index snapshot",
            error=UnsafeStoreError,
        )
        try:
            size = write_all(fd, data, 0)
            os.rename(tmp, INDEX_FILE, src_dir_fd=self.ns_fd, dst_dir_fd=self.ns_fd)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.ns_fd)
            logger.warning("artifact store: log compaction failed: %s", e)
            return False
        os.close(self.log_fd)
        self.log_fd, self.log_size = fd, size
        self.log_reserved = page_end(size)  # the next append reserves again
        return True

    def touch(self) -> None:
        """Refresh the writer record's mtime (the heartbeat of collectors
        that cannot check this process's liveness)."""
        with contextlib.suppress(OSError):
            os.utime(self.writer_fd)

    def release(self, *, rmdir_root: bool = True) -> None:
        """Close every descriptor and delete this store's directory;
        ``rmdir_root`` also removes the root when no other store is in it."""
        for fd in (self.log_fd, self.writer_fd, self.ns_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.log_fd = self.writer_fd = self.ns_fd = -1
        self.log_size = self.record_bytes = self.log_reserved = 0
        if self.root_fd >= 0:
            remove_namespace(self.root_fd, self.namespace)
            os.close(self.root_fd)
            self.root_fd = -1
            # Leave nothing behind on a clean shutdown: the root goes too
            # when no other store is in it (a writer starting meanwhile
            # recreates it).
            if rmdir_root:
                with contextlib.suppress(OSError):
                    os.rmdir(self.root)
