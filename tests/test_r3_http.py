# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 over HTTP: a real ``vllm serve --enable-routed-experts`` process, the
``openai`` client for completions and chat, plain HTTP for token-in/token-out
(``--enable-scale-out``) and the RL endpoints (``/pause``, ``/resume``).
Every returned route is checked against transformers' router in float32."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import BLOCK_SIZE, PROMPTS, SHARED_PREFIX, shm_root

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tiny_moe):
    from server import VllmServer

    root = shm_root()
    flags = [
        "--served-model-name", "tiny", "--enable-routed-experts",
        "--enable-scale-out", "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
        "--max-num-seqs", "8", "--enforce-eager", "--enable-prompt-tokens-details",
        "--artifact-config", json.dumps({"shm_root": root}),
        # Drain on SIGINT instead of killing the engine at once, so every
        # process removes its own files (a killed one leaves its shared
        # memory to the resource tracker, which may be late for the guard).
        "--shutdown-timeout", "30",
    ]  # fmt: skip
    old = os.environ.get("VLLM_SERVER_DEV_MODE")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /pause and /resume
    try:
        with VllmServer(tiny_moe, flags, log_name="test-r3-http.log") as srv:
            srv.shm_root = root
            yield srv
    finally:
        if old is None:
            os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        else:
            os.environ["VLLM_SERVER_DEV_MODE"] = old
    assert not os.path.exists(root), "the store outlived a clean shutdown"


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")


def _post(server, path: str, body: dict | None = None, timeout: float = 120):
    req = urllib.request.Request(
        server.base_url + path,
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _routes(choice_extra: dict) -> np.ndarray:
    from vllm.utils.routed_experts_codec import decode_routed_experts

    assert choice_extra.get("routed_experts") is not None, choice_extra
    return decode_routed_experts(choice_extra["routed_experts"])


def _completion(client, prompt, **kw):
    extra = {"return_token_ids": True, "ignore_eos": True}
    extra.update(kw.pop("extra_body", {}))
    kw.setdefault("max_tokens", 8)
    return client.completions.create(
        model="tiny", prompt=prompt, temperature=0.0, extra_body=extra, **kw
    )


def _assert_choice_exact(tiny_moe, resp, first_row=0) -> np.ndarray:
    choice = resp.choices[0]
    extra = choice.model_extra or {}
    got = _routes(extra)
    want = expected_r3(tiny_moe, extra["prompt_token_ids"], choice.token_ids)
    np.testing.assert_array_equal(got, want[first_row:])
    return want


def _tito(server, token_ids, **sampling):
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling}
    return _post(
        server,
        "/inference/v1/generate",
        {"token_ids": token_ids, "sampling_params": sampling},
    )


def test_completion_and_chat_match_transformers_router(client, tiny_moe):
    a = _completion(client, SHARED_PREFIX + "First.")
    b = _completion(client, SHARED_PREFIX + "Second one.")  # prefix hit
    details = b.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= 2 * BLOCK_SIZE
    ra = _assert_choice_exact(tiny_moe, a)
    rb = _assert_choice_exact(tiny_moe, b)
    np.testing.assert_array_equal(
        ra[: details.cached_tokens], rb[: details.cached_tokens]
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = chat.choices[0]
    got = _routes(choice.model_extra or {})
    prompt_ids = (chat.model_extra or {})["prompt_token_ids"]
    np.testing.assert_array_equal(
        got, expected_r3(tiny_moe, prompt_ids, choice.token_ids)
    )


def test_token_in_token_out_with_prompt_start(server, client, tiny_moe):
    from vllm.utils.routed_experts_codec import decode_routed_experts

    ids = _completion(client, SHARED_PREFIX).choices[0].model_extra["prompt_token_ids"]
    for start in (0, 50):
        status, body = _tito(server, ids, routed_experts_prompt_start=start)
        assert status == 200, body
        choice = body["choices"][0]
        got = decode_routed_experts(choice["routed_experts"])
        want = expected_r3(tiny_moe, ids, choice["token_ids"])
        np.testing.assert_array_equal(got, want[start:])


def test_stop_string_over_http(client, tiny_moe):
    free = _completion(client, PROMPTS[4], max_tokens=24)
    text = free.choices[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    assert stop.strip()
    resp = _completion(client, PROMPTS[4], max_tokens=24, stop=[stop])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert len(choice.token_ids) < len(free.choices[0].token_ids)
    _assert_choice_exact(tiny_moe, resp)


def test_client_disconnect_leaves_the_server_exact(server, client, tiny_moe):
    import httpx

    body = {
        "model": "tiny", "prompt": SHARED_PREFIX, "max_tokens": 200,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, timeout=60
    ) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 3:
                break  # hang up mid-generation
    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as r:
        assert r.status == 200
    _assert_choice_exact(tiny_moe, _completion(client, PROMPTS[0]))


def test_pause_with_abort_returns_routes_of_the_returned_tokens(
    server, client, tiny_moe
):
    result: dict = {}

    def long_request():
        result["resp"] = _completion(client, PROMPTS[1], max_tokens=600)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(3.0)  # the request is decoding
    status, body = _post(server, "/pause?mode=abort")
    assert status == 200, body
    t.join(timeout=120)
    try:
        resp = result["resp"]
        choice = resp.choices[0]
        assert choice.finish_reason == "abort", choice.finish_reason
        assert 0 < len(choice.token_ids) < 600
        _assert_choice_exact(tiny_moe, resp)
    finally:
        assert _post(server, "/resume")[0] == 200
    _assert_choice_exact(tiny_moe, _completion(client, PROMPTS[2]))


def test_corrupted_object_is_a_5xx_for_that_request_only(server, client, tiny_moe):
    from vllm.distributed.artifact_connector.shm import ShmStoreReader

    victim = SHARED_PREFIX + "These routes get corrupted behind the server."
    _assert_choice_exact(tiny_moe, _completion(client, victim))
    (ns,) = os.listdir(server.shm_root)
    reader = ShmStoreReader(server.shm_root, ns)
    try:
        idx = reader._index
        slots = idx.live_slots()
        for aid, off in zip(idx.arena[slots].tolist(), idx.off[slots].tolist()):
            fd = os.open(
                os.path.join(server.shm_root, ns, f"{aid:016x}.arena"),
                os.O_RDWR | os.O_NOFOLLOW,
            )
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
            finally:
                os.close(fd)
    finally:
        reader.close()
    status, body = _post(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": victim, "max_tokens": 8, "temperature": 0.0},
    )
    assert status >= 500, body
    message = json.dumps(body)
    assert "ChecksumMismatchError" in message, body
    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as r:
        assert r.status == 200
    assert _post(server, "/reset_prefix_cache")[0] == 200
    _assert_choice_exact(tiny_moe, _completion(client, PROMPTS[3]))
