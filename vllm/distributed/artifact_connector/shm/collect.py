# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Writer identity and the collection of stale stores.

Each store records its writer (``writer.json``: pid, process start time,
boot id, pid namespace). A store whose writer is proven gone (another boot,
or the pid no longer runs the process that created it) is collected at
once. A store whose writer cannot be checked (another pid namespace, or no
valid writer record yet) is collected only after it has been inactive for
the TTL; the writer refreshes the record's mtime while it runs. A store
whose writer runs is never collected, however idle. Only regular files we
own, with names a store creates, are deleted; anything else is left in
place and reported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.distributed.artifact_connector.store import UnsafeStoreError
from vllm.logger import init_logger
from vllm_host_transport.process_identity import (
    ProcessWatch,
    boot_id,
    judge_origin,
    pid_namespace,
    process_start_ticks,
)
from vllm_host_transport.safe_fs import open_private_dir, open_private_file, shm_subdir

logger = init_logger(__name__)

WRITER_FILE = "writer.json"
INDEX_FILE = "index.log"
NAMESPACE_RE = re.compile(r"[0-9a-f]{32}\Z")
_OUR_FILE_RE = re.compile(r"[0-9a-f]{16}\.(arena|tmp)\Z")


@dataclass(frozen=True)
class WriterIdentity:
    """Who writes a store: enough to tell whether that process still runs."""

    pid: int
    start_ticks: int
    boot_id: str
    pid_ns: int

    @classmethod
    def current(cls) -> WriterIdentity:
        pid = os.getpid()
        return cls(pid, process_start_ticks(pid) or 0, boot_id(), pid_namespace())

    def to_json(self) -> bytes:
        return json.dumps({"format": 2, **self.__dict__}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WriterIdentity:
        d = json.loads(raw)
        if not isinstance(d, dict) or d.get("format") != 2:
            raise ValueError("unknown writer record format")
        return cls(
            int(d["pid"]), int(d["start_ticks"]), str(d["boot_id"]), int(d["pid_ns"])
        )

    def is_alive(self) -> bool | None:
        """True if the writer runs, False if it is proven gone, None if this
        process cannot tell (another or an unknown pid namespace)."""
        own_boot = boot_id()
        same_boot = not (self.boot_id and own_boot) or self.boot_id == own_boot
        verdict = judge_origin(same_boot, self.pid_ns)
        if verdict is not True:
            return verdict
        with ProcessWatch(self.pid, self.start_ticks) as watch:
            return watch.alive()


def make_namespace(*parts: object) -> str:
    """A fresh namespace for one store (engine instance, DP rank): a digest
    of ``parts``, this process's identity and 16 random bytes."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode() + b"\x00")
    ident = WriterIdentity.current()
    h.update(f"{ident.pid}:{ident.start_ticks}:{ident.boot_id}".encode())
    h.update(os.urandom(16))
    return h.hexdigest()[:32]


def remove_namespace(root_fd: int, namespace: str) -> list[str]:
    """Remove the store files in ``namespace`` and the directory if that
    leaves it empty. Returns the entries left in place (not ours)."""
    refused: list[str] = []
    try:
        ns_fd = open_private_dir(namespace, dir_fd=root_fd, error=UnsafeStoreError)
    except (UnsafeStoreError, OSError):
        return [namespace]
    uid = os.geteuid()
    try:
        for name in os.listdir(ns_fd):
            try:
                st = os.stat(name, dir_fd=ns_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            ours = (
                stat.S_ISREG(st.st_mode)
                and st.st_uid == uid
                and (name in (WRITER_FILE, INDEX_FILE) or _OUR_FILE_RE.match(name))
            )
            if not ours:
                refused.append(f"{namespace}/{name}")
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=ns_fd)
    finally:
        os.close(ns_fd)
    if refused:
        logger.warning("artifact store: left entries that are not ours: %s", refused)
    else:
        with contextlib.suppress(OSError):
            os.rmdir(namespace, dir_fd=root_fd)
    return refused


@dataclass(frozen=True)
class CollectReport:
    """What :func:`collect_stale_stores` did."""

    removed: tuple[str, ...] = ()
    kept_alive: tuple[str, ...] = ()
    kept_recent: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()  # not ours, or unsafe: left alone


def _writer_state(ns_fd: int) -> tuple[bool | None, float]:
    """(writer alive?, seconds since the store's last sign of activity)."""
    alive: bool | None
    try:
        fd = open_private_file(WRITER_FILE, ns_fd, os.O_RDONLY, "writer record")
        try:
            alive = WriterIdentity.from_json(os.pread(fd, 1 << 16, 0)).is_alive()
        finally:
            os.close(fd)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        alive = None
    latest = os.fstat(ns_fd).st_mtime
    for name in (WRITER_FILE, INDEX_FILE):
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=ns_fd, follow_symlinks=False)
            latest = max(latest, st.st_mtime)
    return alive, time.time() - latest


def collect_store(
    root_fd: int, name: str, inactive_ttl_s: float
) -> tuple[str, list[str]]:
    """Decide on the one store ``name`` under ``root_fd`` and remove it if
    it is stale (see the module docs). Returns ``("removed", [])``,
    ``("alive", [])`` (its writer runs), ``("recent", [])`` (undecidable
    writer, active within the TTL) or ``("refused", entries left)``."""
    try:
        ns_fd = open_private_dir(name, dir_fd=root_fd, error=UnsafeStoreError)
    except (UnsafeStoreError, OSError):
        return "refused", [name]
    try:
        live, idle_s = _writer_state(ns_fd)
    finally:
        os.close(ns_fd)
    if live:
        return "alive", []
    if live is None and idle_s < inactive_ttl_s:
        return "recent", []
    left = remove_namespace(root_fd, name)
    return ("refused", left) if left else ("removed", [])


def collect_stale_stores(
    root: str, inactive_ttl_s: float, *, exclude: Iterable[str] = ()
) -> CollectReport:
    """Remove the stores under ``root`` whose writer is proven gone, and
    those whose writer cannot be checked once inactive for
    ``inactive_ttl_s`` seconds (see the module docs)."""
    real = shm_subdir(root, error=UnsafeStoreError)
    skip = set(exclude)
    removed, alive, recent, refused = [], [], [], []
    try:
        root_fd = open_private_dir(real, error=UnsafeStoreError)
    except FileNotFoundError:
        return CollectReport()
    uid = os.geteuid()
    try:
        for name in os.listdir(root_fd):
            if name in skip:
                continue
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (
                NAMESPACE_RE.match(name) is None
                or not stat.S_ISDIR(st.st_mode)
                or st.st_uid != uid
            ):
                refused.append(name)
                continue
            state, left = collect_store(root_fd, name, inactive_ttl_s)
            if state == "removed":
                removed.append(name)
            elif state == "alive":
                alive.append(name)
            elif state == "recent":
                recent.append(name)
            else:
                refused.extend(left)
    finally:
        os.close(root_fd)
    if removed:
        logger.info("artifact store: collected %d stale store(s)", len(removed))
    return CollectReport(tuple(removed), tuple(alive), tuple(recent), tuple(refused))
