# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 over HTTP: a real ``vllm serve --enable-routed-experts`` process, the
``openai`` client for completions and chat, plain HTTP for token-in/token-out
(``--enable-scale-out``) and the RL endpoints (``/pause``, ``/resume``).
Every returned route is checked against transformers' router in float32."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import (
    BLOCK_SIZE,
    PROMPTS,
    SHARED_PREFIX,
    corrupt_objects,
    http_post,
    r3_server,
    serve_flags,
    shm_root,
    store_objects,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tiny_moe):
    root = shm_root()
    with r3_server(tiny_moe, serve_flags(root), root, "test-r3-http.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")


def _post(server, path: str, body: dict | None = None, timeout: float = 120):
    return http_post(server.base_url, path, body, timeout)


def _routes(choice_extra: dict) -> np.ndarray:
    from vllm.utils.routed_experts_codec import decode_routed_experts

    assert choice_extra.get("routed_experts") is not None, choice_extra
    return decode_routed_experts(choice_extra["routed_experts"])


def _completion(client, prompt, **kw):
    extra = {"return_token_ids": True, "ignore_eos": True}
    extra.update(kw.pop("extra_body", {}))
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return client.completions.create(
        model="tiny", prompt=prompt, extra_body=extra, **kw
    )


def _assert_choice_exact(tiny_moe, resp, first_row=0) -> np.ndarray:
    choice = resp.choices[0]
    extra = choice.model_extra or {}
    got = _routes(extra)
    want = expected_r3(tiny_moe, extra["prompt_token_ids"], choice.token_ids)
    np.testing.assert_array_equal(got, want[first_row:])
    return want


def _tito(server, token_ids, request_id=None, **sampling):
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling}
    body = {"token_ids": token_ids, "sampling_params": sampling}
    if request_id is not None:
        body["request_id"] = request_id
    return _post(server, "/inference/v1/generate", body)


def _sse(server, path: str, body: dict) -> list:
    """A streamed response's ``data:`` events, parsed (``"[DONE]"`` kept)."""
    import httpx

    events: list = []
    with httpx.stream(
        "POST", server.base_url + path, json={**body, "stream": True}, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _fields(choice) -> dict:
    """An ``openai`` stream choice as the JSON the server sent for it."""
    return {
        "index": choice.index,
        "finish_reason": choice.finish_reason,
        **(choice.model_extra or {}),
    }


class _StreamedChoices:
    """Per choice index: the streamed token IDs and the final chunk's routes.
    Every chunk without a finish_reason must carry no routes, and each choice
    must end exactly once."""

    def __init__(self, absent: bool = True):
        self.absent = absent  # OpenAI chunks leave the field out entirely
        self.prompt_ids: dict[int, list[int]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.routes: dict[int, np.ndarray] = {}
        self.finish: dict[int, str] = {}

    def add(self, choice: dict, prompt_ids: list[int] | None = None) -> None:
        i = choice["index"]
        assert i not in self.finish, f"choice {i} got a chunk after its final one"
        if prompt_ids is not None:
            self.prompt_ids[i] = list(prompt_ids)
        self.token_ids.setdefault(i, []).extend(choice.get("token_ids") or [])
        if choice.get("finish_reason") is None:
            if self.absent:
                assert "routed_experts" not in choice, choice
            else:
                assert choice.get("routed_experts") is None, choice
            return
        self.finish[i] = choice["finish_reason"]
        self.routes[i] = _routes(choice)

    def assert_exact(self, tiny_moe, n: int, first_row: int = 0, prompt_ids=None):
        assert sorted(self.finish) == list(range(n)), self.finish
        for i in range(n):
            ids = prompt_ids if prompt_ids is not None else self.prompt_ids[i]
            want = expected_r3(tiny_moe, ids, self.token_ids[i])
            np.testing.assert_array_equal(self.routes[i], want[first_row:])


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


def _counter(server, name: str) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _routed_total(server) -> float:
    return _counter(server, "vllm:routed_experts_requests_routed_total")


def _start_decoding(server, run) -> threading.Thread:
    """``run()`` (one long request) on a thread, returned once the engine
    has generated a few of its tokens: an abort sent then lands mid-decode
    however fast the machine is (a fixed sleep does not)."""
    before = _counter(server, "vllm:generation_tokens_total")
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while _counter(server, "vllm:generation_tokens_total") < before + 4:
        assert t.is_alive(), "the request ended before it decoded"
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.01)
    return t


def test_client_disconnect_reads_nothing_and_leaves_the_server_exact(
    server, client, tiny_moe
):
    """A client that hung up gets nothing, so the engine reads nothing for
    it (the old code read and dropped its routes): the routed-requests
    counter does not grow."""
    import httpx

    body = {
        "model": "tiny", "prompt": SHARED_PREFIX, "max_tokens": 600,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    before = _routed_total(server)
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, timeout=60
    ) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 3:
                break  # hang up mid-generation
    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as r:
        assert r.status == 200
    time.sleep(2.0)  # the abort reached the engine, the request drained
    assert _routed_total(server) == before
    _assert_choice_exact(tiny_moe, _completion(client, PROMPTS[0]))


def test_pause_with_abort_returns_routes_of_the_returned_tokens(
    server, client, tiny_moe
):
    result: dict = {}

    def long_request():
        result["resp"] = _completion(client, PROMPTS[1], max_tokens=600)

    t = _start_decoding(server, long_request)
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


def _abort_while_decoding(server, run, abort_path: str, abort_body: dict):
    """Start ``run()`` (a long request) on a thread, let it decode, then
    POST ``abort_body`` to ``abort_path``; returns what ``run`` returned."""
    result: dict = {}
    t = _start_decoding(server, lambda: result.update(out=run()))
    status, body = _post(server, abort_path, abort_body)
    assert status == 200, body
    t.join(timeout=120)
    assert not t.is_alive()
    return result["out"]


def _assert_aborted_choice_exact(tiny_moe, resp) -> None:
    choice = resp.choices[0]
    assert choice.finish_reason == "abort", choice.finish_reason
    assert 0 < len(choice.token_ids) < 600
    assert (choice.model_extra or {}).get("routed_experts_error") is None
    _assert_choice_exact(tiny_moe, resp)


def test_abort_requests_with_an_empty_body_returns_routes(server, client, tiny_moe):
    """The RL endpoint vime's rollout calls: the aborted completion comes
    back with its tokens and the routes of exactly those (the old code
    answered with tokens, no routes and no reason)."""
    resp = _abort_while_decoding(
        server,
        lambda: _completion(client, PROMPTS[3], max_tokens=600),
        "/abort_requests",
        {},
    )
    _assert_aborted_choice_exact(tiny_moe, resp)
    _assert_choice_exact(tiny_moe, _completion(client, PROMPTS[0]))


def test_abort_requests_by_id_returns_routes(server, client, tiny_moe):
    """By the id the client chose (X-Request-Id makes prompt 0 ``cmpl-<id>-0``)."""
    resp = _abort_while_decoding(
        server,
        lambda: _completion(
            client, PROMPTS[2], max_tokens=600, extra_headers={"X-Request-Id": "ab1"}
        ),
        "/abort_requests",
        {"request_ids": ["cmpl-ab1-0"]},
    )
    _assert_aborted_choice_exact(tiny_moe, resp)


def test_token_in_token_out_abort_returns_routes(server, tiny_moe):
    ids = list(range(5, 45))
    out = _abort_while_decoding(
        server,
        lambda: _tito(server, ids, request_id="t1", max_tokens=600),
        "/inference/v1/abort_requests",
        {"request_ids": ["generate-tokens-t1"]},
    )
    status, body = out
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "abort", choice["finish_reason"]
    assert 0 < len(choice["token_ids"]) < 600
    assert choice.get("routed_experts_error") is None
    np.testing.assert_array_equal(
        _routes(choice), expected_r3(tiny_moe, ids, choice["token_ids"])
    )


def test_completion_stream_routes_on_each_final_chunk(client, tiny_moe):
    # n=2 sampled: two different completions, each final chunk its own routes.
    got = _StreamedChoices()
    for chunk in _completion(
        client, PROMPTS[1], n=2, temperature=1.0, stream=True, max_tokens=12
    ):
        for choice in chunk.choices:
            extra = _fields(choice)
            got.add(extra, extra.get("prompt_token_ids"))
    got.assert_exact(tiny_moe, n=2)
    # routed_experts_prompt_start cuts the leading prompt rows in a stream too.
    start = 5
    got = _StreamedChoices()
    for chunk in _completion(
        client,
        PROMPTS[2],
        stream=True,
        extra_body={"routed_experts_prompt_start": start},
    ):
        for choice in chunk.choices:
            extra = _fields(choice)
            got.add(extra, extra.get("prompt_token_ids"))
    got.assert_exact(tiny_moe, n=1, first_row=start)
    # A stop string found while streaming: the routes end with the returned
    # tokens (the frontend waits for the engine's routes after the stop).
    free = _completion(client, PROMPTS[4], max_tokens=24).choices[0]
    stop = free.text[len(free.text) // 3 : len(free.text) // 3 + 4]
    assert stop.strip()
    got = _StreamedChoices()
    for chunk in _completion(
        client, PROMPTS[4], max_tokens=24, stop=[stop], stream=True
    ):
        for choice in chunk.choices:
            extra = _fields(choice)
            got.add(extra, extra.get("prompt_token_ids"))
    assert got.finish == {0: "stop"}, got.finish
    assert len(got.token_ids[0]) < len(free.token_ids)
    got.assert_exact(tiny_moe, n=1)


def test_chat_stream_routes_on_the_final_chunk(client, tiny_moe):
    start = 3
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Name three colours of the sea."}],
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            "return_token_ids": True,
            "ignore_eos": True,
            "routed_experts_prompt_start": start,
        },
    )
    got = _StreamedChoices()
    prompt_ids = None
    usage = None
    for chunk in stream:
        prompt_ids = (chunk.model_extra or {}).get("prompt_token_ids") or prompt_ids
        usage = chunk.usage or usage
        for choice in chunk.choices:
            got.add(_fields(choice))
    assert prompt_ids is not None and usage is not None
    assert len(prompt_ids) + len(got.token_ids[0]) == usage.total_tokens
    got.assert_exact(tiny_moe, n=1, first_row=start, prompt_ids=prompt_ids)


def test_token_in_token_out_stream_with_prompt_start(server, client, tiny_moe):
    ids = _completion(client, PROMPTS[4]).choices[0].model_extra["prompt_token_ids"]
    start = 4
    events = _sse(
        server,
        "/inference/v1/generate",
        {
            "token_ids": ids,
            "sampling_params": {
                "max_tokens": 8,
                "temperature": 1.0,
                "ignore_eos": True,
                "n": 2,
                "routed_experts_prompt_start": start,
            },
        },
    )
    assert events[-1] == "[DONE]", events[-1]
    got = _StreamedChoices(absent=False)
    for event in events[:-1]:
        for choice in event["choices"]:
            got.add(choice)
    got.assert_exact(tiny_moe, n=2, first_row=start, prompt_ids=ids)


def test_corrupted_object_is_a_5xx_for_that_request_only(server, client, tiny_moe):
    victim = SHARED_PREFIX + "These routes get corrupted behind the server."
    _assert_choice_exact(tiny_moe, _completion(client, victim))
    corrupt_objects(
        server.shm_root, [place for _, place in store_objects(server.shm_root)]
    )
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


def test_stream_with_corrupted_routes_ends_in_the_error_event(server, client, tiny_moe):
    # Prompts of their own (no block shared with other tests), served once so
    # their blocks are published; only those objects are corrupted.
    text = (
        "A lighthouse keeper counts the ships that pass in the night and writes "
        "their names into a book, one line for each ship and each hour. When "
        "the fog comes in from the west, the keeper rings a bell every minute "
        "and listens for the horns of the fishing boats that head for home. "
    )
    before = {key for key, _ in store_objects(server.shm_root)}
    prompt_ids = _completion(client, text).choices[0].model_extra["prompt_token_ids"]
    messages = [{"role": "user", "content": "Tell me again: " + text}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 6}
    assert _post(server, "/v1/chat/completions", chat)[0] == 200
    new = [place for key, place in store_objects(server.shm_root) if key not in before]
    assert len(new) >= 2, new
    corrupt_objects(server.shm_root, new)

    greedy = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    streams = {
        "/v1/completions": {"model": "tiny", "prompt": prompt_ids, **greedy},
        "/v1/chat/completions": {**chat, **greedy},
        "/inference/v1/generate": {"token_ids": prompt_ids, "sampling_params": greedy},
    }
    for path, body in streams.items():
        events = _sse(server, path, body)
        assert events[-1] == "[DONE]", (path, events)
        error = events[-2].get("error")
        assert error is not None, (path, events[-2])
        assert error["message"].startswith(
            "routed experts unavailable: ChecksumMismatchError: "
        ), (path, error)
        assert error["code"] == 500, (path, error)
        # No chunk ended the choice normally before the error.
        for event in events[:-2]:
            for choice in event.get("choices", []):
                assert choice.get("finish_reason") is None, (path, event)
    # The openai client raises the event's message while iterating.
    import openai

    with pytest.raises(openai.APIError, match="^routed experts unavailable: Check"):
        for _ in _completion(client, prompt_ids, max_tokens=6, stream=True):
            pass
    # The server and other requests are unaffected, streamed or not.
    got = _StreamedChoices()
    for chunk in _completion(client, PROMPTS[5], stream=True):
        for choice in chunk.choices:
            extra = _fields(choice)
            got.add(extra, extra.get("prompt_token_ids"))
    got.assert_exact(tiny_moe, n=1)


def test_merged_stream_outputs_keep_the_routes_error():
    """A stream whose reader falls behind gets its outputs merged
    (``RequestOutputCollector``, delta mode): the terminal output's
    ``routed_experts_error`` must survive the merge, or the stream's error
    event would lose its reason. No server needed."""
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    def output(token_ids, finish_reason=None, error=None) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text="",
            token_ids=token_ids,
            cumulative_logprob=None,
            logprobs=None,
            finish_reason=finish_reason,
            routed_experts_error=error,
        )
        return RequestOutput(
            request_id="r",
            prompt=None,
            prompt_token_ids=[1, 2],
            prompt_logprobs=None,
            outputs=[completion],
            finished=finish_reason is not None,
        )

    collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    collector.put(output([3]))
    collector.put(output([4], "error", "ChecksumMismatchError: bad object"))
    merged = collector.get_nowait()
    assert merged is not None and merged.finished
    (completion,) = merged.outputs
    assert list(completion.token_ids) == [3, 4]
    assert completion.finish_reason == "error"
    assert completion.routed_experts_error == "ChecksumMismatchError: bad object"
