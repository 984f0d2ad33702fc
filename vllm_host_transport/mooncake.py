# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A Mooncake Store client for a process that shares a host with others: the
engines' clients (``vllm.distributed.artifact_connector.mooncake.client``)
and the consumers' (``routed_experts``) are made here."""

from __future__ import annotations

import os
from typing import Any


def new_client() -> Any:
    """An unconfigured ``MooncakeDistributedStore`` (raises ``ImportError``
    without Mooncake's client).

    Mooncake's local-memcpy fast path is off unless ``MC_STORE_MEMCPY`` is
    set: with only TCP it turns itself on, and then a transfer between two
    processes on one host (two engines, an engine and a trainer) can stall
    30 s and fail, since every segment under the host's name looks local.
    Seen with 0.3.13 between a ``vllm serve`` decode engine and a prefill
    engine (docs/design/artifact_connector.md, "The shared tier").
    """
    os.environ.setdefault("MC_STORE_MEMCPY", "0")
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()
