# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What killed producers left in a scope, found by process identity and
removed by whoever looks next.

A sending connector registers itself in its scope with an empty file
``member-<pid>-<start>-<instance>-<pid namespace>-<boot>`` before its first
payload (a ring names the same identity). A producer that closes withdraws
its payloads and its registration; a killed one leaves them, and nothing
else would ever remove them while any other connector keeps the scope open.
:class:`Liveness`
watches the scope's producers (a pidfd each, see
:mod:`.process_identity`) and, once one of them is gone, removes its rings,
its per-key segments, its half-written files and then its registration. It
runs when a connector joins the scope, on every receive that misses, and
when the owner asks (:meth:`HostTransportConnector.remove_dead`).

Only producers that this process can check are judged: those of its own
PID namespace and boot (see :meth:`.discovery.ProducerId.judge`). A producer
of another PID namespace (another container sharing ``/dev/shm``) is swept
from here only once its registration is older than the TTL
(``HostTransportConfig.foreign_producer_ttl_s``; a running producer
refreshes it); a producer of another boot is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

from vllm_host_transport import perkey, readmany
from vllm_host_transport.discovery import (
    ORIGIN_RE,
    RING_NAME_RE,
    HostTransportError,
    ProducerId,
    ScopeDir,
)
from vllm_host_transport.process_identity import ProcessWatch

MEMBER_RE = re.compile(
    r"^member-([0-9]{1,10})-([0-9]{1,20})-([0-9a-f]{16})-" + ORIGIN_RE + "$"
)
# A per-key segment being written: ``.tmp-<h>-<producer token>``
# (perkey.write_segment).
_SEG_TMP_RE = re.compile(
    r"^\.tmp-[0-9a-f]{32}-([0-9]{1,10})-([0-9]{1,20})-" + ORIGIN_RE + "$"
)


def member_name(producer: ProducerId, instance: int) -> str:
    return f"member-{producer.pid}-{producer.start}-{instance:016x}-{producer.origin}"


def _producer(name: str) -> ProducerId | None:
    """The producer a registration, a ring (built or being built) or a
    segment being written names, else None."""
    m = MEMBER_RE.match(name)
    if m is not None:
        return ProducerId.parse(m.group(1), m.group(2), m.group(4), m.group(5))
    m = RING_NAME_RE.match(name[5:] if name.startswith(".tmp-") else name)
    if m is not None:
        return ProducerId.parse(m.group(2), m.group(3), m.group(5), m.group(6))
    m = _SEG_TMP_RE.match(name)
    if m is not None:
        return ProducerId.parse(*m.groups())
    return None


def _remove_readable(fd: int, name: str) -> bool:
    try:
        return readmany.remove_object(fd, name, 0.0)
    except (OSError, HostTransportError):
        return False


class Liveness:
    """The producers of one scope, other than this process, and the removal
    of what the dead ones left. Thread-safe; never waits on another thread
    or process (a busy lock skips, the next look retries)."""

    def __init__(
        self,
        scope: ScopeDir,
        own: ProducerId,
        stats: dict[str, int],
        foreign_ttl_s: float = 3600.0,
    ) -> None:
        self._scope: ScopeDir | None = scope
        self._own = own
        self._stats = stats
        self._lock = threading.Lock()
        self._seen_stamp = -1
        self._watches: dict[ProducerId, ProcessWatch] = {}
        # Producers this process cannot check (another PID namespace), and
        # when their registrations' age is looked at next.
        self._unknowable: set[ProducerId] = set()
        self._foreign_ttl_s = foreign_ttl_s
        self._next_age_look = 0.0

    def check(self) -> int:
        """Remove what producers that died since the last look left; returns
        how many such producers there were. Cheap while nothing changed: a
        read of the stamp and one pidfd poll per producer."""
        if not self._lock.acquire(blocking=False):
            return 0  # another thread of this process is looking
        try:
            scope = self._scope
            if scope is None:
                return 0
            # Registrations and retirements move the stamp: read it before
            # the listing, so a change during the listing is seen next time.
            stamp = scope.read_stamp()
            if stamp != self._seen_stamp:
                self._refresh(scope)
                self._seen_stamp = stamp
            dead = {p for p, w in self._watches.items() if not w.alive()}
            if self._unknowable and time.monotonic() >= self._next_age_look:
                dead |= self._expired_foreign(scope)
            if dead:
                self._sweep(scope, dead)
            return len(dead)
        except OSError:
            return 0  # the scope cannot be listed now; the next look retries
        finally:
            self._lock.release()

    def _refresh(self, scope: ScopeDir) -> None:
        found = {p for n in os.listdir(scope.fd) if (p := _producer(n)) is not None}
        found.discard(self._own)
        self._unknowable &= found
        for p in self._watches.keys() - found:
            self._watches.pop(p).close()
        for p in found - self._watches.keys() - self._unknowable:
            watch = p.watch()
            if watch is None:
                self._unknowable.add(p)
            else:
                self._watches[p] = watch

    def _expired_foreign(self, scope: ScopeDir) -> set[ProducerId]:
        """Producers of another PID namespace whose registration has not
        been refreshed for the TTL (at most one look a tenth of the TTL)."""
        self._next_age_look = time.monotonic() + self._foreign_ttl_s / 10
        oldest = time.time() - self._foreign_ttl_s
        expired = set()
        for name in os.listdir(scope.fd):
            p = _producer(name)
            if p not in self._unknowable or not name.startswith("member-"):
                continue
            try:
                st = os.stat(name, dir_fd=scope.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_mtime < oldest:
                expired.add(p)
        self._unknowable -= expired
        return expired

    def _sweep(self, scope: ScopeDir, dead: set[ProducerId]) -> None:
        fd = scope.fd
        members = []
        segments = readables = 0
        for name in os.listdir(fd):
            p = _producer(name)
            if p is not None:
                if p not in dead:
                    continue
                if name.startswith("member-"):
                    members.append(name)  # last: the registration says "look"
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
            elif (
                # The lock is only tried: a receiver holding it discards the
                # segment itself (its producer is dead).
                name.endswith(".seg")
                and perkey.segment_producer(fd, name) in dead
                and perkey.remove_segment(fd, name[:-4], 0.0) is True
            ):
                segments += 1
            elif (
                # Only tried, as above: a reader releasing it holds the lock
                # for a few calls; the next sweep retries.
                name.endswith(readmany.SUFFIX)
                and readmany.object_producer(fd, name) in dead
                and _remove_readable(fd, name)
            ):
                readables += 1
        for name in members:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        for p in dead:
            watch = self._watches.pop(p, None)
            if watch is not None:
                watch.close()
        # Receivers with a dead ring mapped drop it at their next discovery.
        with contextlib.suppress(OSError, HostTransportError):
            scope.advance_stamp(wait=False)
        self._stats["dead_producers_swept"] += len(dead)
        self._stats["dead_segments_removed"] += segments
        self._stats["dead_readables_removed"] += readables

    def close(self, wait: bool = True) -> None:
        """Stop looking. ``wait``: for a look in progress, as the scope's
        descriptor is closed next; a forked child passes False (a parent
        thread may have held the lock at the fork, and the child never
        looks)."""
        if wait:
            with self._lock:
                self._drop()
        else:
            self._drop()

    def _drop(self) -> None:
        self._scope = None
        self._unknowable = set()
        watches, self._watches = self._watches, {}
        for w in watches.values():
            w.close()
