# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Receiving a finished payload by key from another process of the node.

A process next to the engine (for example a trainer) that knows the deployment
scope, the edge and the key of a finished request can take its payload::

    from vllm.distributed.host_transport import (
        HostTransportConfig, HostTransportConnector, receive_payload)

    with HostTransportConnector(HostTransportConfig(scope="job-42")) as conn:
        obj = receive_payload(conn, "engine", "trainer", "req_17_0",
                              timeout_s=5.0)

The producer publishes with ``conn.put("engine", "trainer", key, payload)``.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.host_transport.connector import HostTransportConnector


def receive_payload(
    conn: HostTransportConnector,
    from_stage: Any,
    to_stage: Any,
    key: str,
    timeout_s: float = 0.0,
    descriptor: dict[str, Any] | None = None,
) -> Any | None:
    """Take the payload published under ``key`` on ``from_stage -> to_stage``.

    Waits up to ``timeout_s`` seconds (0: a single attempt) and returns the
    owned object, or ``None`` when nothing arrived in time. Exactly one
    receiver gets a given publication.
    """
    deadline = time.monotonic() + max(timeout_s, 0.0)
    r = conn.get_with_deadline(
        from_stage, to_stage, key, descriptor=descriptor, deadline=deadline
    )
    return None if r is None else r[0]
