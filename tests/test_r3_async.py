# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 on every way ``AsyncLLM`` ends a request other than a plain finish, in
a real engine on the CPU harness (async scheduling on), checked against
transformers' router in float32: an explicit ``abort`` (routes of exactly
the returned tokens), an abort before the first token (no routes, and why),
a cancelled ``generate`` (the client is gone: nothing retained), verl's own
pause call (``pause_generation(wait_for_inflight_requests=False, ...)``) and
the keyword's conflicts, and streaming-input requests (refused)."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings

import pytest
from utils.r3 import (
    PROMPTS,
    assert_exact,
    assert_nothing_retained,
    engine_kwargs,
    greedy,
    pickled_rpc,
    store_objects,
)

pytestmark = pytest.mark.engine


class _Engine:
    """An AsyncLLM with its own event loop, driven from the sync tests."""

    def __init__(self, model) -> None:
        from transformers import AutoTokenizer

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.loop = asyncio.new_event_loop()
        # Chunked prefill: a long prompt takes several steps.
        kwargs = engine_kwargs(model, max_num_batched_tokens=64)
        self.root = kwargs["artifact_config"]["shm_root"]
        args = AsyncEngineArgs(**kwargs)
        self.llm = self.run(self._start(AsyncLLM, args))

    @staticmethod
    async def _start(cls, args):
        return cls.from_engine_args(args)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def collective_rpc(self, fn):
        return self.run(self.llm.collective_rpc(fn))

    def close(self) -> None:
        self.llm.shutdown()
        # Let the cancelled output tasks finish on their loop, so their zmq
        # sockets are closed: a socket left open makes the context's term()
        # (run by the garbage collector, maybe in a later test) block.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()


@pytest.fixture(scope="module")
def engine(tiny_moe):
    with pickled_rpc():
        eng = _Engine(tiny_moe)
        yield eng
        eng.close()
        del eng
        gc.collect()


@pytest.fixture(autouse=True)
def _idle_engine_retains_nothing(engine):
    yield
    assert_nothing_retained(engine)


async def _collect(llm, prompt_ids, params, request_id, tokens_seen=None):
    """Run one request to its final output; ``tokens_seen`` (an Event) is
    set once it has returned ``n`` tokens (``tokens_seen.n``)."""
    from vllm.inputs import TokensPrompt

    final = None
    async for out in llm.generate(
        TokensPrompt(prompt_token_ids=prompt_ids), params, request_id
    ):
        final = out
        if tokens_seen is not None and len(out.outputs[0].token_ids) >= tokens_seen.n:
            tokens_seen.set()
    return final


def _event(n: int) -> asyncio.Event:
    ev = asyncio.Event()
    ev.n = n  # type: ignore[attr-defined]
    return ev


async def _running(engine, ids, max_tokens: int, request_id: str, tokens: int):
    """Start a greedy request; return its task once it has returned
    ``tokens`` tokens."""
    seen = _event(tokens)
    task = asyncio.create_task(
        _collect(engine.llm, ids, greedy(max_tokens), request_id, seen)
    )
    await asyncio.wait_for(seen.wait(), 120)
    return task


def test_explicit_abort_returns_routes_of_the_returned_tokens(engine, tiny_moe):
    """AsyncLLM.abort(request_id) by the caller (verl, SkyRL): the final
    ABORT output holds the tokens it was sent and routes covering exactly
    the prompt and those tokens (the old code answered with no routes and
    no reason)."""
    ids = engine.tokens(PROMPTS[0])

    async def scenario():
        task = await _running(engine, ids, 400, "abort-me", 4)
        await engine.llm.abort("abort-me")
        return await asyncio.wait_for(task, 120)

    out = engine.run(scenario()).outputs[0]
    assert out.finish_reason == "abort", out.finish_reason
    assert 4 <= len(out.token_ids) < 400
    assert_exact(tiny_moe, ids, out)


def test_an_abort_the_engine_never_answers_ends_with_the_reason(engine):
    """The frontend's bound on an explicit abort: when the engine sends no
    terminal output (here: the abort held in the frontend is never sent),
    the request ends at its deadline without routes, saying why, instead of
    waiting forever."""
    from vllm.distributed.artifact_connector import frontend
    from vllm.distributed.artifact_connector.protocol import abort_items

    ids = engine.tokens(PROMPTS[1])

    async def scenario():
        task = await _running(engine, ids, 400, "unanswered", 2)
        routes = engine.llm.output_processor.routed_experts
        (internal,) = engine.llm.output_processor.external_req_ids["unanswered"]
        wait_s = frontend.ABORT_WAIT_S
        frontend.ABORT_WAIT_S = 0.0  # the deadline is now
        try:
            assert routes.hold_abort(internal, client_gone=False)
        finally:
            frontend.ABORT_WAIT_S = wait_s
        routes.expire([internal])
        out = await asyncio.wait_for(task, 30)
        # The frontend is done with it; the engine gets the abort now.
        await engine.llm.engine_core.abort_requests_async(
            abort_items([internal], caller_waits=False)
        )
        return out

    out = engine.run(scenario()).outputs[0]
    assert out.finish_reason == "abort"
    assert out.routed_experts is None
    assert out.routed_experts_error.startswith("ArtifactAbortTimeout"), (
        out.routed_experts_error
    )


def test_abort_before_the_first_token_says_why(engine, tiny_moe):
    ids = engine.tokens(PROMPTS[1] * 8)

    async def scenario():
        task = asyncio.create_task(_collect(engine.llm, ids, greedy(50), "early"))
        op = engine.llm.output_processor
        while "early" not in op.external_req_ids:  # added, not yet decoded
            await asyncio.sleep(0)
        await engine.llm.abort("early")
        return await asyncio.wait_for(task, 120)

    out = engine.run(scenario()).outputs[0]
    assert out.finish_reason == "abort"
    if out.token_ids:  # the engine was quicker: then the routes are exact
        assert_exact(tiny_moe, ids, out)
    else:
        assert out.routed_experts is None
        assert out.routed_experts_error.startswith("RequestAbortedError"), (
            out.routed_experts_error
        )


def _long_prompt(engine, seed: int, n: int = 20 * 32 + 5) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(10, 400, n).tolist()


def test_blocks_of_an_attempt_aborted_mid_prefill_are_published(engine, tiny_moe):
    """Defect a end to end: aborted before its first token, mid prefill
    (async scheduling, 64-token chunks, another request keeping the batch
    queue full). The KV blocks computed stay cached, and the next request
    hitting them is exact. The interleaving that lost rows in the old code
    (the discard taken before the rows of the chunk in flight) is forced in
    tests/artifact_connector/test_publisher.py::
    test_a_discard_drains_full_blocks_then_releases: on the CPU harness the
    worker processes a step's rows before it begins the next one."""
    ids = _long_prompt(engine, 1, 30 * 32 + 5)

    async def scenario():
        busy = await _running(engine, engine.tokens(PROMPTS[0]), 300, "busy", 2)
        before = {k for k, _ in store_objects(engine.root)}
        task = asyncio.create_task(_collect(engine.llm, ids, greedy(4), "mid-prefill"))
        # Each step now decodes one busy token (one block per 32 steps) and
        # prefills 63 of the 965-token prompt (two blocks): 3 new objects
        # mean a few chunks are computed and about 13 to go, on any machine.
        deadline = time.monotonic() + 60
        while len({k for k, _ in store_objects(engine.root)} - before) < 3:
            assert time.monotonic() < deadline, "the prefill never published"
            await asyncio.sleep(0.002)
        await engine.llm.abort("mid-prefill")
        aborted = await asyncio.wait_for(task, 120)
        again = await _collect(engine.llm, ids, greedy(4), "same-prompt")
        await busy
        return aborted, again

    aborted, again = engine.run(scenario())
    assert aborted.outputs[0].finish_reason == "abort"
    assert not aborted.outputs[0].token_ids, "the prefill finished first"
    assert (again.num_cached_tokens or 0) >= 32, "no prefix hit"
    assert_exact(tiny_moe, ids, again.outputs[0])


def test_abort_while_a_preempted_request_recomputes(engine, tiny_moe):
    """Defect c: preempted after it returned tokens, resumed, and aborted
    while it recomputes its 650 tokens (ten chunks). The rows are those of
    the preempted attempt; the old code waited 5 s for the new attempt's
    rows, then answered CoverageError."""
    ids = _long_prompt(engine, 2)

    async def scenario():
        task = await _running(engine, ids, 200, "recompute", 3)
        # Preempts every running request (its KV is gone: it recomputes
        # from the first token).
        assert await engine.llm.reset_prefix_cache(reset_running_requests=True)
        await engine.llm.abort("recompute")
        return await asyncio.wait_for(task, 120)

    out = engine.run(scenario()).outputs[0]
    assert out.finish_reason == "abort"
    assert out.routed_experts_error is None, out.routed_experts_error
    assert_exact(tiny_moe, ids, out)


def test_a_cancelled_generate_retains_nothing(engine, tiny_moe):
    """The client is gone (generate() cancelled, what a disconnect does):
    its abort tells the engine, which drains the attempt and reads nothing;
    the next request is exact (the autouse check: nothing retained)."""
    ids = engine.tokens(PROMPTS[2])

    async def scenario():
        task = await _running(engine, ids, 400, "gone", 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _collect(engine.llm, ids, greedy(8), "after")

    out = engine.run(scenario()).outputs[0]
    assert_exact(tiny_moe, ids, out)


def test_verls_pause_call_aborts_with_routes_and_pauses(engine, tiny_moe):
    """verl's abort_all_requests() calls exactly this; 0.32.0 raised
    TypeError on the keyword, so verl never paused."""
    ids = engine.tokens(PROMPTS[3])

    async def scenario():
        task = await _running(engine, ids, 400, "paused", 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await engine.llm.pause_generation(
                wait_for_inflight_requests=False, clear_cache=True
            )
        out = await asyncio.wait_for(task, 120)
        paused = await engine.llm.is_paused()
        await engine.llm.resume_generation()
        return out, paused, caught

    out, paused, caught = engine.run(scenario())
    assert paused
    assert [str(w.message) for w in caught if w.category is FutureWarning] in (
        [],  # warned once per process, by an earlier call
        [
            "pause_generation(wait_for_inflight_requests=...) is deprecated; "
            "use mode='abort'"
        ],
    )
    completion = out.outputs[0]
    assert completion.finish_reason == "abort"
    assert 4 <= len(completion.token_ids) < 400
    assert_exact(tiny_moe, ids, completion)


def test_pause_keywords_that_disagree_are_refused(engine):
    with pytest.raises(
        ValueError, match="wait_for_inflight_requests=True means mode='wait'"
    ):
        engine.run(
            engine.llm.pause_generation(mode="abort", wait_for_inflight_requests=True)
        )
    assert not engine.run(engine.llm.is_paused())


def test_pause_alias_maps_to_the_modes():
    from vllm.v1.engine.pause_alias import pause_mode_from_alias

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert pause_mode_from_alias(None, False) == "abort"
        assert pause_mode_from_alias(None, True) == "wait"
        assert pause_mode_from_alias("wait", True) == "wait"
    assert pause_mode_from_alias(None, None) == "abort"
    assert pause_mode_from_alias("keep", None) == "keep"


def test_streaming_input_is_refused_with_r3(engine):
    """Defect i: each input chunk started a new attempt without ending the
    old one, and the session ended with no routes and no reason."""
    from vllm.engine.protocol import StreamingInput
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    async def chunks():
        yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=[1, 2, 3]))

    async def scenario():
        async for _ in engine.llm.generate(chunks(), greedy(4), "streamed"):
            pass

    with pytest.raises(VLLMValidationError, match="streaming-input requests"):
        engine.run(scenario())
