# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine does not share its fate with the reference transport: a real
``vllm serve`` with ``ref_transport: mooncake`` (routes inline by default)
and a real ``mooncake_master`` that the test freezes (``SIGSTOP``) for 20 s
while 32 concurrent requests run, half of them asking for a reference.
Every inline request is answered, exact against transformers' router,
while the master is still frozen; every reference request either carries a
reference that fetches exactly or fails with ``RouteRefPublishError``, also
before the master resumes; and references flow again after it resumes.

And an engine started while the master is frozen (r5 M1): it becomes
healthy while the master is still frozen (its join is probed in a child
process, at most 5 s, instead of Mooncake's ``setup`` holding the engine
core's interpreter lock until the master resumes), inline requests are
exact, and references fail with ``RouteRefPublishError`` saying the master
did not answer."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import (
    PROMPTS,
    assert_completion_exact,
    http_post,
    r3_server,
    serve_flags,
    shm_root,
)
from utils.routes_consumer import Consumer

pytestmark = pytest.mark.engine

mooncake = pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)

FREEZE_S = 20.0
HANDOFF_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def master():
    from utils.mooncake import running_master

    with running_master("mooncake-master-isolation") as m:
        yield m


@pytest.fixture(scope="module")
def server(tiny_moe, master):
    root = shm_root()
    flags = serve_flags(
        root,
        ref_transport="mooncake",
        mooncake_master=master.address,
        mooncake_segment_bytes=64 << 20,
        mooncake_buffer_bytes=32 << 20,
        ref_handoff_timeout_s=HANDOFF_TIMEOUT_S,
    )
    with r3_server(tiny_moe, flags, root, "test-r3-isolation.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def consumer(tmp_path_factory, master):
    c = Consumer(tmp_path_factory.mktemp("isolation-consumer"))
    yield c
    c.close()


def _completion(server, prompt: str, fmt: str) -> tuple[int, dict]:
    return http_post(
        server.base_url,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "routed_experts_format": fmt,
        },
    )


def _assert_ref_exact(consumer, tiny_moe, choice) -> None:
    ref = choice["routed_experts_ref"]
    assert ref is not None and ref["transport"] == "mooncake", choice
    got = consumer.fetch(ref)
    assert isinstance(got, np.ndarray), got
    want = expected_r3(tiny_moe, choice["prompt_token_ids"], choice["token_ids"])
    np.testing.assert_array_equal(got, want)


def test_a_frozen_master_stalls_no_inline_request(server, master, consumer, tiny_moe):
    status, body = _completion(server, PROMPTS[0], "ref")
    assert status == 200, body
    _assert_ref_exact(consumer, tiny_moe, body["choices"][0])

    results: dict[int, tuple[str, int, dict, float]] = {}

    def one(i: int) -> None:
        fmt = "ref" if i % 2 else "inline"
        prompt = f"{PROMPTS[i % len(PROMPTS)]} ({i})"
        status, body = _completion(server, prompt, fmt)
        results[i] = (fmt, status, body, time.monotonic())

    os.kill(master.proc.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=FREEZE_S + 5 - (time.monotonic() - frozen))
        answered_frozen = {i for i, r in results.items() if r[3] < frozen + FREEZE_S}
        time.sleep(max(0.0, frozen + FREEZE_S - time.monotonic()))
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 32
    # Everyone was answered while the master was still frozen.
    assert answered_frozen == set(range(32)), sorted(set(range(32)) - answered_frozen)
    handed_out = failed = 0
    for i, (fmt, status, body, _) in sorted(results.items()):
        if fmt == "inline":
            assert status == 200, (i, body)
            assert_completion_exact(tiny_moe, body)
        elif status == 200:
            handed_out += 1
            _assert_ref_exact(consumer, tiny_moe, body["choices"][0])
        else:
            failed += 1
            assert "RouteRefPublishError" in str(body), (i, status, body)
    assert handed_out + failed == 16
    # References flow again once the master answers (after the breaker's
    # pause, at most 8 s).
    deadline = resumed + 60
    while True:
        status, body = _completion(server, PROMPTS[1], "ref")
        if status == 200:
            break
        assert "RouteRefPublishError" in str(body), body
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    _assert_ref_exact(consumer, tiny_moe, body["choices"][0])


def test_an_engine_started_with_a_frozen_master_serves(tiny_moe, tmp_path):
    from utils.mooncake import running_master

    with running_master("mooncake-master-frozen-start") as frozen:
        # Resumed by another process only after the whole test's budget.
        frozen.freeze(resume_after_s=900.0)
        root = shm_root()
        flags = serve_flags(
            root,
            ref_transport="mooncake",
            mooncake_master=frozen.address,
            mooncake_segment_bytes=64 << 20,
            mooncake_buffer_bytes=32 << 20,
            ref_handoff_timeout_s=HANDOFF_TIMEOUT_S,
        )
        with r3_server(tiny_moe, flags, root, "test-r3-frozen-start.log") as srv:
            assert frozen.still_frozen()  # healthy before the master answered
            for i in range(4):
                status, body = _completion(srv, PROMPTS[i % len(PROMPTS)], "inline")
                assert status == 200, body
                assert_completion_exact(tiny_moe, body)
            status, body = _completion(srv, PROMPTS[0], "ref")
            assert status != 200 and "RouteRefPublishError" in str(body), body
            assert "did not answer" in str(body), body
            assert frozen.still_frozen()
            frozen.thaw()
