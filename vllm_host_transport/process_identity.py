# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Identify a process across pid reuse, and tell whether it still runs.

Shared by the same-node stores (artifact connector, host transport): a writer
or producer is named by its pid plus its start time (clock ticks since boot,
``/proc/<pid>/stat`` field 22), so a restarted process that got the same pid
is never mistaken for the original. Where the kernel offers pidfds, a watch
holds one: it refers to exactly the process it was opened for and becomes
readable when that process exits, so a liveness check is one ``poll`` with no
``/proc`` read. Linux only.

A pid and a start time mean something only in the PID namespace they were
read in, and only during the boot they were read in: a process of another
namespace (another container sharing ``/dev/shm``) is named by a pid this
process may not see, or sees as another process. So an identity also
records its boot and its PID namespace (:func:`boot_id`,
:func:`pid_namespace`), and :func:`judge_origin` says whether a process of
that origin can be checked here at all. One that cannot is never taken for
dead: what it left goes by a TTL, or when a process of its own namespace
looks.
"""

from __future__ import annotations

import hashlib
import os
import select

_boot_id: str | None = None
_pid_ns: tuple[int, int] = (-1, 0)  # (pid it was read in, namespace inode)


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``), "" if unknown."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
        except OSError:
            _boot_id = ""
    return _boot_id


def boot_tag() -> str:
    """A 16-hex digest of :func:`boot_id` (fits in a file name), "" if the
    boot id is unknown."""
    boot = boot_id()
    if not boot:
        return ""
    return hashlib.blake2b(boot.encode(), digest_size=8).hexdigest()


def pid_namespace() -> int:
    """Inode of this process's PID namespace, 0 when it cannot be read or
    when ``/proc`` is not this namespace's (mounted for another one: pids
    read there would name other processes)."""
    global _pid_ns
    pid = os.getpid()
    if _pid_ns[0] != pid:  # a forked child may be in a new namespace
        ns = 0
        try:
            if os.readlink("/proc/self") == str(pid):
                ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ns = 0
        _pid_ns = (pid, ns)
    return _pid_ns[1]


def judge_origin(same_boot: bool, pid_ns: int) -> bool | None:
    """Whether a process recorded in PID namespace ``pid_ns`` (of this boot
    when ``same_boot``) can be checked from here: False when it is proven
    gone (another boot), None when this process cannot tell (another or an
    unknown namespace: its pid means nothing here), True when its pid and
    start time decide."""
    if not same_boot:
        return False
    own = pid_namespace()
    if pid_ns == 0 or own == 0 or pid_ns != own:
        return None
    return True


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, ``None`` if it is gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


class ProcessWatch:
    """Whether the process ``(pid, start_ticks)`` is alive; cheap to re-check.

    Once it reports the process dead it never reports it alive again. Call
    :meth:`close` (or use it as a context manager) to release the pidfd.
    ``gone``: the process is already known to be dead (another boot).
    """

    def __init__(self, pid: int, start_ticks: int, gone: bool = False) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self._pidfd: int | None = None
        self._poll: select.poll | None = None
        self._dead = gone
        if gone:
            return
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                self._pidfd = pidfd_open(pid)
            except ProcessLookupError:
                self._dead = True
                return
            except OSError:
                self._pidfd = None  # e.g. another pid namespace: fall back
        # Verify the identity after opening the pidfd, so the pidfd cannot
        # name a newer process that reused the pid.
        if process_start_ticks(pid) != start_ticks:
            self._dead = True
            self.close()
            return
        if self._pidfd is not None:
            self._poll = select.poll()
            self._poll.register(self._pidfd, select.POLLIN)

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._poll is not None:
            if self._poll.poll(0):
                self._dead = True
                self.close()
        elif process_start_ticks(self.pid) != self.start_ticks:
            self._dead = True
        return not self._dead

    def close(self) -> None:
        fd, self._pidfd = self._pidfd, None
        self._poll = None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> ProcessWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
