# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-node host transport: hand payloads between processes by key through
shared memory (a bounded per-edge host ring plus per-key segments).

A top-level package, not under ``vllm``: it imports neither vLLM nor torch
(numpy and msgspec only; torch when a tensor is met, vLLM for payloads only
its serializer can carry), so a process without vLLM, or with another version
of it (a trainer on the node), takes payloads through it. The artifact store
uses its ``safe_fs`` and ``process_identity``.

Linux only. See ``docs/design/host_transport.md``.
"""

from vllm_host_transport.codec import FrameCodec
from vllm_host_transport.config import (
    DEFAULT_HOST_RING_BYTES,
    MAX_HOST_RING_BYTES,
    MIN_HOST_RING_BYTES,
    SCOPE_ENV,
    HostTransportConfig,
)
from vllm_host_transport.connector import HostTransportConnector, receive_payload
from vllm_host_transport.discovery import HostTransportError, ScopeMissingError
from vllm_host_transport.frame import CorruptFrame, PayloadTooLarge

__all__ = [
    "CorruptFrame",
    "DEFAULT_HOST_RING_BYTES",
    "FrameCodec",
    "HostTransportConfig",
    "HostTransportConnector",
    "HostTransportError",
    "MAX_HOST_RING_BYTES",
    "MIN_HOST_RING_BYTES",
    "PayloadTooLarge",
    "SCOPE_ENV",
    "ScopeMissingError",
    "receive_payload",
]
