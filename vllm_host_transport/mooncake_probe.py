# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether a Mooncake master answers, asked without risking this process;
and what Mooncake's error codes mean (:func:`describe_error`).

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
        try:
            why = describe_error(int(answer))
        except ValueError:
            why = repr(answer)
        return f"the Mooncake master {master} refused a probe: {why}"
    return None


# Mooncake's error codes (mooncake-store/include/types.h), as what they mean
# to a user: only the RPC failures say the master may be down.
_ERRORS = {
    -1: "Mooncake's internal error",
    -10: "a buffer overflow in Mooncake's client",
    -100: "a shard index out of range",
    -101: "the segment that held the object is gone (the engine that "
    "contributed it stopped)",
    -102: "the segment already exists",
    -200: "no space left in the Mooncake pool (raise mooncake_segment_bytes, "
    "or more engines contribute memory)",
    -300: "an invalid version",
    -400: "an invalid key",
    -500: "a write failed",
    -600: "invalid parameters (a buffer too small for the object, or a "
    "segment or buffer size Mooncake refuses)",
    -601: "a client not allowed to do this",
    -700: "an invalid write",
    -701: "an invalid read",
    -702: "an invalid replica",
    -703: "the object's replica is not ready (still being written)",
    -704: "the object is not in the store",
    -705: "the object already exists",
    -706: "a reader's lease still holds the object",
    -707: "the read's lease expired before its transfer completed (the "
    "master is up; the transfer from the engine holding the object was too "
    "slow)",
    -800: "the transfer to or from the engine holding the object failed "
    "(that engine unreachable at its mooncake_local_hostname, or stopped)",
    -900: "an RPC to the master failed: is mooncake_master running, and "
    "reachable from this host?",
    -901: "an RPC to the master timed out: is mooncake_master running, and "
    "reachable from this host?",
    -1010: "the master cannot do this in its current state",
    -1011: "the master cannot do this in its current mode",
}


def describe_error(rc: int) -> str:
    """Mooncake's error code ``rc`` as a sentence naming the code."""
    what = _ERRORS.get(rc)
    if what is None:
        return f"Mooncake error {rc}"
    return f"{what} (Mooncake error {rc})"
