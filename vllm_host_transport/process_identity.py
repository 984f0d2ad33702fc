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
"""

from __future__ import annotations

import os
import select


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
    """

    def __init__(self, pid: int, start_ticks: int) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self._pidfd: int | None = None
        self._poll: select.poll | None = None
        self._dead = False
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
