# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures: one scope per test (removed afterwards) and connector factories."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator

import pytest

from vllm_host_transport import (
    HostTransportConfig,
    HostTransportConnector,
)
from vllm_host_transport.discovery import hex_name

TINY_RING = 4096


def scope_path(scope: str) -> str:
    return f"/dev/shm/vllm-ht-{os.getuid()}-{hex_name(scope)}"


@pytest.fixture
def scope() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex}"
    yield name
    shutil.rmtree(scope_path(name), ignore_errors=True)


ConnFactory = Callable[..., HostTransportConnector]


@pytest.fixture
def make_conn(scope: str) -> Iterator[ConnFactory]:
    made: list[HostTransportConnector] = []

    def factory(ring_bytes: int = TINY_RING, **kw) -> HostTransportConnector:
        c = HostTransportConnector(
            HostTransportConfig(host_ring_bytes=ring_bytes, scope=scope, **kw)
        )
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


@pytest.fixture(params=[TINY_RING, 0], ids=["ring4k", "perkey"])
def ring_bytes(request: pytest.FixtureRequest) -> int:
    return request.param
