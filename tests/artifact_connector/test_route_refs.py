# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine side of routes by reference (``RouteRefs``) with real
consumer processes on the real host transport: a consumer killed in the
middle of taking a payload loses nothing (the payload is still whole for
the next one), and the engine's side goes on handing out references."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid

import numpy as np
import pytest

from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.route_refs import RouteRefs
from vllm_host_transport import routed_experts
from vllm_host_transport.discovery import ScopeDir
from vllm_host_transport.routed_experts import EDGE, RouteRefMissingError, fetch
from vllm_host_transport.shared import edge_hex, seg_name


def _claim_and_freeze(path: str, held) -> None:
    """Take a segment's lock as a claim does first, then wait to be killed
    (the kill lands mid-fetch: locked, nothing copied or unlinked yet)."""
    import fcntl
    import time

    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.set()
    time.sleep(120)


def _fetch_in_child(ref: dict, out) -> None:
    try:
        routes = fetch(ref, timeout_s=5.0)
    except Exception as e:  # reported to the parent, which asserts on it
        out.put(type(e).__name__)
    else:
        out.put(routes.tobytes())


@pytest.fixture
def refs():
    r = RouteRefs(ArtifactConfig(ref_scope=f"refs-{uuid.uuid4().hex[:10]}"))
    yield r
    r.close()
    routed_experts.close()  # this process fetched too: let go of the scope


def test_a_consumer_killed_mid_fetch_loses_nothing(refs):
    ctx = mp.get_context("spawn")
    # 2 MiB: above a quarter of the ring, so a per-key segment.
    rows = np.random.default_rng(1).integers(0, 128, (5461, 48, 8), dtype=np.uint8)
    ref = refs.publish(rows, 0)
    scope = os.path.join("/dev/shm", ScopeDir.dir_name(ref.location))
    lock = os.path.join(scope, seg_name(edge_hex(*EDGE), ref.key) + ".lock")
    assert os.path.exists(lock), "the payload is not in a per-key segment"
    held = ctx.Event()
    victim = ctx.Process(target=_claim_and_freeze, args=(lock, held))
    victim.start()
    assert held.wait(60)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    # The next consumer takes the whole, verified array.
    out = ctx.Queue()
    taker = ctx.Process(target=_fetch_in_child, args=(ref.to_json(), out))
    taker.start()
    got = out.get(timeout=60)
    taker.join(30)
    assert got == rows.tobytes()
    # Taken: a later fetch finds it gone; the engine side keeps going.
    with pytest.raises(RouteRefMissingError):
        fetch(ref)
    again = refs.publish(rows[:10], 3)
    np.testing.assert_array_equal(fetch(again), rows[:10])
    assert refs.counters()["published"] == 2
