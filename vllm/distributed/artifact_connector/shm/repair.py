# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Noticing a store damaged behind its writer (an operator's ``rm``, a
clean-up of ``/dev/shm``, a file put in the directory's place).

The writer's upkeep asks at most every :data:`STORE_CHECK_INTERVAL_S`: if
the directory, the index log or the writer record is gone or replaced, the
writer recreates the store, empty, at the same place (readers follow: they
reopen the namespace); if only arenas are gone, it retires them, copying
their retained objects out of its own mapping first. The routes a damaged
store held are lost: requests that need them fail with a typed error, later
requests are served again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from vllm.distributed.artifact_connector.shm.arena import arena_name
from vllm.distributed.artifact_connector.shm.files import StoreFiles
from vllm.logger import init_logger

logger = init_logger(__name__)

#: How often upkeep checks that the store's files are still in place.
STORE_CHECK_INTERVAL_S = 0.1
#: How often a store that cannot be recreated says so again in the log.
BROKEN_LOG_INTERVAL_S = 10.0


def files_in_place(files: StoreFiles) -> bool:
    """Whether the root, the store's directory, its index log and its writer
    record are the very ones the writer created."""
    try:
        ns = os.fstat(files.ns_fd)
        if any(os.fstat(fd).st_nlink == 0 for fd in (files.log_fd, files.writer_fd)):
            return False
        root = os.fstat(files.root_fd)
        root_now = os.stat(files.root, follow_symlinks=False)
        ns_now = os.stat(files.namespace, dir_fd=files.root_fd, follow_symlinks=False)
    except OSError:
        return False
    return (
        ns.st_nlink > 0
        and (root_now.st_dev, root_now.st_ino) == (root.st_dev, root.st_ino)
        and (ns_now.st_dev, ns_now.st_ino) == (ns.st_dev, ns.st_ino)
    )


def lost_arenas(files: StoreFiles, aids: Iterable[int]) -> list[int]:
    """The arenas among ``aids`` whose files were deleted."""
    lost = []
    for aid in aids:
        try:
            os.stat(arena_name(aid), dir_fd=files.ns_fd, follow_symlinks=False)
        except FileNotFoundError:
            lost.append(aid)
        except OSError:
            continue
    return lost


class RepairState:
    """When to check next, and whether (and why) the store could not be
    recreated, with its error logged at most every
    :data:`BROKEN_LOG_INTERVAL_S`."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self.last_check = 0.0
        self._last_broken_log = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last_check < STORE_CHECK_INTERVAL_S:
            return False
        self.last_check = now
        return True

    def recreating(self, files: StoreFiles) -> None:
        if self.broken is None:
            logger.error(
                "artifact store %s under %s was removed or replaced behind the "
                "engine; recreating it empty (the routes it held are lost: "
                "requests that need them fail with a typed error)",
                files.namespace,
                files.root,
            )

    def failed(self, files: StoreFiles, error: BaseException) -> None:
        now = time.monotonic()
        if self.broken is None or now - self._last_broken_log >= BROKEN_LOG_INTERVAL_S:
            logger.error(
                "artifact store %s cannot be recreated under %s: %s; "
                "publication fails until it can",
                files.namespace,
                files.root,
                error,
            )
            self._last_broken_log = now
        self.broken = str(error)

    def recreated(self, files: StoreFiles) -> None:
        if self.broken is not None:
            logger.warning("artifact store %s recreated", files.namespace)
        self.broken = None
