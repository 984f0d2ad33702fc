# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A producer or a consumer of routed-experts references, run as its own
process (``python -m tests.host_transport.pidns_peer ...``) so a test can
start it in another PID namespace.

``produce <scope>``: publishes three read-many payloads (one small, two of
3 MiB), prints ``{"pid", "dir", "refs"}`` as one JSON line, then waits for
a line on stdin before it closes. ``fetch <refs json>``: fetches each
reference, printing one JSON line ``{"key": ..., "ok": bool, "error": ...}``
per reference (``ok``: the array is exactly what ``produce`` published;
``sha256``: of the array's bytes, for references of other producers).
``release <refs json>``: the driver's release of the references, printing
``{"removed": n}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys

import numpy as np


def _rows(n: int) -> np.ndarray:
    """What the producer publishes for a payload of ``n`` bytes (the
    consumers compare against it)."""
    return np.ascontiguousarray(
        (np.arange(n, dtype=np.uint8) % 7)[: n // 8 * 8].reshape(-1, 8, 1)
    )


def produce(scope: str) -> None:
    from vllm_host_transport import HostTransportConfig, HostTransportConnector
    from vllm_host_transport.routed_experts import RoutedExpertsRef
    from vllm_host_transport.routes_format import encode

    conn = HostTransportConnector(HostTransportConfig(scope=scope))
    refs = []
    for n in (1000, 3 << 20, 3 << 20):
        payload = encode(_rows(n))
        key = secrets.token_hex(16)
        assert conn.put_readable(key, payload.parts)
        ref = RoutedExpertsRef.for_payload(
            payload, transport="host", location=conn.scope_name, key=key
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
            want = _rows(ref["nbytes"])
            ok = arr.shape == want.shape and bool((arr == want).all())
            digest = hashlib.sha256(arr.tobytes()).hexdigest()
            out = {"key": ref["key"], "ok": ok, "error": "", "sha256": digest}
        except RouteRefError as e:
            out = {"key": ref["key"], "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


def release(refs: list[dict]) -> None:
    from vllm_host_transport.routes_reader import release as release_refs

    print(json.dumps({"removed": release_refs(refs)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "produce":
        produce(sys.argv[2])
    elif sys.argv[1] == "release":
        release(json.loads(sys.argv[2]))
    else:
        fetch(json.loads(sys.argv[2]))
