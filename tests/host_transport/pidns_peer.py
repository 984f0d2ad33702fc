# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A producer or a consumer of routed-experts references, run as its own
process (``python -m tests.host_transport.pidns_peer ...``) so a test can
start it in another PID namespace.

``produce <scope>``: puts one ring payload and two per-key payloads, prints
``{"pid", "dir", "refs"}`` as one JSON line, then waits for a line on stdin
before it closes. ``fetch <refs json>``: fetches each reference, printing
one JSON line ``{"key": ..., "ok": bool, "error": ...}`` per reference.
"""

from __future__ import annotations

import json
import os
import secrets
import sys

import numpy as np


def produce(scope: str) -> None:
    from vllm_host_transport import HostTransportConfig, HostTransportConnector
    from vllm_host_transport.routed_experts import EDGE, RoutedExpertsRef, checksum_hex

    conn = HostTransportConnector(HostTransportConfig(scope=scope))
    refs = []
    # One ring payload (a quarter of the 4 MiB ring at most) and two per-key
    # segments.
    for n in (1000, 3 << 20, 3 << 20):
        rows = np.ascontiguousarray(
            (np.arange(n, dtype=np.uint8) % 7)[: n // 8 * 8].reshape(-1, 8, 1)
        )
        key = secrets.token_hex(16)
        ok, _, _ = conn.put(EDGE[0], EDGE[1], key, rows)
        assert ok
        ref = RoutedExpertsRef(
            transport="host",
            location=conn.scope_name,
            key=key,
            shape=rows.shape,
            dtype="uint8",
            nbytes=rows.nbytes,
            checksum=checksum_hex(rows.reshape(-1)),
        )
        refs.append(ref.to_json())
    print(json.dumps({"pid": os.getpid(), "dir": conn.scope_dir, "refs": refs}))
    sys.stdout.flush()
    sys.stdin.readline()
    conn.close()


def fetch(refs: list[dict]) -> None:
    from vllm_host_transport.routed_experts import RouteRefError
    from vllm_host_transport.routed_experts import fetch as fetch_ref

    for ref in refs:
        try:
            arr = fetch_ref(ref)
            out = {"key": ref["key"], "ok": arr.nbytes == ref["nbytes"], "error": ""}
        except RouteRefError as e:
            out = {"key": ref["key"], "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "produce":
        produce(sys.argv[2])
    else:
        fetch(json.loads(sys.argv[2]))
