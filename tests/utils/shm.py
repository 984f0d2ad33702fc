# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A small tmpfs under /dev/shm: a ``/dev/shm`` that can really be full."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[str]:
    """Mount a tmpfs of ``size`` (``mount``'s syntax, e.g. ``2m``) at a new
    directory under /dev/shm and yield its path; unmounted and removed
    afterwards. The leak guard attributes it to this session (pid in the
    name). Skips the test where mounting is not allowed (not root)."""
    mnt = f"/dev/shm/vart-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(mnt, 0o700)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", mnt],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a tmpfs under /dev/shm here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)
