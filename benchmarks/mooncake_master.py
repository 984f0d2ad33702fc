# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A ``mooncake_master`` on 127.0.0.1 (TCP) for the benchmarks that use a
Mooncake Store; ``None`` when Mooncake is not installed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def start_master() -> tuple[subprocess.Popen, str] | None:
    """``(process, "127.0.0.1:port")``, or ``None`` without Mooncake. Sets
    ``MC_FORCE_TCP`` for the clients of this process."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return None
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    os.environ["MC_FORCE_TCP"] = "true"
    master = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mooncake_master"),
            f"--rpc_port={ports[0]}",
            f"--metrics_port={ports[1]}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", ports[0])) == 0:
                return master, f"127.0.0.1:{ports[0]}"
        if time.monotonic() > deadline:
            master.terminate()
            raise RuntimeError("mooncake_master did not listen")
        time.sleep(0.05)
