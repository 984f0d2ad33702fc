# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Commands that run with a small ``/dev/shm`` of their own: a tmpfs
mounted over ``/dev/shm`` in a private mount namespace (``unshare``), so
every process the command starts shares that one small ``/dev/shm`` and
nothing outside it sees or keeps it (the mount goes with the namespace's
last process)."""

from __future__ import annotations

import shlex
import subprocess

import pytest


def small_shm_argv(size: str, command: str) -> list[str]:
    """argv running the shell ``command`` with a ``/dev/shm`` of ``size``
    (``mount``'s syntax, e.g. ``768k``)."""
    script = (
        f"mount -t tmpfs -o size={shlex.quote(size)},mode=1777 tmpfs /dev/shm "
        f"&& exec {command}"
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def run_python_in_small_shm(size: str, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in this interpreter with a ``/dev/shm`` of ``size`` and
    no scope from the environment; its output captured as text."""
    import os
    import sys

    return subprocess.run(
        small_shm_argv(size, f"{sys.executable} -c {shlex.quote(code)}"),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_HOST_TRANSPORT_SCOPE": ""},
    )


def skip_unless_private_shm() -> None:
    """Skip the test where a mount namespace with its own tmpfs cannot be
    made (not root, no unshare, a container without CAP_SYS_ADMIN)."""
    try:
        r = subprocess.run(
            small_shm_argv("64k", "test -w /dev/shm"),
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot make a private /dev/shm here: {e}")
    if r.returncode:
        pytest.skip(
            "cannot make a private /dev/shm here (unshare --mount and a tmpfs "
            f"mount need root or CAP_SYS_ADMIN): {r.stderr.strip()[:300]}"
        )
