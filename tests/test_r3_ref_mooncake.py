# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routes by reference through a Mooncake Store (``ref_transport:
mooncake``): a real ``mooncake_master`` on 127.0.0.1 (TCP), a real ``LLM``
that puts each ``ref`` request's routes into the store, and a consumer
process that imports only ``vllm_host_transport.routed_experts`` and
Mooncake's client (never vLLM or torch) and fetches them by key. Arrays are
checked against transformers' router in float32; the master stopped and
restarted under the engine gives typed errors, and the engine keeps
serving."""

from __future__ import annotations

import time

import numpy as np
import pytest
from utils.mooncake import running_master
from utils.oracle import expected_r3
from utils.r3 import PROMPTS, engine_kwargs, greedy
from utils.routes_consumer import Consumer

pytestmark = pytest.mark.engine

mooncake = pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)


@pytest.fixture(scope="module")
def master():
    with running_master("mooncake-master") as m:
        yield m


@pytest.fixture(scope="module")
def consumer(tmp_path_factory, master):
    c = Consumer(tmp_path_factory.mktemp("mooncake-consumer"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def llm(tiny_moe, master):
    from vllm import LLM

    kwargs = engine_kwargs(tiny_moe)
    kwargs["artifact_config"].update(
        routed_experts_format="ref",
        ref_transport="mooncake",
        mooncake_master=master.address,
        mooncake_segment_bytes=64 << 20,
        mooncake_buffer_bytes=32 << 20,
    )
    engine = LLM(**kwargs)
    yield engine
    engine.llm_engine.engine_core.shutdown(timeout=30)
    del engine


def _one(llm, prompt, **kw):
    (out,) = llm.generate([prompt], greedy(8, **kw), use_tqdm=False)
    return out


def _assert_exact(consumer, tiny_moe, out) -> None:
    c = out.outputs[0]
    assert c.routed_experts is None and c.routed_experts_error is None
    ref = c.routed_experts_ref
    assert ref.transport == "mooncake"
    got = consumer.fetch(ref.to_json())
    assert isinstance(got, np.ndarray), got
    np.testing.assert_array_equal(
        got, expected_r3(tiny_moe, out.prompt_token_ids, c.token_ids)
    )
    assert got.any()


def test_routes_through_mooncake_equal_the_router(llm, consumer, tiny_moe):
    a = _one(llm, PROMPTS[0])
    _assert_exact(consumer, tiny_moe, a)
    _assert_exact(consumer, tiny_moe, a)  # readable until removed
    b = _one(llm, PROMPTS[1], routed_experts_prompt_start=5)
    ref = b.outputs[0].routed_experts_ref
    assert ref.prompt_start == 5
    got = consumer.fetch(ref.to_json())
    want = expected_r3(tiny_moe, b.prompt_token_ids, b.outputs[0].token_ids)
    np.testing.assert_array_equal(got, want[5:])
    # An object the store does not have (evicted, removed): a typed error.
    gone = dict(ref.to_json(), key="0" * 32)
    assert consumer.fetch(gone) == "RouteRefMissingError"
    # Inline on request, from the same engine.
    inline = _one(llm, PROMPTS[2], routed_experts_format="inline")
    assert inline.outputs[0].routed_experts_ref is None
    np.testing.assert_array_equal(
        inline.outputs[0].routed_experts,
        expected_r3(tiny_moe, inline.prompt_token_ids, inline.outputs[0].token_ids),
    )


def test_master_down_and_restarted(llm, consumer, master, tiny_moe):
    before = _one(llm, PROMPTS[3])
    master.stop()
    # The engine cannot hand the routes out: the request says why, typed.
    down = _one(llm, PROMPTS[4])
    assert down.outputs[0].routed_experts_ref is None
    assert down.outputs[0].routed_experts_error.startswith("RouteRefPublishError"), (
        down.outputs[0].routed_experts_error
    )
    # The consumer cannot reach the store: typed, never a partial array.
    assert consumer.fetch(before.outputs[0].routed_experts_ref.to_json()) in (
        "RouteRefTransportError",
        "RouteRefMissingError",
    )
    # The engine keeps serving (inline routes need no store of Mooncake's).
    ok = _one(llm, PROMPTS[0], routed_experts_format="inline")
    assert ok.outputs[0].routed_experts is not None
    master.start()
    # Once the engine's client is back in (it reconnects on its own), refs
    # flow again; what the old master held is gone.
    deadline = time.monotonic() + 60
    while True:
        again = _one(llm, PROMPTS[1])
        if again.outputs[0].routed_experts_ref is not None:
            break
        assert time.monotonic() < deadline, again.outputs[0].routed_experts_error
        time.sleep(1.0)
    _assert_exact(consumer, tiny_moe, again)


def test_a_zero_row_reference_fetches_an_empty_array(llm, consumer, tiny_moe):
    """``routed_experts_prompt_start`` at the prompt's length with one output
    token names no rows: the reference still fetches, an empty array of the
    routes' shape (an empty payload once read as missing over Mooncake)."""
    ids = [11, 12, 13, 14, 15, 16, 17]
    (out,) = llm.generate(
        [{"prompt_token_ids": ids}],
        greedy(1, routed_experts_prompt_start=len(ids)),
        use_tqdm=False,
    )
    c = out.outputs[0]
    assert c.routed_experts_error is None, c.routed_experts_error
    ref = c.routed_experts_ref
    assert ref.transport == "mooncake" and ref.shape[0] == 0, ref
    got = consumer.fetch(ref.to_json())
    assert isinstance(got, np.ndarray), got
    want = expected_r3(tiny_moe, ids, c.token_ids)[len(ids) :]
    assert got.shape == want.shape == (0, *want.shape[1:])
    assert got.dtype == np.dtype(ref.dtype) == np.uint8  # the routes' dtype
