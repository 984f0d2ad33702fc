# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether a Mooncake master answers, asked without risking this process.

Mooncake's client ``setup`` and ``close`` hold Python's interpreter lock for
as long as they run, and against a master that is frozen (``SIGSTOP``, a
paused VM or container) or unreachable that is until it resumes or for
about 90 s: every thread of the process stops, a serving engine's step loop
and a trainer's data loaders included (docs/benchmarks.md, "Which Mooncake
calls hold the interpreter lock"). A TCP connect proves nothing (the kernel
accepts for a stopped process). So before either call, :func:`probe` has a
short-lived child process join the master and make one RPC (an existence
query of a random key); the child is killed at the deadline. Only a master
that answered just now is joined or left in this process.

Needs neither vLLM nor torch (the trainer's side imports it); the child
needs Mooncake's client.
"""

from __future__ import annotations

import subprocess
import sys

#: The longest an engine waits for a master to answer when it joins or
#: leaves it (a child joins and asks once: 0.1-0.2 s against a healthy
#: master on loopback).
PROBE_TIMEOUT_S = 5.0

_CHILD = """
import os, secrets, sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup(sys.argv[1], "P2PHANDSHAKE", 0, 0, sys.argv[2], "", sys.argv[3])
if rc == 0:
    rc = store.is_exist("probe-" + secrets.token_hex(8))
    rc = 0 if rc in (0, 1) else rc
print(rc, flush=True)
os._exit(0)  # no close: the parent only needs the answer
"""


def probe(
    master: str,
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
    protocol: str = "tcp",
    local_hostname: str = "127.0.0.1",
) -> str | None:
    """``None`` when ``master`` answered a join and one RPC within
    ``timeout_s``; otherwise why not (a sentence). Waits in this process
    without holding the interpreter lock."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, local_hostname, protocol, master],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return (
            f"the Mooncake master {master} did not answer within {timeout_s:g} s "
            "(frozen, overloaded or unreachable)"
        )
    except OSError as e:
        return f"cannot start a probe of the Mooncake master {master}: {e}"
    answer = done.stdout.decode(errors="replace").strip()
    if done.returncode != 0 or not answer:
        return (
            f"a probe of the Mooncake master {master} failed (exit status "
            f"{done.returncode}; is Mooncake's client installed?)"
        )
    if answer != "0":
        return f"the Mooncake master {master} refused a probe (error {answer})"
    return None
