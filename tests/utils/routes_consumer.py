# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer's side of the routes-by-reference tests: a separate process
that imports ``vllm_host_transport`` (and, for Mooncake references,
Mooncake's client) only, and fetches or releases the references it is
given. (A test process that joined a Mooncake master itself would keep
that client reconnecting after the master stops, and fork with its
threads for every later subprocess.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# The trainer's side: one process for the whole module, fed one reference
# per line; it answers with the fetched array's file or the error's type.
CONSUMER = r"""
import json, sys
import numpy as np
from vllm_host_transport.routed_experts import RouteRefError, fetch
from vllm_host_transport.routes_reader import release
for line in sys.stdin:
    job = json.loads(line)
    try:
        if "release" in job:
            answer = {"removed": release(job["release"])}
        else:
            np.save(job["out"], fetch(job["ref"]))
            answer = {"ok": True}
    except RouteRefError as e:
        answer = {"error": type(e).__name__, "message": str(e)}
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
    answer["loaded"] = loaded
    print(json.dumps(answer), flush=True)
"""


class Consumer:
    """A trainer process next to the engine (same user, same node)."""

    def __init__(self, tmp: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["MC_FORCE_TCP"] = "true"  # Mooncake over loopback TCP
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CONSUMER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # Mooncake's own logging
            text=True,
            env=env,
            cwd=tmp,
        )
        self.tmp = tmp
        self.n = 0

    def fetch(self, ref: dict) -> np.ndarray | str:
        """The array, or the name of the error ``fetch`` raised."""
        self.n += 1
        out = str(self.tmp / f"routes-{self.n}.npy")
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"ref": ref, "out": out}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert answer["loaded"] == [], f"the consumer imported {answer['loaded']}"
        if "error" in answer:
            self.last_message = answer.get("message", "")
            return answer["error"]
        routes = np.load(out)
        os.unlink(out)
        return routes

    def release(self, refs: list[dict]) -> int | str:
        """The driver's release of ``refs``: how many were removed, or the
        name of the error."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"release": refs}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert answer["loaded"] == [], f"the consumer imported {answer['loaded']}"
        return answer.get("error") or answer["removed"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
