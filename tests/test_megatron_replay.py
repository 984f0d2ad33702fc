# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""megatron_replay: references in, megatron-core 0.16.1's RouterReplay input
out. The layout is checked against a literal construction (pad each
sequence, cut its CP chunks, concatenate, pad the batch, cut the SP part);
megatron-core's own ``RouterReplay`` in ``REPLAY_FORWARD`` must then
replay exactly those routes; and the references of a real engine
(``LLM.generate`` with ``routed_experts_format="ref"``) replay the routes
transformers' router computes for the same tokens."""

from __future__ import annotations

import importlib.util
import uuid

import numpy as np
import pytest

from vllm_host_transport.megatron_replay import PAD, replay_inputs, token_rows
from vllm_host_transport.routed_experts import RoutedExpertsRef, RouteRefInvalidError
from vllm_host_transport.routes_format import encode
from vllm_host_transport.routes_layers import moe_layers_of_stage
from vllm_host_transport.routes_reader import release

torch = pytest.importorskip("torch")

NEEDS_MCORE = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core is not installed (make setup installs 0.16.1 --no-deps)",
)
TOP_K = 2
EXPERTS = 8


def _literal(
    arrays, seq_lens, *, align, total_align=1, cp=1, cp_rank=0, sp=1, sp_rank=0
):
    """The THD layout built step by step as the trainers do it: [tokens, L, K]
    with padding rows set to experts 0..K-1."""
    layers, k = arrays[0].shape[1:]
    pad_row = np.broadcast_to(np.arange(k), (1, layers, k))
    align = np.lcm(align, 2 * cp) if cp > 1 else align
    parts = []
    for a, n in zip(arrays, seq_lens):
        full = np.concatenate([a, a[-1:]])[:n]  # the last token repeats a row
        padded = -(-n // align) * align
        full = np.concatenate([full] + [pad_row] * (padded - n))
        if cp == 1:
            parts.append(full)
            continue
        chunks = np.split(full, 2 * cp)
        parts += [chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]]
    out = np.concatenate(parts)
    out = np.concatenate([out] + [pad_row] * (-len(out) % total_align))
    return np.split(out, sp)[sp_rank]


def _gather(arrays, seq, row):
    k = arrays[0].shape[2]
    out = np.empty((len(seq), arrays[0].shape[1], k), np.int64)
    for j, (i, r) in enumerate(zip(seq, row)):
        out[j] = np.arange(k) if r == PAD else arrays[i][r]
    return out


def _routes(rng, rows, layers=4):
    """Random routes with distinct experts per token, as a router makes."""
    return np.argsort(rng.random((rows, layers, EXPERTS)), axis=-1)[..., :TOP_K].astype(
        np.uint8
    )


@pytest.mark.parametrize(
    "align,total_align,cp,sp",
    [
        (1, 1, 1, 1),
        (4, 1, 1, 4),
        (1, 8, 1, 2),
        (2, 1, 2, 2),
        (1, 1, 4, 1),
        (3, 2, 2, 1),
    ],
)
def test_thd_layout_is_the_literal_one(align, total_align, cp, sp):
    rng = np.random.default_rng(0)
    arrays = [_routes(rng, r) for r in (6, 11, 1, 9)]
    seq_lens = [7, 12, 2, 8]  # the last sequence cut one token short of its rows
    for cp_rank in range(cp):
        for sp_rank in range(sp):
            seq, row = token_rows(
                [len(a) for a in arrays],
                seq_lens,
                seq_align=align,
                total_align=total_align,
                cp_size=cp,
                cp_rank=cp_rank,
                sp_size=sp,
                sp_rank=sp_rank,
            )
            want = _literal(
                arrays,
                seq_lens,
                align=align,
                total_align=total_align,
                cp=cp,
                cp_rank=cp_rank,
                sp=sp,
                sp_rank=sp_rank,
            )
            np.testing.assert_array_equal(_gather(arrays, seq, row), want)


def test_sbhd_layout_is_s_major():
    rng = np.random.default_rng(1)
    arrays = [_routes(rng, r) for r in (3, 5)]
    seq, row = token_rows([3, 5], layout="sbhd", seq_length=8, sp_size=2, sp_rank=1)
    # [s=8, b=2] s-major; SP rank 1 of 2 keeps s = 4..7.
    assert seq.tolist() == [0, 1] * 4
    assert row.tolist() == [PAD, 4, PAD, 4, PAD, PAD, PAD, PAD]
    assert _gather(arrays, seq, row)[1].tolist() == arrays[1][4].tolist()


def test_bad_layouts_are_typed():
    with pytest.raises(RouteRefInvalidError, match="at most 4 tokens"):
        token_rows([3], [5])
    with pytest.raises(RouteRefInvalidError, match="sequence-parallel"):
        token_rows([4], sp_size=2)  # 5 tokens over 2 ranks
    with pytest.raises(RouteRefInvalidError, match="layout"):
        token_rows([4], layout="bshd")


@pytest.fixture
def host_refs():
    """Store routes in a real host-transport scope; yield a function that
    makes a reference of an array; remove the scope afterwards."""
    from vllm_host_transport import HostTransportConfig, HostTransportConnector

    conn = HostTransportConnector(
        HostTransportConfig(scope=f"test-replay-{uuid.uuid4().hex}", host_ring_bytes=0)
    )

    def make(rows: np.ndarray) -> RoutedExpertsRef:
        # Small digested chunks, so a rank's rows span several of them.
        payload = encode(rows, "xxh3_64", block_rows=4)
        key = uuid.uuid4().hex
        assert conn.put_readable(key, payload.parts)
        return RoutedExpertsRef.for_payload(
            payload, transport="host", location=conn.scope_name, key=key
        )

    yield make
    conn.close()


def _replay(routers, tensors, expected, layer_pos):
    """megatron-core's replay of ``tensors`` on random scores returns, for
    each router, the rows of ``expected`` of its layer."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import (
        RouterReplay,
        RouterReplayAction,
    )

    RouterReplay.set_replay_data(tensors)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    for router, pos in zip(routers, layer_pos):
        scores = torch.randn(expected.shape[0], EXPERTS)
        _, top = router.get_replay_topk(scores, TOP_K)
        np.testing.assert_array_equal(top.numpy(), expected[:, pos])
        # The router's own path: every token goes to exactly its top-k experts.
        _, routing_map = topk_routing_with_score_function(
            scores, TOP_K, router_replay=router
        )
        assert routing_map.sum(dim=1).eq(TOP_K).all()
        want = np.zeros((expected.shape[0], EXPERTS), bool)
        np.put_along_axis(want, expected[:, pos].astype(np.int64), True, axis=1)
        np.testing.assert_array_equal(routing_map.numpy(), want)
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()


@NEEDS_MCORE
@pytest.mark.parametrize("cp,sp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_megatron_router_replay_forward(host_refs, cp, sp):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # 4 decoder layers, layer 0 dense, 2 pipeline stages: stage 0 has the
    # router of layer 1, stage 1 those of layers 2 and 3.
    config = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 4,
        "num_experts": EXPERTS,
        "mlp_only_layers": [0],
    }
    rng = np.random.default_rng(2)
    arrays = [_routes(rng, r) for r in (9, 14, 5)]
    refs = [host_refs(a) for a in arrays]
    seq_lens = [len(a) + 1 for a in arrays]
    try:
        for stage in range(2):
            layers = moe_layers_of_stage(config, stage, 2)
            assert layers == ([1] if stage == 0 else [2, 3])
            RouterReplay.clear_global_router_replay_instances()
            routers = [RouterReplay() for _ in layers]  # what each MoE layer makes
            for cp_rank in range(cp):
                for sp_rank in range(sp):
                    tensors = replay_inputs(
                        refs,
                        layers,
                        seq_align=sp,
                        cp_size=cp,
                        cp_rank=cp_rank,
                        sp_size=sp,
                        sp_rank=sp_rank,
                    )
                    assert all(
                        t.dtype == torch.int64 and t.is_contiguous() for t in tensors
                    )
                    expected = _literal(
                        arrays,
                        seq_lens,
                        align=sp,
                        cp=cp,
                        cp_rank=cp_rank,
                        sp=sp,
                        sp_rank=sp_rank,
                    )
                    _replay(routers, tensors, expected, layers)
    finally:
        RouterReplay.clear_global_router_replay_instances()
        release(refs)


def test_prompt_start_must_be_zero(host_refs):
    ref = host_refs(np.zeros((3, 2, TOP_K), np.uint8))
    shifted = RoutedExpertsRef.from_json({**ref.to_json(), "prompt_start": 1})
    with pytest.raises(RouteRefInvalidError, match="prompt_start"):
        replay_inputs([shifted], [0])
    release([ref])


@NEEDS_MCORE
@pytest.mark.engine
def test_engine_references_replay_the_oracle(tiny_moe):
    """A real ``LLM`` hands out references; each of 2 pipeline stages x 2
    sequence-parallel ranks builds its replay input from them, and
    megatron-core replays the routes transformers' router computes."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from utils.oracle import expected_r3
    from utils.r3 import PROMPTS, engine_kwargs, greedy

    from vllm import LLM

    kwargs = engine_kwargs(tiny_moe)
    kwargs["artifact_config"].update(ref_scope=f"replay-{uuid.uuid4().hex[:12]}")
    llm = LLM(**kwargs)
    refs: list[RoutedExpertsRef] = []
    try:
        outs = llm.generate(
            PROMPTS[:3], greedy(6, routed_experts_format="ref"), use_tqdm=False
        )
        for o in outs:
            ref = o.outputs[0].routed_experts_ref
            assert ref is not None, o.outputs[0].routed_experts_error
            refs.append(ref)
        ids = [
            (list(o.prompt_token_ids or []), list(o.outputs[0].token_ids)) for o in outs
        ]
        arrays = [expected_r3(tiny_moe, p, c) for p, c in ids]
        seq_lens = [len(p) + len(c) for p, c in ids]
        for stage in range(2):
            layers = moe_layers_of_stage(tiny_moe, stage, 2)
            RouterReplay.clear_global_router_replay_instances()
            routers = [RouterReplay() for _ in layers]
            for sp_rank in range(2):
                tensors = replay_inputs(
                    [r.to_json() for r in refs],
                    layers,
                    seq_align=2,
                    sp_size=2,
                    sp_rank=sp_rank,
                )
                expected = _literal(arrays, seq_lens, align=2, sp=2, sp_rank=sp_rank)
                _replay(routers, tensors, expected, layers)
    finally:
        RouterReplay.clear_global_router_replay_instances()
        if refs:
            release(refs)
        llm.llm_engine.engine_core.shutdown(timeout=30)
        del llm
