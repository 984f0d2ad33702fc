# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 through the Artifact Connector in the real engine (offline ``LLM``),
row by row against transformers' router in float32.

Engines on the CPU harness: eager with async scheduling and compiled without
it (the main cases, uint8 rows), a small KV cache with chunked prefill
(preemption, int32 rows), tensor parallelism 2, a store small enough to
evict, and a model with a dense layer and 300 experts (int16 rows, zero rows
for the dense layer). Speculative decoding runs on
the GPU (tests/gpu).
After every test the publishing worker must retain nothing.
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import (
    BLOCK_SIZE,
    PROMPTS,
    SHARED_PREFIX,
    assert_exact,
    assert_nothing_retained,
    corrupt_objects,
    engine_kwargs,
    greedy,
    pickled_rpc,
    shm_root,
    store_objects,
    worker_stats,
)
from utils.tp import rank_facts

pytestmark = pytest.mark.engine


def _make(**kwargs):
    from vllm import LLM

    return LLM(**kwargs)


def _close(llm) -> None:
    # A generous timeout: on a loaded 2-core machine the default 5 s can
    # expire and the workers are killed before they remove their files.
    llm.llm_engine.engine_core.shutdown(timeout=30)
    del llm
    gc.collect()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param({"enforce_eager": True}, id="eager-async"),
        pytest.param(
            {"enforce_eager": False, "async_scheduling": False}, id="compiled-sync"
        ),
    ],
)
def llm(request, tiny_moe):
    engine = _make(**engine_kwargs(tiny_moe, **request.param))
    yield engine
    _close(engine)


@pytest.fixture(scope="module", autouse=True)
def _pickled_rpc_for_this_module():
    # For the whole module, not per call: the frontend decodes collective_rpc
    # results on its output thread, which must see the same setting.
    with pickled_rpc():
        yield


@pytest.fixture(autouse=True)
def _idle_engine_retains_nothing(request):
    yield
    for name in ("llm", "small_kv_llm", "tp2_llm", "tiny_store_llm", "dense_llm"):
        if name in request.fixturenames:
            assert_nothing_retained(request.getfixturevalue(name))


def _ids(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


# ----------------------------------------------------------------- main cases
def test_batch_matches_transformers_router(llm, tiny_moe):
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for out in outputs:
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        assert out.outputs[0].routed_experts.any()  # not a zero-filled answer


def test_n2_each_sample_has_its_own_routes(llm, tiny_moe):
    from vllm import SamplingParams

    sp = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[1]], sp, use_tqdm=False)
    assert len(out.outputs) == 2
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for completion in out.outputs:
        assert_exact(tiny_moe, out.prompt_token_ids, completion)


def test_prefix_hits_return_the_routes_first_captured(llm, tiny_moe):
    first = SHARED_PREFIX + "What did the first request ask?"
    second = SHARED_PREFIX + "The second request ends differently, see."
    (a,) = llm.generate([first], greedy(), use_tqdm=False)
    (b,) = llm.generate([second], greedy(), use_tqdm=False)
    (again,) = llm.generate([first], greedy(), use_tqdm=False)  # exact repeat
    assert (b.num_cached_tokens or 0) >= 2 * BLOCK_SIZE
    assert (again.num_cached_tokens or 0) >= 3 * BLOCK_SIZE
    # The prompt does not end on a block boundary: its last, partial block
    # is computed again and its tail published again.
    assert len(again.prompt_token_ids) % BLOCK_SIZE
    ra = assert_exact(tiny_moe, a.prompt_token_ids, a.outputs[0])
    rb = assert_exact(tiny_moe, b.prompt_token_ids, b.outputs[0])
    assert_exact(tiny_moe, again.prompt_token_ids, again.outputs[0])
    cached = b.num_cached_tokens
    np.testing.assert_array_equal(ra[:cached], rb[:cached])
    np.testing.assert_array_equal(again.outputs[0].routed_experts, ra)


def test_multi_turn_prefix_rows_equal_the_previous_turn(llm, tiny_moe):
    from vllm.inputs import TokensPrompt

    turn1_ids = _ids(llm, SHARED_PREFIX + "Turn one: tell me about routers.")
    (t1,) = llm.generate([TokensPrompt(prompt_token_ids=turn1_ids)], greedy(16))
    rows1 = t1.outputs[0].routed_experts
    turn2_ids = turn1_ids + list(t1.outputs[0].token_ids) + _ids(llm, " And then?")
    (t2,) = llm.generate([TokensPrompt(prompt_token_ids=turn2_ids)], greedy(16))
    assert (t2.num_cached_tokens or 0) >= BLOCK_SIZE * (len(rows1) // BLOCK_SIZE)
    assert_exact(tiny_moe, turn2_ids, t2.outputs[0])
    # Turn 1's whole array is a prefix of turn 2's: a trainer may overwrite.
    np.testing.assert_array_equal(t2.outputs[0].routed_experts[: len(rows1)], rows1)


def test_prompt_start_returns_the_tail_of_the_array(llm, tiny_moe):
    prompt = SHARED_PREFIX + "Only the rows from the start on."
    (full,) = llm.generate([prompt], greedy(), use_tqdm=False)
    n_prompt = len(full.prompt_token_ids)
    for start in (0, 40, n_prompt - 1, n_prompt):
        (part,) = llm.generate(
            [prompt], greedy(routed_experts_prompt_start=start), use_tqdm=False
        )
        assert_exact(tiny_moe, part.prompt_token_ids, part.outputs[0], first_row=start)
        np.testing.assert_array_equal(
            part.outputs[0].routed_experts, full.outputs[0].routed_experts[start:]
        )


def test_engine_stop_token_and_max_tokens(llm, tiny_moe):
    (free,) = llm.generate([PROMPTS[2]], greedy(12), use_tqdm=False)
    stop_id = free.outputs[0].token_ids[5]
    (stopped,) = llm.generate(
        [PROMPTS[2]], greedy(12, stop_token_ids=[stop_id]), use_tqdm=False
    )
    c = stopped.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop_id
    assert len(c.token_ids) < 12
    assert_exact(tiny_moe, stopped.prompt_token_ids, c)
    assert free.outputs[0].finish_reason == "length"
    assert_exact(tiny_moe, free.prompt_token_ids, free.outputs[0])


def test_stop_string_found_by_the_frontend(llm, tiny_moe):
    tok = llm.get_tokenizer()
    (free,) = llm.generate([PROMPTS[4]], greedy(24), use_tqdm=False)
    ids = list(free.outputs[0].token_ids)
    # A stop string spanning two tokens in the middle of the completion.
    stop = tok.decode(ids[6:8])
    assert stop.strip() and stop not in tok.decode(ids[:6])
    (out,) = llm.generate([PROMPTS[4]], greedy(24, stop=[stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < len(ids)
    assert_exact(tiny_moe, out.prompt_token_ids, c)


def test_weight_version_change_with_and_without_prefix_cache_reset(llm, tiny_moe):
    engine = llm.llm_engine
    first = SHARED_PREFIX + "Computed under the first weights."
    (a,) = llm.generate([first], greedy(), use_tqdm=False)
    assert_exact(tiny_moe, a.prompt_token_ids, a.outputs[0])
    engine.set_weight_version("v2")
    try:
        # No reset: the prefix hit lands on blocks of the old version.
        (b,) = llm.generate([SHARED_PREFIX + "After the update."], greedy())
        cb = b.outputs[0]
        assert (b.num_cached_tokens or 0) >= BLOCK_SIZE
        assert cb.routed_experts is None and cb.finish_reason == "error"
        assert cb.routed_experts_error.startswith("WeightVersionMismatchError")
        assert "reset the prefix cache" in cb.routed_experts_error.lower()
        # Only that request failed: the next one is exact.
        (c,) = llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)
        assert_exact(tiny_moe, c.prompt_token_ids, c.outputs[0])
        # With the reset the old blocks are gone; new ones carry v2.
        assert llm.reset_prefix_cache()
        (d,) = llm.generate([SHARED_PREFIX + "After the reset."], greedy())
        (e,) = llm.generate([SHARED_PREFIX + "Hit on v2 blocks."], greedy())
        assert (d.num_cached_tokens or 0) == 0
        assert (e.num_cached_tokens or 0) >= BLOCK_SIZE
        assert_exact(tiny_moe, d.prompt_token_ids, d.outputs[0])
        assert_exact(tiny_moe, e.prompt_token_ids, e.outputs[0])
    finally:
        engine.set_weight_version("default")
        llm.reset_prefix_cache()


def test_corrupted_object_fails_only_its_request(llm, tiny_moe):
    llm.reset_prefix_cache()
    victim = SHARED_PREFIX + "These routes get corrupted behind the engine."
    (a,) = llm.generate([victim], greedy(), use_tqdm=False)
    assert_exact(tiny_moe, a.prompt_token_ids, a.outputs[0])
    root = llm.llm_engine.vllm_config.artifact_config.shm_root
    places = [place for _, place in store_objects(root)]
    assert places
    corrupt_objects(root, places)
    (b,) = llm.generate([victim], greedy(), use_tqdm=False)  # prefix hit
    cb = b.outputs[0]
    assert (b.num_cached_tokens or 0) >= BLOCK_SIZE
    assert cb.routed_experts is None and cb.finish_reason == "error"
    assert cb.routed_experts_error.startswith("ChecksumMismatchError"), cb
    # The engine is healthy; a request that does not touch them is exact.
    llm.reset_prefix_cache()
    (c,) = llm.generate([PROMPTS[3]], greedy(), use_tqdm=False)
    assert_exact(tiny_moe, c.prompt_token_ids, c.outputs[0])


def test_a_stop_string_in_an_output_without_routes_is_an_error(llm, tiny_moe):
    """Defect d: the engine's terminal output carried an R3 error (its
    routes unreadable) and a stop string the detokenizer found in it; the
    old frontend answered STOP, with no routes and no error finish."""
    llm.reset_prefix_cache()
    victim = SHARED_PREFIX + "A stop string meets corrupted routes."
    (a,) = llm.generate([victim], greedy(8), use_tqdm=False)
    text = a.outputs[0].text
    # The shortest suffix that occurs nowhere earlier: found only in the
    # output of the last token.
    stop = next(
        text[-n:]
        for n in range(1, len(text) + 1)
        if text.find(text[-n:]) == len(text) - n
    )
    root = llm.llm_engine.vllm_config.artifact_config.shm_root
    corrupt_objects(root, [place for _, place in store_objects(root)])
    (b,) = llm.generate([victim], greedy(8, stop=[stop]), use_tqdm=False)
    cb = b.outputs[0]
    assert (b.num_cached_tokens or 0) >= BLOCK_SIZE
    assert cb.finish_reason == "error", (cb.finish_reason, cb.stop_reason)
    assert cb.routed_experts is None
    assert cb.routed_experts_error.startswith("ChecksumMismatchError"), cb
    llm.reset_prefix_cache()


def test_the_aux_output_path_does_not_run(llm):
    cfg = llm.llm_engine.vllm_config
    assert cfg.artifact_config.enable_routed_experts
    assert not cfg.aux_output_config.enabled

    def loaded(worker):
        return sorted(m for m in sys.modules if "aux_output_connector" in m)

    assert llm.collective_rpc(loaded) == [[]]
    assert not [m for m in sys.modules if "aux_output_connector" in m]


# ------------------------------------------- chunked prefill and preemption
@pytest.fixture(scope="module")
def small_kv_llm(tiny_moe):
    engine = _make(
        **engine_kwargs(
            tiny_moe,
            max_num_batched_tokens=64,
            max_model_len=512,
            num_gpu_blocks_override=24,
            max_num_seqs=6,
            disable_log_stats=False,
            artifact_config={"shm_root": shm_root(), "routed_experts_dtype": "int32"},
        )
    )
    yield engine
    _close(engine)


def _num_preemptions(llm) -> int:
    return int(
        sum(
            m.value
            for m in llm.get_metrics()
            if m.name == "vllm:num_preemptions" and hasattr(m, "value")
        )
    )


def test_chunked_prefill_and_preemption_stay_exact(small_kv_llm, tiny_moe):
    llm = small_kv_llm
    long_prompt = " ".join([SHARED_PREFIX] * 3)  # several 64-token chunks
    prompts = [long_prompt + f" Variant {i}." for i in range(6)]
    before = _num_preemptions(llm)
    outs = llm.generate(prompts, greedy(48), use_tqdm=False)
    assert _num_preemptions(llm) > before, "the KV cache was large enough"
    for out in outs:
        assert len(out.prompt_token_ids) > 2 * 64
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0], dtype=np.int32)


# ------------------------------------------------- tensor parallelism
@pytest.fixture(scope="module")
def tp2_llm(tiny_moe):
    # One CPU worker per rank, each on its own core (cpu-harness notes).
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        engine = _make(**engine_kwargs(tiny_moe, tensor_parallel_size=2))
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    yield engine
    _close(engine)


def test_tensor_parallel_2_every_rank_captures_rank_0_publishes(tp2_llm, tiny_moe):
    llm = tp2_llm
    (first,) = llm.generate([SHARED_PREFIX + "one"], greedy(), use_tqdm=False)
    outs = llm.generate([SHARED_PREFIX + "two", *PROMPTS[:2]], greedy(), use_tqdm=False)
    for out in (first, *outs):
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    assert (outs[0].num_cached_tokens or 0) >= 2 * BLOCK_SIZE

    # One request alone: the last forward's first row is its last route.
    (last,) = llm.generate([PROMPTS[3]], greedy(), use_tqdm=False)
    want = assert_exact(tiny_moe, last.prompt_token_ids, last.outputs[0])
    rank0, rank1 = llm.collective_rpc(rank_facts)
    assert (rank0["global_rank"], rank0["tp_rank"]) == (0, 0)
    assert (rank1["global_rank"], rank1["tp_rank"]) == (1, 1)
    assert rank0["pid"] != rank1["pid"]
    # Both ranks captured the routes of every layer ...
    for rank in (rank0, rank1):
        assert rank["capture_row0"] == want[-1].tolist(), rank
    # ... only rank 0 publishes and holds the store; rank 1 has nothing
    # under the root open or mapped.
    assert rank0["publishes"] and rank0["store_files_in_use"]
    assert not rank1["publishes"] and rank1["store_files_in_use"] == []
    cfg = llm.llm_engine.vllm_config.artifact_config
    assert os.listdir(cfg.shm_root) == [cfg.namespace(0)]


# How long a held publication thread waits at most, so that a failing test
# (a rank stuck on the publication) still ends: it outlasts the test's wait
# for the steps.
STALL_S = 60.0
DECODE_WAIT_S = 30.0


def _stall_publication(worker) -> bool:
    """Rank 0's publication thread waits before each work item until
    :func:`_resume_publication` (or ``STALL_S``); returns whether this rank
    publishes."""
    import threading

    publisher = worker.model_runner.artifact_connector._publisher
    if publisher is None:
        return False
    publication = publisher._publication
    gate, entered = threading.Event(), threading.Event()
    process = publication._process

    def stalled(work):
        entered.set()
        gate.wait(STALL_S)
        process(work)

    publication._process = stalled
    worker._r3_stall = (publication, process, gate, entered)
    return True


def _resume_publication(worker) -> bool | None:
    """Undo :func:`_stall_publication`; returns whether the thread was
    waiting at the gate (None on a rank that does not publish)."""
    stall = getattr(worker, "_r3_stall", None)
    if stall is None:
        return None
    publication, process, gate, entered = stall
    publication._process = process
    gate.set()
    del worker._r3_stall
    return entered.is_set()


def test_tensor_parallel_2_no_collective_waits_on_publication(tp2_llm, tiny_moe):
    """Rank 0's publication thread is held while a request decodes: every
    step still runs on both ranks (their forwards meet in all-reduces), so
    no rank waits on the publication. Only the finish waits for it, for its
    acknowledgement; once released, the routes are exact."""
    import threading

    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm, engine = tp2_llm, tp2_llm.llm_engine
    max_tokens = 12
    # Three full blocks at prefill and no block completed while decoding:
    # the held thread's queue (start, prefill blocks, finalize) stays
    # below the publisher's back-pressure bound.
    ids = np.random.default_rng(5).integers(10, 400, 3 * BLOCK_SIZE + 2).tolist()
    assert len(ids) % BLOCK_SIZE + max_tokens < BLOCK_SIZE
    assert llm.collective_rpc(_stall_publication) == [True, False]
    tokens: list[int] = []
    finished = []

    def step() -> None:
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
            if out.finished:
                finished.append(out)

    def decode() -> None:
        while not finished:
            step()
            if not finished and len(tokens) == max_tokens - 1:
                return  # the last token comes with the held terminal output

    try:
        engine.add_request(
            "held",
            TokensPrompt(prompt_token_ids=ids),
            greedy(max_tokens, output_kind=RequestOutputKind.DELTA),
        )
        stepper = threading.Thread(target=decode, daemon=True)
        stepper.start()
        stepper.join(timeout=DECODE_WAIT_S)
        assert not stepper.is_alive(), f"steps stopped at {len(tokens)} tokens"
        assert not finished, "finished before its routes were published"
        assert len(tokens) == max_tokens - 1
    finally:
        waited = llm.collective_rpc(_resume_publication)
    assert waited == [True, None], "the publication thread was never held"
    while not finished:
        step()
    (out,) = finished
    assert len(tokens) == max_tokens
    completion = out.outputs[0]
    assert completion.routed_experts_error is None
    assert completion.routed_experts.shape[0] == len(ids) + max_tokens - 1
    assert np.array_equal(completion.routed_experts, expected_r3(tiny_moe, ids, tokens))


# --------------------------------------------- routes evicted from the store
@pytest.fixture(scope="module")
def tiny_store_llm(tiny_moe):
    # 192 KiB: two 64 KiB arenas and the log; older arenas are evicted.
    engine = _make(
        **engine_kwargs(
            tiny_moe,
            max_model_len=2048,
            max_num_batched_tokens=2048,
            artifact_config={"shm_root": shm_root(), "capacity_bytes": 192 << 10},
        )
    )
    yield engine
    _close(engine)


def test_evicted_routes_fail_only_the_request_that_finds_them_lost(
    tiny_store_llm, tiny_moe
):
    from vllm.inputs import TokensPrompt

    llm = tiny_store_llm
    rng = np.random.default_rng(3)
    vocab = llm.get_tokenizer().vocab_size

    def prompt(n: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=rng.integers(10, vocab, n).tolist())

    victim = prompt(40 * BLOCK_SIZE + 5)
    (a,) = llm.generate([victim], greedy(2), use_tqdm=False)
    assert_exact(tiny_moe, a.prompt_token_ids, a.outputs[0])
    # Other requests' routes push the victim's out of the store, while its
    # KV blocks stay in the (much larger) KV cache.
    for _ in range(6):
        llm.generate([prompt(60 * BLOCK_SIZE)] * 1, greedy(1), use_tqdm=False)
        if worker_stats(llm)["evicted_objects"] > 40:
            break
    assert worker_stats(llm)["evicted_objects"] > 40
    (b,) = llm.generate([victim], greedy(2), use_tqdm=False)
    cb = b.outputs[0]
    assert (b.num_cached_tokens or 0) >= BLOCK_SIZE
    assert cb.routed_experts is None and cb.finish_reason == "error"
    assert cb.routed_experts_error.startswith("ObjectMissingError"), cb
    # Defect k: only the request that found the routes lost fails. The block
    # left the prefix cache, so the same prompt again is recomputed and
    # exact (the old code failed every hit until KV evicted the block).
    (d,) = llm.generate([victim], greedy(2), use_tqdm=False)
    assert_exact(tiny_moe, d.prompt_token_ids, d.outputs[0])
    assert (d.num_cached_tokens or 0) < BLOCK_SIZE
    (c,) = llm.generate([prompt(3 * BLOCK_SIZE)], greedy(), use_tqdm=False)
    assert_exact(tiny_moe, c.prompt_token_ids, c.outputs[0])


# ------------------------------------------------- speculative decoding
# Model Runner V2's ngram proposer is a Triton kernel that Triton's CPU
# interpreter cannot run ("mask has unsupported dtype" in
# _ngram_finalize_kernel), so speculative decoding is tested on the GPU
# (tests/gpu); the row handling of rejected drafts is unit-tested in
# tests/artifact_connector/test_connector.py.


# --------------------------------------- dense layers and > 256 experts
@pytest.fixture(scope="module")
def dense_model():
    from build_tiny_moe import TinyMoEParams, build
    from harness_env import CACHE

    params = TinyMoEParams(layers=3, experts=300, top_k=2, dense_layers=[1])
    return build(CACHE / "models" / "tiny-moe-dense-300", params)


@pytest.fixture(scope="module")
def dense_llm(dense_model):
    engine = _make(**engine_kwargs(dense_model))
    yield engine
    _close(engine)


def test_dense_layer_rows_are_zero_and_ids_are_int16(dense_llm, dense_model):
    outs = dense_llm.generate(PROMPTS[:3], greedy(), use_tqdm=False)
    for out in outs:
        want = assert_exact(
            dense_model, out.prompt_token_ids, out.outputs[0], dtype=np.int16
        )
        routes = out.outputs[0].routed_experts
        assert routes.shape[1] == 3
        assert not routes[:, 1].any()  # the dense layer
        assert (routes[:, [0, 2]] > 255).any()  # ids beyond uint8
        assert want.shape == routes.shape


def test_oracle_sees_the_dense_layer(dense_model):
    # The oracle itself: zero rows exactly at the dense layer.
    want = expected_r3(dense_model, [1, 2, 3, 4], [5])
    assert want.shape == (4, 3, 2) and not want[:, 1].any() and want[:, 0].any()
