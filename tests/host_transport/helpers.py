# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Child-process bodies for the multi-process tests (fork context)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from vllm_host_transport import (
    HostTransportConfig,
    HostTransportConnector,
)

CTX = mp.get_context("fork")


def conn(scope: str, ring: int) -> HostTransportConnector:
    return HostTransportConnector(
        HostTransportConfig(host_ring_bytes=ring, scope=scope)
    )


def put_and_linger(
    scope: str, ring: int, items: list[tuple[str, Any]], ev_done, ev_exit
) -> None:
    c = conn(scope, ring)
    for k, v in items:
        ok, _, _ = c.put("p", "c", k, v)
        assert ok
    ev_done.set()
    ev_exit.wait(60)
    c.close()


def put_then_die(scope: str, ring: int, key: str, value: Any) -> None:
    c = conn(scope, ring)
    c.put("p", "c", key, value)
    os._exit(0)  # no close: the ring and its registration stay behind


def die_mid_publication(scope: str, ring: int, key: str) -> None:
    from vllm_host_transport import frame as framemod

    c = conn(scope, ring)
    c.put("p", "c", "warmup", 1)  # the ring exists and is registered

    def partial_write(self, dst, *args):  # noqa: ANN001
        dst[: len(dst) // 2] = b"\x01" * (len(dst) // 2)
        os._exit(0)

    framemod.EncodedFrame.write_into = partial_write  # type: ignore[method-assign]
    framemod.write_frame_to_fd = lambda fd, frame: os._exit(0)  # type: ignore
    from vllm_host_transport import perkey

    perkey.write_frame_to_fd = framemod.write_frame_to_fd  # type: ignore
    c.put("p", "c", key, {"x": list(range(10))})
    os._exit(1)  # not reached


def compete(scope: str, keys: list[str], counter, out, start_ev) -> None:
    c = conn(scope, 0)
    got: list[str] = []
    start_ev.wait(30)
    deadline = time.monotonic() + 30
    while counter.value < len(keys) and time.monotonic() < deadline:
        for k in keys:
            if k in got:
                continue
            if c.get("p", "c", k) is not None:
                got.append(k)
                with counter.get_lock():
                    counter.value += 1
    out.put(got)
    c.close()


def hold_ring_lock(scope_dir: str, name: str, held, release) -> None:
    import fcntl

    fd = os.open(os.path.join(scope_dir, name), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.set()
    release.wait(30)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def trainer(scope: str, key: str, out) -> None:
    from vllm_host_transport import receive_payload

    with conn(scope, 0) as c:
        obj = receive_payload(c, "engine", "trainer", key, timeout_s=20)
    out.put(None if obj is None else obj["routed_experts"].sum().item())


def hold_lock_on(path: str, held, release) -> None:
    """Hold an exclusive flock on ``path`` until ``release`` is set."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.set()
    release.wait(60)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def close_inherited(c: HostTransportConnector, out) -> None:
    """Forked child: try to use the parent's connector, then close it."""
    import gc

    out.put(c.put("p", "c", "from-child", 1)[0])
    c.close()
    del c
    gc.collect()


def put_canary(scope: str, done, exit_ev) -> None:
    """Publish a struct whose module the receiving process never imported."""
    from tests.host_transport._canary import Canary

    put_and_linger(scope, 4096, [("k", {"s": Canary(3)})], done, exit_ev)


def drain_in_order(scope: str, ring: int, n: int, ready, out) -> None:
    """Receive ``k0 .. k<n-1>`` in order and report their values."""
    with conn(scope, ring) as c:
        ready.set()
        got = []
        for i in range(n):
            r = c.get_with_deadline("p", "c", f"k{i}", deadline=time.monotonic() + 60)
            got.append(None if r is None else int(r[0]["t"][0]))
        out.put(got)


def linger(release) -> None:
    """Forked child that keeps its inherited descriptors until released."""
    release.wait(60)
