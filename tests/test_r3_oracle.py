# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end R3 checked against transformers' router (the independent oracle).

Real engines on the CPU harness, tiny MoE in float32: offline ``LLM`` in eager
and compiled mode, and the HTTP server through the ``openai`` client. Every
returned route must equal transformers' top-k for the same tokens (prompt +
completion minus the last sampled token), prefix-cache hits included.

On the base as it ships, the compiled cases fail: the CPU model is traced
before the capture hook is bound and every route comes back as 0
(patches/0002-*).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from utils.oracle import expected_r3

pytestmark = pytest.mark.engine

BLOCK_SIZE = 32
SHARED_PREFIX = (
    "Reinforcement learning needs the same routes in training and inference. "
    "A router picks the top k experts for each token in each layer. "
    "The prefix cache reuses key and value blocks across requests. "
    "Every block of thirty two tokens gets a hash that chains to its parent. "
    "Shared memory lets two processes on one node exchange bytes quickly. "
)
PROMPTS = [
    "Hello, how are you today?",
    "Mixture of experts models route every token to a few experts.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text.",
    "def add(a, b): return a + b",
    "Write a short poem about the sea and the sky.",
    "Once",
]


def _engine_kwargs(tiny_moe, enforce_eager: bool) -> dict:
    return dict(
        model=str(tiny_moe),
        dtype="float32",
        enforce_eager=enforce_eager,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        enable_return_routed_experts=True,
        max_model_len=1024,
        max_num_seqs=8,
        seed=0,
    )


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llm(request, tiny_moe):
    from vllm import LLM

    engine = LLM(**_engine_kwargs(tiny_moe, enforce_eager=request.param == "eager"))
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


def _greedy(max_tokens: int = 10):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _assert_matches_oracle(tiny_moe, request_output) -> np.ndarray:
    completion = request_output.outputs[0]
    got = completion.routed_experts
    assert got is not None, "finished request carries no routed_experts"
    want = expected_r3(tiny_moe, request_output.prompt_token_ids, completion.token_ids)
    assert got.dtype == np.uint8
    assert got.shape == want.shape, (got.shape, want.shape)
    mismatch = np.argwhere(got != want)
    assert mismatch.size == 0, (
        f"{len(mismatch)} routes differ from transformers' router, first at "
        f"[token, layer, k] = {mismatch[0].tolist()}: {got[tuple(mismatch[0])]} "
        f"vs {want[tuple(mismatch[0])]}"
    )
    return got


def test_batch_matches_transformers_router(llm, tiny_moe):
    outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    for out in outputs:
        routes = _assert_matches_oracle(tiny_moe, out)
        # Not a degenerate answer: a zero-filled array would fail above, but
        # say it plainly too.
        assert routes.any()


def test_prefix_cache_hit_reuses_exact_routes(llm, tiny_moe):
    first = SHARED_PREFIX + "What did the first request ask?"
    second = SHARED_PREFIX + "The second request ends differently, see."
    (out_a,) = llm.generate([first], _greedy(), use_tqdm=False)
    (out_b,) = llm.generate([second], _greedy(), use_tqdm=False)
    assert len(out_b.prompt_token_ids) > 2 * BLOCK_SIZE
    assert (out_b.num_cached_tokens or 0) >= 2 * BLOCK_SIZE, (
        "the second prompt should hit the prefix cache; the test would not "
        "cover cached routes otherwise"
    )
    routes_a = _assert_matches_oracle(tiny_moe, out_a)
    routes_b = _assert_matches_oracle(tiny_moe, out_b)
    cached = out_b.num_cached_tokens
    np.testing.assert_array_equal(routes_a[:cached], routes_b[:cached])


def test_http_completion_and_chat_match_transformers_router(tiny_moe):
    import openai
    from server import VllmServer

    from vllm.utils.routed_experts_codec import decode_routed_experts

    flags = [
        "--served-model-name", "tiny", "--enable-return-routed-experts",
        "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "1024", "--max-num-seqs", "8", "--enforce-eager",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    extra = {"return_token_ids": True, "ignore_eos": True}
    with VllmServer(tiny_moe, flags, log_name="test-r3-http.log") as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="EMPTY")
        responses = [
            client.completions.create(
                model="tiny", prompt=SHARED_PREFIX + "First.", max_tokens=8,
                temperature=0.0, extra_body=extra,
            ),
            # Same long prefix again: a prefix-cache hit over HTTP.
            client.completions.create(
                model="tiny", prompt=SHARED_PREFIX + "Second one.", max_tokens=8,
                temperature=0.0, extra_body=extra,
            ),
        ]  # fmt: skip
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0.0,
            extra_body=extra,
        )
    # The second completion must really have hit the prefix cache.
    details = responses[1].usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= 2 * BLOCK_SIZE, (
        f"the second prompt did not hit the prefix cache: {responses[1].usage}"
    )
    for resp in responses:
        choice = resp.choices[0]
        extra_fields = choice.model_extra or {}
        got = decode_routed_experts(extra_fields["routed_experts"])
        want = expected_r3(tiny_moe, extra_fields["prompt_token_ids"], choice.token_ids)
        np.testing.assert_array_equal(got, want)
    choice = chat.choices[0]
    got = decode_routed_experts((choice.model_extra or {})["routed_experts"])
    prompt_ids = (chat.model_extra or {})["prompt_token_ids"]
    want = expected_r3(tiny_moe, prompt_ids, choice.token_ids)
    np.testing.assert_array_equal(got, want)
